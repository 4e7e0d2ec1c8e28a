"""The HTTP routes of the files API (``/v1/trajectories/{trajectory}/files``): handlers
only translate to ``Engine.files``.

No ``from __future__ import annotations`` here: the routes are made inside a function,
and FastAPI reads their annotations (the tenant dependency among them) as objects.
"""

import re
from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Scope

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


async def download_response(
    got: Download, headers: Callable[[FileEntry], dict[str, str]], media_type: str
) -> StreamingResponse:
    """A download as the response's body, with ``headers(entry)``: its agent request is
    closed if the response cannot be made, and even if the body never starts (the client
    may go first)."""
    try:
        return StreamingResponse(got.data, media_type=media_type, headers=headers(got.entry),
                                 background=BackgroundTask(got.close))  # fmt: skip
    except BaseException:
        await got.close()
        raise


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

    # (A handler of the most specific class answers: this one, not the app's EngineError's.)
    @app.exception_handler(NoSpaceError)
    async def _no_space(_: Request, exc: NoSpaceError) -> JSONResponse:
        details = [{"field": exc.field, "message": exc.message}]
        return JSONResponse(error_body(exc.code, str(exc), details), status_code=exc.status)

    @app.get(FILES, responses={**errors, 200: _BINARY}, response_class=StreamingResponse)
    async def read_file(trajectory: str, path: Path, who: tenant) -> StreamingResponse:
        """The file's bytes, streamed as the environment's exec server reads them."""
        got = await engine.files.read(who, trajectory, path)
        return await download_response(got, _file_headers, "application/octet-stream")

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
        size = await engine.files.write(who, trajectory, path, request.stream(), int(mode, 8))
        return FileWritten(path=path, size=size)

    @app.get(FILES + "/tar", responses={**errors, 200: _TAR}, response_class=StreamingResponse)
    async def read_tar(trajectory: str, path: Path, who: tenant) -> StreamingResponse:
        """The directory as a tar, streamed as the exec server walks it: members named
        relative to it, symlinks kept as symlinks (never followed), FIFOs and devices
        left out. A failure midway (a file the environment's user cannot read) cuts
        the body short, so the tar is incomplete, never silently partial."""
        got = await engine.files.tar(who, trajectory, path)
        return await download_response(got, _tar_headers, "application/x-tar")

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
        done = await engine.files.untar(who, trajectory, path, request.stream())
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
