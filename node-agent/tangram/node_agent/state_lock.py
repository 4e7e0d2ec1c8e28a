"""One agent per state directory: two agents sharing one (a second `tangram up` with the
default directory) would take each other's environments as their own leftovers, remove
them at exit, hand out the same cores twice and write one key journal."""

from __future__ import annotations

from pathlib import Path

from tangram.node_agent.execution import ExecError
from tangram.private_files import LockHeldError, let_go, take_lock

LOCK_FILE = "agent.lock"


class InUseError(ExecError):
    """Another process's agent holds the state directory."""


def hold(state_dir: Path) -> int:
    """Take ``state_dir`` (made private: it holds commands' output and tenants' names) for
    this process until it exits (or ``release``); the lock's descriptor. InUseError naming
    the holder when another process has it."""
    try:
        return take_lock(state_dir / LOCK_FILE)
    except LockHeldError as e:
        raise InUseError(
            f"--state-dir {state_dir} is in use by another agent (pid {e.holder}); give each "
            "agent its own state directory"
        ) from None


def release(fd: int) -> None:
    let_go(fd)
