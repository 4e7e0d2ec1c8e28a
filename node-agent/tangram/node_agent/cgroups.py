"""Writing CPU limits into cgroups, v1 and v2 (the allocate-on-execution primitive).

A *group* is a path relative to the hierarchy root, e.g. ``tangram/traj-17``. Limits are
an exact core set (cpuset) plus a CFS quota in cores. Processes join a group by writing
their pid into ``cgroup.procs`` — the runtimes do it from the child before ``exec`` so
that a command never runs a single instruction outside its cores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

PERIOD_US = 100_000


def format_cpulist(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpulist format)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value, encoding="utf-8")
    except OSError as e:
        raise CgroupError(f"writing {value!r} to {path}: {e.strerror}") from None


class CgroupError(RuntimeError):
    """A cgroup operation failed; the message names the file."""


class Cgroups(Protocol):
    version: Literal[1, 2]

    def create(self, group: str) -> None: ...
    def limit(self, group: str, cores: Sequence[int], quota_cores: float | None) -> None: ...
    def join_files(self, group: str) -> list[str]: ...
    def cpus(self, group: str) -> str: ...
    def pids(self, group: str) -> list[int]: ...
    def remove(self, group: str) -> None: ...
    def oom_kills(self, group: str) -> int | None: ...


class _Reads:
    """What both versions read of a group: its cores and its processes."""

    cpuset: Path  # the hierarchy holding the groups' cpuset.cpus and cgroup.procs

    def cpus(self, group: str) -> str:
        return (self.cpuset / group / "cpuset.cpus").read_text(encoding="utf-8").strip()

    def pids(self, group: str) -> list[int]:
        text = (self.cpuset / group / "cgroup.procs").read_text(encoding="utf-8")
        return [int(p) for p in text.split()]

    def oom_kills(self, group: str) -> int | None:
        """How many processes of the group the kernel's OOM killer has killed; None when
        the group has no memory controller here (or a kernel before 4.13 counts none).
        Read on every action: a few system calls, no path built again."""
        paths: dict[str, str] = self.__dict__.setdefault("_oom_paths", {})
        path = paths.get(group)
        if path is None:
            if len(paths) >= 4096:  # (groups of environments long gone)
                paths.clear()
            path = paths[group] = str(self._oom_file(group))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = b"\n" + os.read(fd, 4096)
            finally:
                os.close(fd)
        except OSError:
            return None
        at = data.find(b"\noom_kill ")
        if at < 0:
            return None
        end = data.find(b"\n", at + 1)
        return int(data[at + 10 : end if end >= 0 else None])

    def _oom_file(self, group: str) -> Path:
        raise NotImplementedError


class CgroupV1(_Reads):
    """Separate ``cpuset`` and ``cpu`` hierarchies (also hybrid systems)."""

    version: Literal[1, 2] = 1

    def __init__(self, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.cpuset = root / "cpuset"
        self.cpu = root / "cpu"

    def create(self, group: str) -> None:
        parts = Path(group).parts
        for i in range(1, len(parts) + 1):
            sub = Path(*parts[:i])
            for hierarchy in (self.cpuset, self.cpu):
                (hierarchy / sub).mkdir(exist_ok=True)
            # A v1 cpuset is unusable until it has cores and memory nodes: inherit them.
            node, parent = self.cpuset / sub, (self.cpuset / sub).parent
            for knob in ("cpuset.mems", "cpuset.cpus"):
                if not (node / knob).read_text(encoding="utf-8").strip():
                    _write(node / knob, (parent / knob).read_text(encoding="utf-8"))

    def limit(self, group: str, cores: Sequence[int], quota_cores: float | None) -> None:
        _write(self.cpuset / group / "cpuset.cpus", format_cpulist(cores))
        _write(self.cpu / group / "cpu.cfs_period_us", str(PERIOD_US))
        quota = -1 if quota_cores is None else max(1000, int(quota_cores * PERIOD_US))
        _write(self.cpu / group / "cpu.cfs_quota_us", str(quota))

    def join_files(self, group: str) -> list[str]:
        return [str(self.cpuset / group / "cgroup.procs"), str(self.cpu / group / "cgroup.procs")]

    def _oom_file(self, group: str) -> Path:
        return self.cpuset.parent / "memory" / group / "memory.oom_control"

    def remove(self, group: str) -> None:
        for hierarchy in (self.cpu, self.cpuset):
            path = hierarchy / group
            if path.exists():
                path.rmdir()


class CgroupV2(_Reads):
    """The unified hierarchy: ``cpuset.cpus`` and ``cpu.max`` in one directory."""

    version: Literal[1, 2] = 2

    def __init__(self, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.root = self.cpuset = root

    def create(self, group: str) -> None:
        parts = Path(group).parts
        for i in range(len(parts)):
            parent = self.root / Path(*parts[:i]) if i else self.root
            # Children only get cpuset/cpu files when the parent delegates the controllers.
            control = parent / "cgroup.subtree_control"
            enabled = control.read_text(encoding="utf-8").split() if control.exists() else []
            for ctrl in ("cpuset", "cpu"):
                if ctrl not in enabled:
                    _write(control, f"+{ctrl}")
            (self.root / Path(*parts[: i + 1])).mkdir(exist_ok=True)

    def limit(self, group: str, cores: Sequence[int], quota_cores: float | None) -> None:
        _write(self.root / group / "cpuset.cpus", format_cpulist(cores))
        quota = "max" if quota_cores is None else str(max(1000, int(quota_cores * PERIOD_US)))
        _write(self.root / group / "cpu.max", f"{quota} {PERIOD_US}")

    def join_files(self, group: str) -> list[str]:
        return [str(self.root / group / "cgroup.procs")]

    def _oom_file(self, group: str) -> Path:
        return self.root / group / "memory.events"

    def remove(self, group: str) -> None:
        path = self.root / group
        if path.exists():
            path.rmdir()


def detect(root: Path = Path("/sys/fs/cgroup")) -> CgroupV1 | CgroupV2:
    if (root / "cgroup.controllers").is_file():
        return CgroupV2(root)
    return CgroupV1(root)


def join(files: Sequence[str]) -> None:
    """Move the calling process into a group (runs in the child before exec)."""
    pid = str(os.getpid())
    for f in files:
        with open(f, "w", encoding="ascii") as fh:
            fh.write(pid)
