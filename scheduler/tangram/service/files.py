"""The files API of a trajectory: each operation goes straight to the agent that holds
its environment, which has the environment's exec server do it. Nothing is queued and no
core is taken: a file operation runs no command.

Paths are absolute inside the environment, or relative to its workdir; a ``..``
component is refused here, before any agent sees it, and a path that leaves the
environment through a symlink is refused by the exec server (403).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
)
from dataclasses import dataclass

from tangram.api.gunzip import GzipError, inflated
from tangram.api.wire import (
    FILES_FEATURE,
    STREAM_CHUNK,
    TAR_FEATURE,
    AgentFiles,
    AgentReply,
    FileEntry,
    FileOp,
    FilesOutcome,
)
from tangram.service.agents import AgentLink
from tangram.service.records import EngineError, ErrorKind, TrajectoryRecord
from tangram.service.state import PoolState, agent_gone

# What each refusal of the environment's is, to the caller.
_KINDS: dict[int, ErrorKind] = {
    errno.ENOENT: "not_found",
    errno.EACCES: "forbidden",
    errno.EPERM: "forbidden",
    errno.EROFS: "forbidden",
    errno.EXDEV: "forbidden",  # RESOLVE_BENEATH: a symlink out of the directory
    errno.ELOOP: "forbidden",  # a /proc magic link, or a symlink loop
    errno.EEXIST: "conflict",
    errno.ENOTEMPTY: "conflict",
    errno.EBUSY: "invalid",  # a mount point (the environment's root, its workdir volume)
    errno.ENOTDIR: "invalid",
    errno.EISDIR: "invalid",
    errno.EINVAL: "invalid",
    errno.ENAMETOOLONG: "invalid",
    errno.EFBIG: "too_large",  # over a bound (a file of /proc read whole: 16 MiB)
    errno.ESTALE: "conflict",  # a file that shrank while it was read: read it again
    errno.EBADMSG: "invalid",  # an untar's body that is no tar (or is cut short)
    errno.E2BIG: "too_large",  # a directory of more entries than one listing carries
}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # not the caller's: ``NoSpaceError``
_WHY = {
    errno.EXDEV: "it leads out of the environment through a symlink",
    errno.ELOOP: "it goes through a /proc magic link or a symlink loop",
    errno.EBUSY: "it is a mount point of the environment (its root or a volume)",
    errno.ENOSPC: "the environment's disk is full or at its limit",
    errno.EDQUOT: "the environment's disk is at its limit",
}


# In a write's mode, above the permission bits: write through a symlink at the path and
# keep the mode of the file replaced (E2B's writes, as envd's); the agent's
# ``env_files.KEEP_MODE``, the same number (the wire's mode is an int).
KEEP_MODE = 1 << 16
_GZIP = b"\x1f\x8b"


class NoSpaceError(EngineError):
    """The environment's disk is full, or at its limit (ENOSPC, EDQUOT): no fault of the
    request's size (413) and nothing a retry soon mends, but a state of the environment
    that freeing space ends. Answered 507 (Insufficient Storage), as envd answers it
    (E2B's SDK: ``NotEnoughSpaceException``). Its ``kind`` is the nearest of the engine's
    (``too_large``) for whoever reads only that."""

    status = 507
    code = "no_space"

    def __init__(self, field: str, message: str) -> None:
        super().__init__("too_large", field, message)


# The operations that change what is at their path (and a rename's ``to``).
CHANGES = frozenset({"write", "mkdir", "remove", "rename", "untar"})
RESERVED = (
    "/.tangram is reserved for the exec server (its binary and socket): the files API "
    "changes nothing in it"
)


def check_path(path: str, field: str = "path", changes: bool = False) -> str:
    """A path the agents are asked about (its length the route's models check): no NUL,
    no ``..`` component; ``changes``: not at or under ``/.tangram`` either (the
    environment's exec server refuses that too, also through a relative path or a
    symlink: here it is refused before anything else of the request is done)."""
    if "\0" in path:
        raise EngineError("invalid", field, f"{path[:200]!r}: a path cannot hold NUL")
    parts = path.split("/")
    if ".." in parts:
        raise EngineError(
            "forbidden",
            field,
            f"{path}: a '..' component is refused (paths stay in the environment)",
        )
    named = [p for p in parts if p not in ("", ".")]
    if changes and path.startswith("/") and named[:1] == [".tangram"]:
        raise EngineError("forbidden", field, f"{path}: {RESERVED}")
    return path


@dataclass(frozen=True, slots=True)
class Download:
    """A file being read: its entry, then its bytes, which end the read when taken or
    closed; ``close`` ends it too, whether or not they were started (the client may go
    before they start)."""

    entry: FileEntry
    data: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]


class Files:
    def __init__(self, state: PoolState) -> None:
        self.state = state

    def _request(
        self, tenant: str, tid: str, action: FileOp, path: str, **kw: object
    ) -> tuple[AgentLink, AgentFiles, TrajectoryRecord]:
        check_path(path, changes=action in CHANGES)
        traj = self.state.usable(tenant, tid)
        link = self.state.link(traj.node)
        # An agent with tar streams has the files API too (it came first).
        need, what = (
            (TAR_FEATURE, "directories as tar streams")
            if action in ("tar", "untar")
            else (FILES_FEATURE, "the files API")
        )
        if need not in link.hello.features:
            raise EngineError(
                "failed",
                "trajectory",
                f"{tid}: the agent of node {traj.node} predates {what}; upgrade the node agents",
            )
        req = AgentFiles(trajectory=traj.key, action=action, path=path, **kw)
        return link, req, traj

    def _in_use(self, traj: TrajectoryRecord) -> Callable[[], None]:
        """``traj`` has a files request under way, and is not idle, until the call this
        returns (which may come more than once)."""
        traj.transfers += 1
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                traj.transfers -= 1
                traj.active_at = self.state.clock()

        return end

    async def ask(
        self, tenant: str, tid: str, action: FileOp, path: str, **kw: object
    ) -> FilesOutcome:
        """list, stat, mkdir, remove, rename: one request, one reply."""
        if action == "rename":
            check_path(str(kw.get("to") or ""), "to", changes=True)
        link, req, traj = self._request(tenant, tid, action, path, **kw)
        end = self._in_use(traj)
        try:
            with _closed_under(traj):
                reply = await self.state.ask(link.node, req)
                said = reply.error or ""
                if action == "rename" and said.startswith("rename to "):
                    return _outcome(reply, str(kw.get("to")), field="to")  # the target's
                # A refusal of the rename itself names both paths, and says it all (its
                # EXDEV is two file systems, not a symlink leading out).
                both = action == "rename" and said.startswith("rename ") and " to " in said
                return _outcome(reply, path, told=both)
        finally:
            end()

    async def read(self, tenant: str, tid: str, path: str) -> Download:
        """A file's entry, then its bytes."""
        return await self._download(tenant, tid, path, "read")

    async def tar(self, tenant: str, tid: str, path: str) -> Download:
        """A directory's entry, then the directory as a tar."""
        return await self._download(tenant, tid, path, "tar")

    async def _download(self, tenant: str, tid: str, path: str, action: FileOp) -> Download:
        link, req, traj = self._request(tenant, tid, action, path)

        async def close() -> None:
            end()
            await stream.close()

        with _closed_under(traj), agent_gone(link.node):
            stream = link.stream(req)
            end = self._in_use(traj)  # (after: a stream that never opened holds nothing)
            try:
                head = await stream.next()
                if head is None or head.files is None or head.files.entry is None:
                    _outcome(await stream.reply(), path)  # raises why it ended
                    raise EngineError("failed", "path", f"{path}: the agent sent no entry")
            except BaseException:
                await close()
                raise

        async def data() -> AsyncGenerator[bytes, None]:
            try:
                with _closed_under(traj), agent_gone(link.node):
                    async for chunk in stream.data():
                        yield chunk
                    _outcome(await stream.reply(), path)  # a read that failed midway raises
            finally:
                await close()

        return Download(head.files.entry, data(), close)

    async def write(
        self, tenant: str, tid: str, path: str, body: AsyncIterable[bytes], mode: int
    ) -> int:
        """Write the file from ``body``; it replaces ``path`` only once whole."""
        if path.endswith("/"):  # (the environment's path walk drops it: a.txt/ is a.txt)
            raise EngineError("invalid", "path", f"{path}: a file's path cannot end in '/'")
        done = await self._upload(tenant, tid, path, body, "write", mode=mode)
        return done.written or 0

    async def untar(
        self, tenant: str, tid: str, path: str, body: AsyncIterable[bytes]
    ) -> FilesOutcome:
        """Extract the tar (or gzipped tar) of ``body`` into the directory ``path``. A
        gzipped one is inflated here, held to ``admission.maxFileBytes`` as inflated (a
        plain tar is held to it as sent): a small body may inflate to any size."""
        plain = tar_inflated(body, self.state.config.max_file_bytes)
        return await self._upload(tenant, tid, path, plain, "untar")

    async def _upload(
        self, tenant: str, tid: str, path: str, body: AsyncIterable[bytes], action: FileOp,
        **kw: object,
    ) -> FilesOutcome:  # fmt: skip
        link, req, traj = self._request(tenant, tid, action, path, **kw)
        end = self._in_use(traj)
        try:
            with _closed_under(traj), agent_gone(link.node):
                stream = link.stream(req)
                try:
                    async for chunk in _whole_chunks(body):
                        if not await stream.send(chunk):
                            break  # refused: the reply says why
                    else:
                        stream.end_input()
                    reply = await stream.reply()
                    # A body that is no tar (or is cut short) is the body's fault, as a
                    # body that is no gzip is, not the path's.
                    blame = "body" if action == "untar" and reply.errno == errno.EBADMSG else "path"
                    done = _outcome(reply, path, told=action == "untar", field=blame)
                finally:
                    await stream.close()  # a body that broke off cancels the write
        finally:
            end()
        return done


@contextlib.contextmanager
def _closed_under(traj: TrajectoryRecord) -> Iterator[None]:
    """A request that the trajectory's close cut off says so: a 409, as one sent after
    the close, not the agent's words for its environment going (a 502, read as a broken
    node)."""
    try:
        yield
    except EngineError:
        if not traj.state.closed:
            raise
        why = f" ({traj.ended})" if traj.ended else ""
        raise EngineError(
            "conflict", "trajectory", f"{traj.id} was closed during the request{why}"
        ) from None


async def inflated_within(body: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    """``body``, gzip, inflated a bounded piece at a time and held to ``limit`` bytes
    (``admission.maxFileBytes``) once inflated, as a plain body is as sent: a body that
    inflates past it is ``too_large``, one that is not whole gzip (empty, cut short,
    trailing bytes) ``invalid``, both naming ``body``. The one way every gzip upload (a
    file through E2B's envd, a tar through the files API) is read."""
    size = 0
    try:
        async for piece in inflated(body):
            size += len(piece)
            if size > limit:
                why = f"over {limit} bytes once inflated (admission.maxFileBytes)"
                raise EngineError("too_large", "body", why)
            yield piece
    except GzipError as e:
        raise EngineError("invalid", "body", str(e)) from None


async def tar_inflated(body: AsyncIterable[bytes], limit: int) -> AsyncIterator[bytes]:
    """A tar's body as it is, or, if it begins as gzip does, ``inflated_within`` the
    limit."""
    source = aiter(body)
    first = b""
    async for chunk in source:
        first += chunk
        if len(first) >= len(_GZIP):
            break
    rest = _then(first, source)
    if not first.startswith(_GZIP):
        async for chunk in rest:
            yield chunk
        return
    async for piece in inflated_within(rest, limit):
        yield piece


async def _then(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


async def _whole_chunks(body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """``body`` in pieces of ``STREAM_CHUNK`` (the last one shorter): an HTTP body comes
    in pieces of a few KiB, and each message on the link costs as much as its bytes."""
    pending = bytearray()
    async for piece in body:
        pending += piece
        while len(pending) >= STREAM_CHUNK:
            yield bytes(pending[:STREAM_CHUNK])
            del pending[:STREAM_CHUNK]
    if pending:
        yield bytes(pending)


def _outcome(reply: AgentReply, path: str, told: bool = False, field: str = "path") -> FilesOutcome:
    """The outcome of a reply, or why it failed, blaming ``path`` (the request's ``field``);
    ``told``: the environment's message says it all already (an untar's names the member
    it refused)."""
    if reply.ok and reply.files is not None:
        return reply.files
    message = reply.error or "the agent did not say"
    if reply.errno is None:  # not the environment's refusal: the trajectory or its agent
        raise EngineError("unavailable" if reply.retryable else "failed", "trajectory", message)
    why = None if told else _WHY.get(reply.errno)
    said = f"{path}: {why}" if why else message
    if reply.errno in _NO_SPACE:
        raise NoSpaceError(field, said)
    raise EngineError(_KINDS.get(reply.errno, "failed"), field, said)
