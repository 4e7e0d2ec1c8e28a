"""envd, E2B's in-sandbox daemon, as the scheduler serves it for every sandbox at once: the
sandbox is named by the ``E2b-Sandbox-Id`` header (as E2B's own proxy routes it), the
caller by ``X-Access-Token`` (the tenant token the sandbox was created with).

Served: ``/health``, ``/files`` (download, upload as octet-stream or multipart, gzip), the
Filesystem service's Stat, ListDir, MakeDir, Remove and Move, and the Process service's
Start, Connect, SendInput, CloseStdin, SendSignal and List. Files go through the files
API (the environment's exec server; no core); commands are exec actions.

No ``from __future__ import annotations``: FastAPI reads the routes' annotations.
"""

import contextlib
import stat as stat_bits
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Scope

from tangram.api.wire import MAX_PATH, FileEntry
from tangram.service.e2b import process
from tangram.service.e2b.connect import (
    CODE_STATUS,
    STREAM_TYPE,
    ConnectError,
    end_of_stream,
    first_message,
    message,
    timeout_s,
    uint32,
)
from tangram.service.e2b.control import Admit, iso
from tangram.service.e2b.errors import ERRORS, E2BError, E2BRoute, port_problem
from tangram.service.e2b.multipart import file_parts
from tangram.service.e2b.sandboxes import Sandbox, Sandboxes
from tangram.service.engine import Engine
from tangram.service.file_routes import download_response, request_body
from tangram.service.files import KEEP_MODE, check_path, inflated_within
from tangram.service.records import EngineError

_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_BITS = {"file": stat_bits.S_IFREG, "dir": stat_bits.S_IFDIR, "symlink": stat_bits.S_IFLNK}
_STATUS_CODE = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
                404: "not_found", 413: "resource_exhausted", 429: "resource_exhausted",
                501: "unimplemented", 502: "unavailable", 503: "unavailable"}  # fmt: skip
MAX_LIST = 100_000  # entries a ListDir answers at most
MAX_DEPTH = MAX_PATH // 2  # levels a ListDir walks at most ("a/" each)

Path = Annotated[str, Query(min_length=1, max_length=MAX_PATH)]
Username = Annotated[str | None, Query(description="ignored: commands and files are the "
                                       "TrajectoryEnv's user's")]  # fmt: skip


def is_upload(scope: Scope) -> bool:
    """envd's file upload, whose body may be as large as ``admission.maxFileBytes``."""
    return bool(scope["method"] == "POST" and scope["path"] == "/files")


def too_large(scope: Scope, detail: str) -> Response | None:
    """A body over the pool's limit as envd's clients read a refusal, for a Connect call
    (None for any other route): an invalid argument, not the 413 that the SDK takes for
    rate limiting ("try again later"), which no retry would mend."""
    if not scope["path"].startswith(("/process.Process/", "/filesystem.Filesystem/")):
        return None
    error = ConnectError("invalid_argument", f"{detail} (admission.maxRequestBytes): send "
                         "it in parts")  # fmt: skip
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
    if content_type.startswith(STREAM_TYPE.encode()):  # (a stream answers 200, then why)
        return Response(end_of_stream(error), media_type=STREAM_TYPE)
    return JSONResponse(error.body(), status_code=CODE_STATUS[error.code])


Call = Callable[[str, Sandbox, dict[str, Any]], Awaitable[dict[str, Any]]]


