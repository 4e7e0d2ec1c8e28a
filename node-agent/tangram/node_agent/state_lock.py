"""One agent per state directory: two agents sharing one (a second `tangram up` with the
default directory) would take each other's environments as their own leftovers, remove
them at exit, hand out the same cores twice and write one key journal. And one pool: a
directory named after a pool that was deleted and made again is the new pool's, with
nothing of the old one's in it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tangram.node_agent.execution import ExecError
from tangram.private_files import LockHeldError, let_go, take_lock, write_private

log = logging.getLogger("tangram.node_agent")

LOCK_FILE = "agent.lock"
POOL_FILE = "pool-uid"  # the uid of the ActionPool whose agents wrote this directory
JOURNAL_FILE = "keys.journal"  # its keyed runs' answers (key_journal)
META_DIR = "meta"  # its trajectories' metadata
# What a pool's agents keep for their successors.
POOL_STATE = (JOURNAL_FILE, META_DIR)


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


def claim(state_dir: Path, pool_uid: str) -> None:
    """Make ``state_dir`` the ActionPool ``pool_uid``'s. Its path names the pool by
    namespace and name, which a pool deleted and made again shares with the old one:
    what the old one's agents left there (its key journal, whose answers a retry of the
    same key would get instead of a run; its trajectories) is removed first. A directory
    with no owner written yet (an agent before this file) is taken as it is."""
    mark = state_dir / POOL_FILE
    try:
        was = mark.read_text().strip()
    except FileNotFoundError:
        was = None
    if was == pool_uid:
        return
    if was is not None:
        log.warning("%s was ActionPool uid %s's, deleted since: removing what its agents "
                    "left (%s)", state_dir, was, ", ".join(POOL_STATE))  # fmt: skip
        for name in POOL_STATE:
            path = state_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    write_private(mark, pool_uid.encode(), sync=True)
