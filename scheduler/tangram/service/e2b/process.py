"""envd's Process service over the scheduler: ``Start`` submits a streamed exec action
(scheduled as any other: its cores are held only while it runs), whose output goes out as
envd's events; ``SendInput``, ``CloseStdin`` and ``SendSignal`` reach it through its live
side, queued in order if it has not started yet.

A pid here is the sandbox's own number for the command, not a process id inside it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from tangram.api.field_errors import described
from tangram.api.wire import ActionResult, ActionStatus, ExecRequest, env_problem
from tangram.service.e2b.connect import KIND_CODE, ConnectError, end_of_stream, envelope, uint32
from tangram.service.e2b.sandboxes import Proc, Sandbox
from tangram.service.engine import Engine
from tangram.service.files import NoSpaceError
from tangram.service.live import LiveExec
from tangram.service.records import EngineError

# envd's signals, by name or (proto JSON allows both) by number.
SIGNALS: dict[object, int] = {"SIGNAL_SIGTERM": signal.SIGTERM, "SIGNAL_SIGKILL": signal.SIGKILL,
                              15: signal.SIGTERM, 9: signal.SIGKILL}  # fmt: skip
# What Go (envd's ProcessState) calls a signal a command died of.
# How Go's syscall.Signal names a signal (its ProcessState's "signal: ..."); one it has no
# name for is "signal N".
_GO_NAMES: dict[int, str] = {
    signal.SIGHUP: "hangup", signal.SIGINT: "interrupt", signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction", signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted", signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception", signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1", signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2", signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock", signal.SIGTERM: "terminated",
}  # fmt: skip
# A command asked to run in another directory: the exec runs in the environment's
# workdir, so a shell moves first ($0 is the directory, "$@" the command). A directory it
# cannot enter is said as the field, not in the shell's words ("sub: 1: cd: can't cd to
# sub", $0 taken for the script's name), and the command does not run.
_CD = (
    'cd -- "$0" 2>/dev/null || { if [ ! -e "$0" ]; then why="No such file or directory"; '
    'elif [ ! -d "$0" ]; then why="Not a directory"; else why="Permission denied"; fi; '
    'printf "cwd: %s: %s\\n" "$0" "$why" >&2; exit 1; }; exec "$@"'
)


def start(engine: Engine, box: Sandbox, msg: dict[str, Any], timeout_s: float | None) -> Proc:
    """Submit the command of a ``StartRequest``."""
    config = msg.get("process")
    if not isinstance(config, dict) or not isinstance(config.get("cmd"), str):
        raise ConnectError("invalid_argument", "process.cmd: a command is required")
    args, envs, cwd = config.get("args") or [], config.get("envs") or {}, config.get("cwd")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args: a list of strings is required")
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise ConnectError("invalid_argument", "process.envs: a map of strings is required")
    if (problem := env_problem(envs)) is not None:
        raise ConnectError("invalid_argument", f"process.envs: {problem}")
    _given(config, "cwd", str, "process.cwd: a string")
    _given(msg, "tag", str, "tag: a string")
    _given(msg, "pty", dict, 'pty: an object ({"size": ...})')
    _given(msg, "stdin", bool, "stdin: true or false")
    argv = [config["cmd"], *args]
    if cwd:
        argv = ["/bin/sh", "-c", _CD, cwd, *argv]
    pty = msg.get("pty") is not None
    stdin = bool(msg.get("stdin")) or pty  # a terminal takes what is typed
    try:
        # The caller's deadline (envd's Connect-Timeout-Ms) bounds the wait in the queue
        # too: one not started by then never runs (the SDK has raised its timeout).
        req = ExecRequest(argv=argv, env=envs, timeout_s=timeout_s,
                          queue_timeout_s=timeout_s, pty=pty, output_cap=0)  # fmt: skip
    except ValidationError as e:
        raise ConnectError("invalid_argument", described(e, "process")) from None
    proc = Proc(box.new_pid(), msg.get("tag"), {**config, "args": args, "envs": envs}, stdin, pty)
    proc.live = LiveExec(proc.output, interactive=stdin, room=proc.room)
    try:
        proc.rec = engine.submit_exec(box.tenant, box.id, req, proc.live)
    except EngineError as e:
        raise from_engine(e) from None
    box.procs[proc.pid] = proc
    proc.rec.done.add_done_callback(lambda _: box.procs.pop(proc.pid, None))
    return proc


async def events(proc: Proc, keepalive_s: float | None) -> AsyncIterator[bytes]:
    """The command's events as a server stream: its start, its output as it comes, a
    keepalive when it is quiet for ``keepalive_s``, its end."""
    queue = proc.attach()
    done: asyncio.Future[ActionResult] = asyncio.ensure_future(asyncio.shield(proc.rec.done))
    get: asyncio.Future[Any] | None = None
    try:
        yield envelope({"event": {"start": {"pid": proc.pid}}})
        while True:
            get = asyncio.ensure_future(queue.get())
            ready, _ = await asyncio.wait({get, done}, timeout=keepalive_s,
                                          return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if get in ready:
                yield _data(*get.result())
                proc.taken()
                continue
            get.cancel()
            if done in ready:
                while not queue.empty():  # what came before it ended
                    yield _data(*queue.get_nowait())
                yield envelope({"event": {"end": _end(done.result(), proc.signalled)}})
                yield end_of_stream()
                return
            yield envelope({"event": {"keepalive": {}}})
    finally:
        if get is not None:
            get.cancel()  # a reader that went mid-wait leaves no task waiting on its queue
        done.cancel()
        proc.detach(queue)  # a reader that went leaves the command running, as envd does


def select(box: Sandbox, msg: dict[str, Any]) -> Proc:
    """The command a ``ProcessSelector`` names, by pid or by tag."""
    selector = msg.get("process") or {}
    if not isinstance(selector, dict):
        raise ConnectError("invalid_argument", "process: a selector (pid or tag) is required")
    pid = uint32(selector, "pid", "process.pid")  # (a number or, as proto JSON, "123")
    tag = _given(selector, "tag", str, "process.tag: a string")
    for proc in box.procs.values():
        if (pid is not None and proc.pid == pid) or (tag is not None and proc.tag == tag):
            return proc
    raise ConnectError("not_found", f"process {pid if pid is not None else tag!r} not found")


def _given(msg: dict[str, Any], field: str, kind: type, what: str) -> Any:
    """``msg[field]`` when absent (None) or of the JSON type ``kind``, as envd's proto
    JSON takes it; any other type is refused naming the field, never converted (a
    ``"stdin": "no"`` was an open stdin, ``"pty": false`` a terminal). Integers are
    ``connect.uint32``'s: proto JSON takes them as numbers or decimal strings."""
    value = msg.get(field)
    if value is not None and (
        not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
    ):
        raise ConnectError("invalid_argument", f"{what} is required, not {json.dumps(value)}")
    return value


