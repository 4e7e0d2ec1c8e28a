"""A trajectory's files, through its environment's exec server (``exec_files.c``).

The server does each operation as the environment's own user, inside its namespaces, so
nothing here touches the environment's files from the host: this side only builds the
request, streams the data and reads the answer. Docker and pod environments are reached
on their exec server's socket; the process runtime starts a one-shot server on a socket
pair (``tangram-execd --files DIR``), confined to the trajectory's directory.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import posixpath
import socket
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from pathlib import Path

from tangram.api.wire import MAX_PATH, STREAM_CHUNK, FileEntry, FileType
from tangram.node_agent import env_tar
from tangram.node_agent.exec_server import Channel
from tangram.node_agent.execution import ExecError

_TYPES: dict[bytes, FileType] = {b"f": "file", b"d": "dir", b"l": "symlink", b"o": "other"}
# A listing is one reply on the agent's link, whose frames are at most 64 MiB: it is cut
# off where it is made, past this many entries or bytes of them as the reply carries them.
MAX_LIST = 100_000
MAX_LIST_BYTES = 16 << 20
# In a write's mode, above the permission bits (``AgentFiles.mode`` is an int): write
# through a symlink at the path, keeping the mode of the file replaced (E2B's writes, as
# envd's). Older agents mask it away: the plain write. (``tangram.service.files`` holds
# the same number.)
KEEP_MODE = 1 << 16


class FileError(ExecError):
    """A file operation the environment refused; ``errno`` is its error number."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message, errno=code)


def inside(workdir: str, path: str) -> str:
    """``path`` as an absolute path inside the environment (relative ones start at
    ``workdir``); a ``..`` component is refused, never resolved (the server refuses it
    too)."""
    if not path or "\0" in path or len(path) > MAX_PATH:
        raise FileError(errno.EINVAL, f"path: {path!r} is empty, too long or holds NUL")
    if ".." in path.split("/"):
        raise FileError(errno.EPERM, f"path: {path!r} has a '..' component; give it without")
    full = posixpath.join(workdir or "/", path)
    return posixpath.normpath(full).replace("//", "/")  # normpath keeps a leading "//"


Connect = Callable[[], Awaitable[Channel]]