def envd_routes(engine: Engine, sandboxes: Sandboxes, admit: Admit) -> APIRouter:
    router = APIRouter(route_class=E2BRoute, tags=["e2b envd"], responses=ERRORS)
    files = engine.files

    async def caller(request: Request) -> tuple[str, Sandbox]:
        who = await admit(request.headers.get("x-access-token"))
        if (problem := port_problem(request.headers)) is not None:
            raise E2BError(501, problem)
        sid = request.headers.get("e2b-sandbox-id")
        if not sid:
            raise E2BError(400, "E2b-Sandbox-Id: the header naming the sandbox is required "
                           "(set E2B_SANDBOX_URL to this service)")  # fmt: skip
        try:
            return who, sandboxes.find(who, sid)
        except EngineError as e:
            if e.kind != "not_found":
                raise
            # (saying why: a lost one's environment went, a closed one's reason)
            why = e.message if e.field == "sandbox" else f"sandbox {e.message}"
            raise E2BError(502, why) from None

    @router.get("/health", status_code=204, responses={502: {"description": "not running"}})
    async def health(request: Request) -> Response:
        await caller(request)
        return Response(status_code=204)

    @router.get("/files", response_class=StreamingResponse,
                responses={200: {"content": {"application/octet-stream": {}}}})  # fmt: skip
    async def download(path: Path, request: Request, username: Username = None) -> Response:
        who, box = await caller(request)
        got = await files.read(who, box.id, path)
        what = f"the download of {path} (sandbox {box.id})"
        return await download_response(got, _sized, "application/octet-stream", what)

    @router.post("/files", openapi_extra=_UPLOAD_DOC)
    async def upload(
        request: Request, path: Annotated[str | None, Query(max_length=MAX_PATH)] = None,
        username: Username = None,
    ) -> list[dict[str, str]]:  # fmt: skip
        """Write files: the body as one file at ``path`` (``application/octet-stream``,
        ``Content-Encoding: gzip`` allowed), or the ``file`` parts of a multipart body,
        each written as it streams in, one after another (at ``path`` if given, which
        names one file, else at its filename). Missing parent directories are made."""
        who, box = await caller(request)
        content_type = request.headers.get("content-type", "")
        written: list[dict[str, str]] = []
        if content_type.split(";")[0].strip().lower() == "multipart/form-data":
            parts = file_parts(request_body(request), content_type)
            async with aclosing(parts):
                async for filename, data in parts:
                    if path and written:  # (envd's: the first part is written, not the rest)
                        raise E2BError(400, f"path: names one file ({written[0]['path']}, "
                                       "written): several file parts are named each by "
                                       "its filename, without ?path=")  # fmt: skip
                    if not (path or filename):
                        raise E2BError(400, "path: a part without a filename needs ?path=")
                    written.append(await _write(who, box, path or filename, data))
            if not written:
                raise E2BError(400, "file: the multipart body has no file part")
        else:
            if not path:
                raise E2BError(400, "path: required for an octet-stream upload")
            body: AsyncIterator[bytes] = request_body(request)
            if request.headers.get("content-encoding", "").lower() == "gzip":
                # The file it makes is held to admission.maxFileBytes, not just its
                # compressed bytes (413); a body that is no whole gzip is 400.
                body = inflated_within(body, engine.config.max_file_bytes)
            written.append(await _write(who, box, path, body))
        return written

    async def _parents(who: str, box: Sandbox, path: str) -> None:
        """Make the directories that will hold ``path``, as envd's writes and moves do."""
        parent = path.rstrip("/").rpartition("/")[0]
        if parent not in ("", "."):
            await files.ask(who, box.id, "mkdir", parent)

    async def _write(
        who: str, box: Sandbox, path: str, body: AsyncIterator[bytes]
    ) -> dict[str, str]:
        # The path asked for is judged before its parents are made: a refusal names it
        # (a '..' in it was refused naming the parent made first, "a/..").
        await _parents(who, box, check_path(path, changes=True))
        # As envd's: through a symlink (to a file inside the sandbox), keeping the mode of
        # a file it replaces (0644 for a new one); still whole or not at all.
        await files.write(who, box.id, path, body, 0o644 | KEEP_MODE)
        entry = (await files.ask(who, box.id, "stat", path)).entry
        assert entry is not None
        return {"name": entry.name, "type": "file", "path": entry.path}

    async def unary(request: Request, call: Call) -> Response:
        """A unary Connect call: JSON in, JSON out, errors as Connect's."""
        try:
            who, box = await _connect_caller(request)
            msg = message(await request.body())
            return JSONResponse(await call(who, box, msg))
        except ConnectError as e:
            return JSONResponse(e.body(), CODE_STATUS[e.code])

    async def _connect_caller(request: Request) -> tuple[str, Sandbox]:
        try:
            return await caller(request)
        except E2BError as e:
            raise ConnectError(_STATUS_CODE.get(e.status, "unknown"), e.message) from None
        except EngineError as e:
            raise process.from_engine(e) from None

    async def stat(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        return {"entry": await _entry(who, box, _path(msg, "path"))}

    async def _entry(who: str, box: Sandbox, path: str) -> dict[str, Any]:
        found = await _ask(who, box, "stat", path)
        assert found.entry is not None
        return entry_info(found.entry)

    async def list_dir(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        """envd's ListDir: no pagination, so a listing past ``MAX_LIST`` entries (or one
        directory past what the agent's link carries in one answer) is refused, naming
        the directory and the limit. Not with resource_exhausted, which E2B's SDK reads
        as "rate limited, try again later": asking again changes nothing."""
        found: list[dict[str, Any]] = []
        top = _path(msg, "path")
        level = [top]
        for _ in range(_depth(msg)):
            below = []
            for directory in level:
                try:
                    listed = await files.ask(who, box.id, "list", directory)
                except EngineError as e:
                    if e.kind == "too_large" and e.field == "path":
                        raise ConnectError("failed_precondition", str(e)) from None
                    raise process.from_engine(e) from None
                for member in listed.entries:
                    found.append(entry_info(member))
                    if member.type == "dir":
                        below.append(member.path)
                    if len(found) > MAX_LIST:
                        too_many = (f"{top}: over {MAX_LIST} entries at this depth; list it "
                                    "with less depth, or a directory below it")  # fmt: skip
                        raise ConnectError("failed_precondition", too_many)
            if not below:
                break  # the tree ends here, whatever depth was asked
            level = below
        return {"entries": found}

    async def make_dir(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        path = _path(msg, "path")
        if not (await _ask(who, box, "mkdir", path)).created:
            raise ConnectError("already_exists", f"{path}: already exists")
        return {"entry": await _entry(who, box, path)}

    async def remove(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        """As envd's (Go's os.RemoveAll): a path that is not there is no error."""
        try:
            await files.ask(who, box.id, "remove", _path(msg, "path"))
        except EngineError as e:
            if not (e.kind == "not_found" and e.field == "path"):  # (not a missing sandbox)
                raise process.from_engine(e) from None
        return {}

    async def move(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        """As envd's: the destination's missing parent directories are made first."""
        source, to = _path(msg, "source"), _path(msg, "destination")
        try:
            check_path(source, changes=True)  # (before the destination's parents are made)
            await _parents(who, box, check_path(to, "to", changes=True))
        except EngineError as e:
            raise process.from_engine(e) from None
        await _ask(who, box, "rename", source, to=to)
        return {"entry": await _entry(who, box, to)}

    async def _ask(who: str, box: Sandbox, op: Any, path: str, **kw: Any) -> Any:
        try:
            return await files.ask(who, box.id, op, path, **kw)
        except EngineError as e:
            raise process.from_engine(e) from None

    filesystem: dict[str, Call] = {
        "Stat": stat, "ListDir": list_dir, "MakeDir": make_dir, "Remove": remove, "Move": move,
    }  # fmt: skip

    @router.post("/filesystem.Filesystem/{method}", include_in_schema=False)
    async def filesystem_call(method: str, request: Request) -> Response:
        call = filesystem.get(method)
        if call is None:
            return _unimplemented(f"filesystem.Filesystem/{method}")
        return await unary(request, call)

    async def send_input(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        process.send_input(process.select(box, msg), msg)
        return {}

    async def close_stdin(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        process.close_stdin(process.select(box, msg))
        return {}

    async def send_signal(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        proc = process.select(box, msg)
        process.send_signal(proc, msg)
        if proc.rec.started is None:  # queued: it never runs (envd's would die at once)
            with contextlib.suppress(EngineError):  # (it ended meanwhile)
                engine.cancel(box.tenant, proc.rec.id)
        return {}

    async def list_processes(who: str, box: Sandbox, msg: dict[str, Any]) -> dict[str, Any]:
        return process.listed(box)

    processes: dict[str, Call] = {
        "SendInput": send_input, "CloseStdin": close_stdin, "SendSignal": send_signal,
        "List": list_processes,
    }  # fmt: skip

    @router.post("/process.Process/{method}", include_in_schema=False)
    async def process_call(method: str, request: Request) -> Response:
        if method in ("Start", "Connect"):
            return await streamed(method, request)
        call = processes.get(method)
        if call is None:
            return _unimplemented(f"process.Process/{method}")
        return await unary(request, call)

    async def streamed(method: str, request: Request) -> Response:
        """A server-streaming call: enveloped events; an error, even before the first
        event, ends the stream (Connect's streams always answer 200)."""
        try:
            _, box = await _connect_caller(request)
            msg = first_message(await request.body())
            keepalive = _keepalive(request.headers.get("keepalive-ping-interval"))
            if method == "Start":
                deadline = timeout_s(request.headers.get("connect-timeout-ms"))
                proc = process.start(engine, box, msg, deadline)
            else:
                proc = process.select(box, msg)
        except (ConnectError, ValueError) as e:
            error = e if isinstance(e, ConnectError) else ConnectError("invalid_argument", str(e))
            return Response(end_of_stream(error), media_type=STREAM_TYPE)
        return StreamingResponse(process.events(proc, keepalive), media_type=STREAM_TYPE)

    return router


def entry_info(e: FileEntry) -> dict[str, Any]:
    """A file entry as envd's ``EntryInfo`` in proto JSON (int64 as a string)."""
    info: dict[str, Any] = {
        "name": e.name, "type": _TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path,
        "size": str(e.size), "mode": e.mode,
        "permissions": stat_bits.filemode(_BITS.get(e.type, 0) | e.mode),
        "owner": str(e.uid), "group": str(e.gid), "modifiedTime": iso(e.mtime),
        "isSymlink": e.type == "symlink",
    }  # fmt: skip
    if e.target is not None:
        info["symlinkTarget"] = e.target
    return info


def _sized(entry: FileEntry) -> dict[str, str]:
    return {"Content-Length": str(entry.size)}


def _path(msg: dict[str, Any], field: str) -> str:
    path = msg.get(field)
    if not isinstance(path, str) or not path or len(path) > MAX_PATH:
        raise ConnectError("invalid_argument", f"{field}: a path is required")
    return path


def _depth(msg: dict[str, Any]) -> int:
    """ListDir's ``depth`` (0 or absent: 1), a uint32 as in envd's proto (up to
    2**32 - 1; a number or, as proto JSON, a decimal string), walked no deeper than
    ``MAX_DEPTH``: no deeper directory has a path of ``MAX_PATH`` characters."""
    return min(uint32(msg, "depth", "depth") or 1, MAX_DEPTH)


def _keepalive(header: str | None) -> float | None:
    """``Keepalive-Ping-Interval`` (seconds): how quiet a stream may be before a
    keepalive event, so that the caller's idle timeout does not end it. A value that is
    no number of seconds is ignored (no keepalive), as it asks nothing of the call."""
    value = (header or "").strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 9:  # (9 digits: 31 years)
        return None
    return max(1, int(value))


def _unimplemented(what: str) -> Response:
    error = ConnectError("unimplemented", f"{what} is not served by ARL-Tangram's E2B endpoint")
    return JSONResponse(error.body(), CODE_STATUS[error.code])


_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}},
                    "required": ["file"],
                }
            },
        },
    }
}
