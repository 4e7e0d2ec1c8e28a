"""The HTTP routes of the files API (``/v1/trajectories/{trajectory}/files``): handlers
only translate to ``Engine.files``.

No ``from __future__ import annotations`` here: the routes are made inside a function,
and FastAPI reads their annotations (the tenant dependency among them) as objects.
"""

import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from tangram.api.wire import (
    MAX_PATH,
    FileEntry,
    FileList,
    FileWritten,
    MadeDir,
    MakeDir,
    RenameFile,
    Unpacked,
)
from tangram.service.answers import error_body
from tangram.service.engine import Engine
from tangram.service.files import Download, NoSpaceError
from tangram.service.records import EngineError

FILES = "/v1/trajectories/{trajectory}/files"
_UPLOAD = re.compile(r"/v1/trajectories/[^/]+/files(/tar)?")
_BINARY = {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
}
_TAR = {
    "content": {
        kind: {"schema": {"type": "string", "format": "binary"}}
        for kind in ("application/x-tar", "application/gzip")
    }
}

Path = Annotated[
    str,
    Query(
        min_length=1,
        max_length=MAX_PATH,
        description="absolute inside the environment, or relative to its workdir; no '..'",
    ),
]


class CutShortError(Exception):
    """A download whose body could not be sent whole once its head was: the environment's
    read failed midway (a file that shrank, a tar member that cannot be read), or the data
    ended short of its ``Content-Length``. Its connection is closed there, so the client
    sees a broken download, never a silently short one; the log says so in one line (see
    ``_OneLine``), not with a traceback."""


class _OneLine(logging.Filter):
    """uvicorn logs what ends a response midway as "Exception in ASGI application" with
    its traceback; for a ``CutShortError``, which is no fault of the service's, the
    record becomes one warning line saying which download and why (one line: a path's
    newlines are escaped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CutShortError):
            record.msg, record.args = "%s", (str(exc).replace("\n", "\\n"),)
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_ONE_LINE = _OneLine()


class _Download(StreamingResponse):
    """A download's body, its first piece already in hand: whole, or cut off where it
    failed (``CutShortError``); its agent request closed whatever happens."""

    def __init__(self, got: Download, first: bytes | None, headers: dict[str, str],
                 media_type: str, what: str) -> None:  # fmt: skip
        super().__init__(got.data, media_type=media_type, headers=headers)
        self.got, self.first, self.what = got, first, what
        length = headers.get("Content-Length")
        self.length = int(length) if length is not None else None

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        sent = 0
        try:
            chunk = self.first
            while chunk is not None:
                sent += len(chunk)
                if self.length is not None and sent > self.length:
                    raise CutShortError(f"{self.what}: cut short: the environment sent "
                                        f"more than its {self.length} bytes")  # fmt: skip
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await anext(self.got.data, None)
        except EngineError as e:
            raise CutShortError(f"{self.what}: cut short after {sent} bytes: {e}") from None
        if self.length is not None and sent < self.length:
            raise CutShortError(f"{self.what}: cut short: {sent} of its {self.length} bytes "
                                "came (it shrank while it was read)")  # fmt: skip
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.got.data.aclose()
            await self.got.close()


async def download_response(
    got: Download, headers: Callable[[FileEntry], dict[str, str]], media_type: str,
    what: str = "a download",
) -> StreamingResponse:  # fmt: skip
    """A download as the response's body, with ``headers(entry)``; ``what`` names it in
    the log. Its first piece is read before the response starts, so that a read that
    fails at once is an error answer of its own (a 404, a 409), not a 200 cut short. Its
    agent request is closed if the response cannot be made, and even if the body never
    starts (the client may go first)."""
    try:
        first = await anext(got.data, None)
        return _Download(got, first, headers(got.entry), media_type, what)
    except BaseException:
        await got.close()
        raise


async def request_body(request: Request) -> AsyncIterator[bytes]:
    """The request's body as it comes. A client that goes before its end (the connection
    closed midway) is an ``EngineError`` naming ``body``, handled as any refusal (what it
    was writing is dropped, the old file kept), not an unhandled ``ClientDisconnect``
    logged with its traceback; its answer goes to nobody."""
    try:
        async for piece in request.stream():
            yield piece
    except ClientDisconnect:
        raise EngineError("invalid", "body", "the client went away before the body's end") from None


def attachment(name: str) -> str:
    """``Content-Disposition`` for a download named ``name``: RFC 6266's ``filename`` in
    printable ASCII (others become ``_``) for old clients, and ``filename*`` (RFC 5987)
    with the name whole, in UTF-8 (what is not valid UTF-8 becomes "?")."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in name)
    whole = quote(name.encode("utf-8", "replace"), safe="")
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{whole}"


def is_upload(scope: Scope) -> bool:
    """A file upload, whose body may be as large as ``admission.maxFileBytes``."""
    return scope["method"] == "PUT" and _UPLOAD.fullmatch(scope["path"]) is not None


