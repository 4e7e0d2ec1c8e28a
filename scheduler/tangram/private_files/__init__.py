"""Files that are their owner's alone, and the lock that keeps a file or a directory to one
process: what the node agent keeps in its state directory (the key journal, environments'
metadata) and what the scheduler keeps (its learned state, the token file). A package of
its own: both import it, and neither may import the other. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["LockHeldError", "let_go", "private_dir", "take_lock", "write_private"]

OWNER_ONLY = 0o700


def private_dir(path: Path, *, narrow: bool = False) -> Path:
    """``path``, a directory made 0700 if missing (its parents too). ``narrow``: one that
    exists with a wider mode (an earlier release's, or a looser umask's) is narrowed too,
    for a directory that is this program's own (an agent's ``--state-dir``), never for
    one a file was merely named in (``--learned-file /var/lib/x.json``). Only ``path``
    itself, and never a directory of another user, a shared one (the sticky bit, as
    /tmp) or the file system's root."""
    path.mkdir(parents=True, exist_ok=True, mode=OWNER_ONLY)
    if not narrow:
        return path
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    shared = bool(mode & stat.S_ISVTX) or st.st_uid != os.geteuid() or path.resolve() == Path("/")
    if mode & ~OWNER_ONLY and not shared:
        os.chmod(path, mode & OWNER_ONLY)  # narrowed, never widened: the owner's bits kept
    return path


def write_private(
    path: Path, data: bytes | Iterable[bytes], *, sync: bool = False, exclusive: bool = False
) -> None:
    """Put ``data`` (or its chunks, written as they come) at ``path``, readable by this
    user alone (0600; its directory, if made, 0700), whole or not at
    all: it is written to a temporary file beside it and renamed over it, so a reader, or
    a process killed mid-write, finds the old file or the new one.

    ``sync``: the data reaches the disk before the rename (a crash of the node then leaves
    the old file or the new, never an empty one); without it, it is in the page cache,
    which outlives the process but not the node. ``exclusive``: FileExistsError instead of
    replacing a file already at ``path``."""
    private_dir(path.parent)
    # A name of its own each time (0600, O_EXCL, close-on-exec): two writers of one path
    # never share a temporary file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, "wb") as out:
            for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                out.write(chunk)
            if sync:
                out.flush()
                os.fsync(out.fileno())
        if exclusive:
            os.link(tmp, path)  # FileExistsError when there is one: it is left as it was
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # (renamed, or what a failed write left)


class LockHeldError(Exception):
    """Another holds the lock: another process, or another open of it in this one."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path = path
        self.holder = holder  # the pid its holder wrote in it, or "unknown"


def take_lock(path: Path) -> int:
    """Hold the lock file ``path`` (made 0600; its directory, if made, 0700) until
    :func:`let_go` or the process's end; its descriptor. An advisory lock (flock) that
    the kernel lets go of with the descriptor, however the process ends, so none is
    ever stale. Held, naming the holder, when another has it: locks belong to an open of
    the file, so a second open in this same process is refused as well."""
    private_dir(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LockHeldError(path, holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)  # (the last holder's pid)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message of the next one refused
    return fd


def let_go(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # (the lock goes with it)