class EnvFiles:
    """The files of one environment: ``connect`` reaches its exec server, relative paths
    start at ``workdir``."""

    def __init__(self, connect: Connect, workdir: str) -> None:
        self._connect, self.workdir = connect, workdir

    async def _ask(self, op: str, path: str, arg: str = "") -> Channel:
        chan = await self._connect()
        try:
            await chan.ask_files(op, path, arg)
        except BaseException:
            chan.close()
            raise
        return chan

    async def stat(self, path: str) -> FileEntry:
        full = inside(self.workdir, path)
        entries = await self._entries("stat", full, posixpath.dirname(full))
        return entries[0]

    async def list(self, path: str) -> list[FileEntry]:
        """The directory's members; one of more than ``MAX_LIST`` (or ``MAX_LIST_BYTES``
        of them in the reply) is refused (``E2BIG``), read no further."""
        full = inside(self.workdir, path)
        return await self._entries("list", full, full)

    async def _entries(self, op: str, path: str, parent: str) -> builtins.list[FileEntry]:
        chan = await self._ask(op, path)
        try:
            found: builtins.list[FileEntry] = []
            size = 0
            while True:
                kind, data = await _answer(chan)
                if kind != b"1":
                    return found
                found.append(entry(data, parent))
                size += len(found[-1].model_dump_json()) + 1
                if len(found) > MAX_LIST or size > MAX_LIST_BYTES:
                    raise FileError(
                        errno.E2BIG,
                        f"{path}: the directory holds over {MAX_LIST} entries or "
                        f"{MAX_LIST_BYTES >> 20} MiB of them, more than one listing answers; "
                        "list a directory below it, or go through it with a command "
                        "(ls, find)",
                    )
        finally:
            chan.close()  # (one cut off: the server stops at its next entry)

    async def _opened(self, op: str, path: str) -> tuple[Channel, FileEntry]:
        """A read or a tar begun: its channel, and the entry the server sends first."""
        full = inside(self.workdir, path)
        chan = await self._ask(op, full)
        try:
            _, head = await _answer(chan)
            return chan, entry(head, posixpath.dirname(full))
        except BaseException:
            chan.close()
            raise

    async def read(self, path: str) -> tuple[FileEntry, AsyncGenerator[bytes, None]]:
        """The file's entry, and its bytes as the server sends them. The iterator must be
        run to its end or closed (``aclose``): it holds the connection."""
        chan, found = await self._opened("read", path)

        async def data() -> AsyncGenerator[bytes, None]:
            try:
                while True:
                    kind, chunk = await _answer(chan)
                    if kind != b"1":
                        return
                    yield chunk
            finally:
                chan.close()

        return found, data()

    async def tar(self, path: str) -> tuple[FileEntry, AsyncGenerator[bytes, None]]:
        """The directory's entry, and the directory as a tar: its members named by their
        paths relative to it, symlinks as symlinks, in pieces of up to about
        ``STREAM_CHUNK``. The iterator must be run to its end or closed."""
        chan, found = await self._opened("tar", path)

        async def data() -> AsyncGenerator[bytes, None]:
            out, pad = bytearray(), b""  # many small members make one piece
            try:
                while True:
                    kind, piece = await _answer(chan)
                    if kind == b"1":
                        out += piece
                    elif kind == b"S":
                        head, size = env_tar.header(piece)
                        out += pad + head
                        pad = env_tar.padding(size)
                    else:
                        yield bytes(out + pad + env_tar.END)
                        return
                    if len(out) >= STREAM_CHUNK:
                        yield bytes(out)
                        out.clear()
            finally:
                chan.close()

        return found, data()

    async def write(self, path: str, chunks: AsyncIterable[bytes], mode: int = 0o644) -> int:
        """Write the file whole from ``chunks``: it appears at ``path`` only once all of
        it is written (a reader sees the old file or the new one), with ``mode``. With
        ``KEEP_MODE`` in ``mode``: a symlink at ``path`` is written through (to a file
        inside the environment), and a file replaced keeps its mode."""
        arg = f"{mode & 0o7777:o}" + (":keep" if mode & KEEP_MODE else "")
        return int(await self._send("write", path, chunks, arg))

    async def untar(self, path: str, chunks: AsyncIterable[bytes]) -> tuple[int, int]:
        """Extract the tar (or gzipped tar) of ``chunks`` into the directory ``path``,
        made if missing; the members extracted and their bytes. Nothing lands outside
        ``path``; each file lands whole; a tar refused midway keeps what came before."""
        counts = await self._send("untar", path, env_tar.gunzipped(chunks))
        members, size = counts.split()
        return int(members), int(size)

    async def _send(self, op: str, path: str, chunks: AsyncIterable[bytes], arg: str = "") -> bytes:
        """Send ``chunks`` as the input of a write or an untar; what the server answers."""
        chan = await self._ask(op, inside(self.workdir, path), arg)
        try:
            await _answer(chan)  # ready: the path is good
            async for chunk in chunks:
                await chan.write(chunk)
            await chan.close_stdin()
            return (await _answer(chan))[1]
        finally:
            chan.close()  # before the end: the server removes what it was writing

    async def mkdir(self, path: str) -> bool:
        """Make the directory and its parents; False if it was a directory already."""
        return await self._done("mkdir", inside(self.workdir, path)) == b"1"

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole directory tree (symlinks not followed)."""
        await self._done("remove", inside(self.workdir, path))

    async def rename(self, path: str, to: str) -> None:
        await self._done("rename", inside(self.workdir, path), inside(self.workdir, to))

    async def _done(self, op: str, path: str, arg: str = "") -> bytes:
        chan = await self._ask(op, path, arg)
        try:
            return (await _answer(chan))[1]
        finally:
            chan.close()


async def _answer(chan: Channel) -> tuple[bytes, bytes]:
    """The next frame, with a refusal raised as a ``FileError``."""
    kind, data = await chan.frame()
    if kind == b"Z":
        raise _refusal(data.decode(errors="replace"))
    if kind == b"":
        raise ExecError("exec server: the connection ended before the answer")
    return kind, data


def _refusal(text: str) -> FileError:
    code, _, message = text.partition(" ")
    if "no such file operation" in message:  # older than the operation
        return FileError(
            errno.ENOSYS,
            f"this environment's exec server predates this file operation ({message}); "
            "close and reopen the trajectory to get one that serves it",
        )
    if not code.isdigit():  # an exec server older than the files API
        return FileError(
            errno.ENOSYS,
            f"this environment's exec server predates the files API ({text}); close and "
            "reopen the trajectory to get one that serves it",
        )
    return FileError(int(code), message)


def entry(data: bytes, parent: str) -> FileEntry:
    """An entry as the server sends it: type, mode, size, mtime (ns), uid, gid, name,
    symlink target, each NUL-terminated."""
    kind, mode, size, mtime, uid, gid, raw, target = data.split(b"\0")[:8]
    name = raw.decode(errors="replace")
    return FileEntry(
        name=name,
        path=posixpath.join(parent, name) if name != "/" else "/",
        type=_TYPES.get(kind, "other"),
        size=int(size),
        mode=int(mode, 8),
        mtime=int(mtime) / 1e9,
        uid=int(uid),
        gid=int(gid),
        target=target.decode(errors="replace") if kind == b"l" else None,
    )


_servers: set[asyncio.Future[int]] = set()  # one-shot servers, until they are reaped
ONE_SHOTS_END_S = 5.0  # each ends with its connection: at once, once that is closed


async def one_shots_ended(timeout_s: float = ONE_SHOTS_END_S) -> None:
    """Until every one-shot server started on this loop has ended and been reaped (within
    ``timeout_s``): a loop that closes first leaves asyncio's child watcher to log, as
    each ends, that the loop handling its pid is closed."""
    loop = asyncio.get_running_loop()
    mine = [f for f in _servers if f.get_loop() is loop]
    if mine:
        await asyncio.wait(mine, timeout=timeout_s)


def one_shot(binary: Path, root: Path, running: set[int] | None = None) -> Connect:
    """Connections to a fresh ``tangram-execd --files root`` each (the process runtime,
    whose trajectories have no exec server of their own); ``running``: where the pids of
    those still running are kept (closing the trajectory kills them)."""

    async def connect() -> Channel:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                str(binary), "--files", str(root), stdin=theirs.fileno(),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as e:
            ours.close()
            raise ExecError(f"the files server {binary}: {e.strerror}") from None
        except BaseException:  # cancelled as it started (asyncio kills that server)
            ours.close()
            raise
        finally:
            theirs.close()
        reaped = asyncio.ensure_future(proc.wait())  # it ends with the connection
        _servers.add(reaped)
        reaped.add_done_callback(_servers.discard)
        if running is not None:
            running.add(proc.pid)
            reaped.add_done_callback(lambda _: running.discard(proc.pid))
        return await Channel.over(ours)

    return connect