def add_file_routes(
    app: FastAPI, engine: Engine, tenant: Any, errors: dict[int | str, Any]
) -> None:
    """``tenant``: the dependency that names the caller's tenant (``TenantId``)."""
    errors = {**errors, NoSpaceError.status: errors[413]}
    logging.getLogger("uvicorn.error").addFilter(_ONE_LINE)  # (once: the same filter)

    # (A handler of the most specific class answers: this one, not the app's EngineError's.)
    @app.exception_handler(NoSpaceError)
    async def _no_space(_: Request, exc: NoSpaceError) -> JSONResponse:
        details = [{"field": exc.field, "message": exc.message}]
        return JSONResponse(error_body(exc.code, str(exc), details), status_code=exc.status)

    @app.get(FILES, responses={**errors, 200: _BINARY}, response_class=StreamingResponse)
    async def read_file(trajectory: str, path: Path, who: tenant) -> StreamingResponse:
        """The file's bytes, streamed as the environment's exec server reads them."""
        got = await engine.files.read(who, trajectory, path)
        what = f"the download of {path} (trajectory {trajectory})"
        return await download_response(got, _file_headers, "application/octet-stream", what)

    @app.put(FILES, responses=errors, openapi_extra={"requestBody": {"required": True, **_BINARY}})
    async def write_file(
        trajectory: str,
        path: Path,
        request: Request,
        who: tenant,
        mode: Annotated[str, Query(pattern=r"^0?[0-7]{3}$", description="octal")] = "644",
    ) -> FileWritten:
        """Write the request body to the file, atomically: readers see the old file or
        the whole new one; the parent directory must exist."""
        body = request_body(request)
        size = await engine.files.write(who, trajectory, path, body, int(mode, 8))
        return FileWritten(path=path, size=size)

    @app.get(FILES + "/tar", responses={**errors, 200: _TAR}, response_class=StreamingResponse)
    async def read_tar(trajectory: str, path: Path, who: tenant) -> StreamingResponse:
        """The directory as a tar, streamed as the exec server walks it: members named
        relative to it, symlinks kept as symlinks (never followed), FIFOs and devices
        left out. A failure midway (a file the environment's user cannot read) cuts
        the body short, so the tar is incomplete, never silently partial."""
        got = await engine.files.tar(who, trajectory, path)
        what = f"the tar of {path} (trajectory {trajectory})"
        return await download_response(got, _tar_headers, "application/x-tar", what)

    @app.put(
        FILES + "/tar", responses=errors, openapi_extra={"requestBody": {"required": True, **_TAR}}
    )
    async def write_tar(trajectory: str, path: Path, request: Request, who: tenant) -> Unpacked:
        """Extract the request body, a tar or a gzipped tar, into the directory ``path``
        (made with its parents if missing), merging with what is there. Nothing lands
        outside it: a '..' member, a symlink out of it and a member through such a
        symlink are refused (403, naming the member), as are devices and FIFOs (400).
        Each file lands whole; a tar refused midway keeps the members before the one
        named."""
        done = await engine.files.untar(who, trajectory, path, request_body(request))
        return Unpacked(path=path, members=done.members or 0, size=done.written or 0)

    @app.delete(FILES, responses=errors)
    async def remove_file(trajectory: str, path: Path, who: tenant) -> dict[str, str]:
        """Remove a file, a symlink (not what it points to) or a directory tree."""
        await engine.files.ask(who, trajectory, "remove", path)
        return {"removed": path}

    @app.get(FILES + "/list", responses=errors)
    async def list_files(trajectory: str, who: tenant, path: Path = ".") -> FileList:
        """The members of a directory (symlinks not followed)."""
        found = await engine.files.ask(who, trajectory, "list", path)
        return FileList(path=path, entries=found.entries)

    @app.get(FILES + "/stat", responses=errors)
    async def stat_file(trajectory: str, path: Path, who: tenant) -> FileEntry:
        found = await engine.files.ask(who, trajectory, "stat", path)
        assert found.entry is not None  # a stat that succeeds has one
        return found.entry

    @app.post(FILES + "/mkdir", responses=errors)
    async def make_dir(trajectory: str, req: MakeDir, who: tenant) -> MadeDir:
        """Make a directory and its missing parents."""
        found = await engine.files.ask(who, trajectory, "mkdir", req.path)
        return MadeDir(path=req.path, created=bool(found.created))

    @app.post(FILES + "/rename", responses=errors)
    async def rename_file(trajectory: str, req: RenameFile, who: tenant) -> RenameFile:
        await engine.files.ask(who, trajectory, "rename", req.path, to=req.to)
        return req


def _file_headers(entry: FileEntry) -> dict[str, str]:
    return {"Content-Length": str(entry.size), "X-Tangram-Mode": f"{entry.mode:o}"}


def _tar_headers(entry: FileEntry) -> dict[str, str]:
    name = entry.name if entry.name != "/" else "root"
    return {"Content-Disposition": attachment(f"{name}.tar")}
