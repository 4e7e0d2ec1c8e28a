"""One agent per state directory: two agents sharing one (a second `tangram up` with the
default directory) would take each other's environments as their own leftovers, remove
them at exit, hand out the same cores twice and write one key journal."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from tangram.node_agent.execution import ExecError

LOCK_FILE = "agent.lock"


class InUseError(ExecError):
    """Another process's agent holds the state directory."""


def hold(state_dir: Path) -> int:
    """Take ``state_dir`` for this process until it exits (or ``release``); the lock's
    descriptor. InUseError naming the holder when another process has it."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise InUseError(
            f"--state-dir {state_dir} is in use by another agent (pid {holder}); give each "
            "agent its own state directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # (the lock goes with it)
