"""Reading a node's inventory from sysfs and procfs (and NVML through ``gpus.py``).

The roots are arguments so that tests read real file trees laid out like other machines
(cgroup v1 or v2, several NUMA nodes, offline cores) and production reads ``/``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tangram.api.inventory import GpuInfo, NodeInventory


class InventoryError(RuntimeError):
    """The node's description could not be read; the message names the file."""


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's cpulist format, e.g. ``"0-3,8,10-11"``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a cpulist: {text.strip()!r}") from None
        if last < first:
            raise ValueError(f"not a cpulist: {text.strip()!r}")
        out.extend(range(first, last + 1))
    return sorted(set(out))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise InventoryError(f"{path}: {e.strerror}") from None


def numa_layout(sys_root: Path) -> list[list[int]]:
    """Online cores per NUMA node; one node holding every online core when there is no NUMA."""
    online = set(parse_cpulist(_read(sys_root / "devices/system/cpu/online")))
    node_dir = sys_root / "devices/system/node"
    nodes = sorted(
        (p for p in node_dir.glob("node[0-9]*") if p.name[4:].isdigit()),
        key=lambda p: int(p.name[4:]),
    )
    layout = [[c for c in parse_cpulist(_read(p / "cpulist")) if c in online] for p in nodes]
    layout = [cores for cores in layout if cores]
    return layout or [sorted(online)]


def memory_gb(proc_root: Path) -> float:
    for line in _read(proc_root / "meminfo").splitlines():
        if line.startswith("MemTotal:"):
            kib = int(line.split()[1])
            return kib / (1024 * 1024)
    raise InventoryError(f"{proc_root / 'meminfo'}: no MemTotal line")


def cgroup_version(cgroup_root: Path) -> Literal[1, 2]:
    """2 on a unified hierarchy; 1 where cpuset is a v1 controller (hybrid layouts included)."""
    if (cgroup_root / "cgroup.controllers").is_file():
        return 2
    if (cgroup_root / "cpuset").is_dir():
        return 1
    raise InventoryError(f"{cgroup_root}: neither a cgroup v2 root nor a v1 cpuset hierarchy")


def node_id(etc_root: Path, hostname: str) -> str:
    """The machine id (stable across reboots and agent restarts), else the hostname."""
    path = etc_root / "machine-id"
    if path.is_file():
        value = path.read_text(encoding="utf-8").strip()
        if value:
            return value
    return hostname


def read_inventory(
    root: Path = Path("/"),
    *,
    hostname: str | None = None,
    gpus: Callable[[], list[GpuInfo]] | None = None,
) -> NodeInventory:
    """The inventory of the node whose file system is at ``root``.

    ``gpus`` lists the GPUs (``tangram.node_agent.gpus.nvml_gpus`` in production); without
    it the node reports none.
    """
    host = hostname or socket.gethostname()
    return NodeInventory(
        node_id=node_id(root / "etc", host),
        hostname=host,
        numa=numa_layout(root / "sys"),
        memory_gb=memory_gb(root / "proc"),
        cgroup_version=cgroup_version(root / "sys/fs/cgroup"),
        gpus=gpus() if gpus is not None else [],
    )
