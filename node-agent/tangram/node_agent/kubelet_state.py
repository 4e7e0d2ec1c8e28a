"""What the agent reads of its node's kubelet: the CPU manager policy.

Allocate-on-execution rewrites a sandbox container's cpuset before and after each action.
The kubelet's CPU manager with policy ``static`` reconciles every container's cpuset to
its own pools every ``cpuManagerReconcilePeriod`` (10 s by default), which would undo
those writes in the middle of actions; with ``none`` nothing touches cpusets. So the pod
runtime refuses a node whose kubelet runs ``static`` (docs/install.md).

The policy is read where the kubelet keeps it, through the kubelet's own process (the
agent shares the host's PID namespace): its checkpoint ``<root-dir>/cpu_manager_state``
holds the running policy (a kubelet refuses to start when the checkpoint and its
configuration disagree), else its ``--cpu-manager-policy`` flag or ``--config`` file.
No mount, chart value or API permission is needed, and a kubelet with its own
``--root-dir`` is found the same way. A kubelet embedded in another binary (k3s runs it
inside its ``k3s server``/``k3s agent`` process) is read the same way, its settings
from that process's ``--kubelet-arg`` values.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

__all__ = ["DEFAULT_ROOT_DIR", "cpu_manager_policy"]

DEFAULT_ROOT_DIR = "/var/lib/kubelet"
CHECKPOINT = "cpu_manager_state"
# Processes that run a kubelet inside them (by their comm, at most 15 characters), and
# the flag whose values are that kubelet's own flags (``name=value``).
EMBEDDING = {"k3s": "--kubelet-arg", "k3s-server": "--kubelet-arg", "k3s-agent": "--kubelet-arg"}


def cpu_manager_policy(proc_root: Path = Path("/proc")) -> str | None:
    """The CPU manager policy of this node's kubelet; the strictest one when several
    kubelets are visible; None when none is (not on a Kubernetes node, or no host PID)."""
    found = [p for p in (_policy(pid) for pid in _kubelets(proc_root)) if p is not None]
    if not found:
        return None
    return "static" if "static" in found else found[0]


def _kubelets(proc_root: Path) -> list[Path]:
    out = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm == "kubelet" or comm in EMBEDDING:
                out.append(entry)
        except OSError:
            continue  # ended while we looked
    return sorted(out, key=lambda p: int(p.name))


def _policy(proc: Path) -> str | None:
    try:
        argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
        comm = (proc / "comm").read_text().strip()
    except OSError:
        return None
    flags = _flags(argv[1:]) if comm not in EMBEDDING else _embedded(argv[1:], EMBEDDING[comm])
    host = proc / "root"  # the kubelet's view of the file system (the host's)
    root_dir = flags.get("--root-dir", DEFAULT_ROOT_DIR)
    try:
        state = json.loads((host / root_dir.lstrip("/") / CHECKPOINT).read_text())
        return str(state["policyName"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no checkpoint yet (a kubelet that has just started): its configuration
    if "--cpu-manager-policy" in flags:
        return flags["--cpu-manager-policy"]
    config = flags.get("--config")
    if config:
        try:
            loaded = yaml.safe_load((host / config.lstrip("/")).read_text())
        except (OSError, yaml.YAMLError):
            return None
        if isinstance(loaded, dict):
            return str(loaded.get("cpuManagerPolicy") or "none")
    return "none"  # the kubelet's default


def _flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` pairs of a command line."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        out[name] = value
    return out


def _embedded(args: list[str], flag: str) -> dict[str, str]:
    """The kubelet flags an embedding process passes on, each ``flag`` value
    (``--kubelet-arg=cpu-manager-policy=static`` or ``--kubelet-arg cpu-manager-policy=static``,
    repeated) as ``--cpu-manager-policy=static``."""
    passed: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            passed.append(arg[len(flag) + 1 :])
        elif arg == flag and i + 1 < len(args):
            passed.append(args[i + 1])
    return _flags(["--" + a.removeprefix("--") for a in passed])