def send_input(proc: Proc, msg: dict[str, Any]) -> None:
    given = msg.get("input") or {}
    if not isinstance(given, dict):
        raise ConnectError("invalid_argument", "input: an object with stdin or pty")
    data = given.get("stdin") or given.get("pty") or ""  # (a oneof: one of them at most)
    if not proc.stdin:
        raise ConnectError(
            "failed_precondition", f"process {proc.pid} was started without stdin (stdin=True)"
        )
    try:
        proc.live.write(base64.b64decode(data, validate=True))
    except (ValueError, TypeError):
        raise ConnectError("invalid_argument", "input: not base64") from None
    except EngineError as e:
        raise from_engine(e) from None


def close_stdin(proc: Proc) -> None:
    if proc.stdin:
        proc.live.close_stdin()


def send_signal(proc: Proc, msg: dict[str, Any]) -> None:
    named = msg.get("signal")
    number = SIGNALS.get(named) if isinstance(named, str | int) else None
    if number is None:
        raise ConnectError("invalid_argument", f"signal: {msg.get('signal')!r} is not one of "
                           "SIGNAL_SIGTERM, SIGNAL_SIGKILL")  # fmt: skip
    proc.signalled = number
    proc.live.signal(number)


def listed(box: Sandbox) -> dict[str, Any]:
    return {
        "processes": [
            {"config": p.config, "pid": p.pid, **({"tag": p.tag} if p.tag else {})}
            for p in box.procs.values()
        ]
    }


def from_engine(e: EngineError) -> ConnectError:
    if isinstance(e, NoSpaceError):
        # Not resource_exhausted, which E2B's SDK reads as rate limiting ("try again
        # later"): nothing changes until space is freed. (SandboxException in the SDK.)
        return ConnectError("failed_precondition", str(e))
    return ConnectError(KIND_CODE.get(e.kind, "internal"), str(e))


def _data(kind: str, text: str) -> bytes:
    return envelope({"event": {"data": {kind: base64.b64encode(text.encode()).decode()}}})


def _end(result: ActionResult, signalled: int | None = None) -> dict[str, Any]:
    """envd's end event for the action's result, as Go's ProcessState says it: an exit's
    code and status, and for a non-zero one the same as ``error``; a death by a signal
    exit code -1, not exited, "signal: killed".

    The result names the signal that killed the command. An agent from before it was
    named gives only 128 + the signal, as shells do, which an exit with that code is too:
    then it is read as the death only for the signal this endpoint sent the command
    (SendSignal, ``signalled``).
    """
    end: dict[str, Any] = {}
    code = result.exit_code
    killed = result.signal
    if killed is None and code is not None and signalled is not None and code == 128 + signalled:
        killed = signalled
    if killed is None and signalled is not None and result.status is ActionStatus.CANCELLED:
        killed = signalled  # signalled while queued: it never ran (``envd.send_signal``)
    if killed is not None:
        status = f"signal: {_GO_NAMES.get(killed, f'signal {killed}')}"
        end.update(exitCode=-1, exited=False, status=status, error=status)
    elif code is not None:
        end.update(exitCode=code, exited=True, status=f"exit status {code}")
        if code != 0:
            end["error"] = end["status"]  # (Go's exec.ExitError says the same)
    else:
        end.update(exitCode=-1, exited=False, status=str(result.status))
        end["error"] = f"the command ended {result.status}"
    if result.error is not None:
        end["error"] = result.error.message
    return end
