"""A session action left unfinished once its request was sent (cancelled during the
interrupt's grace, or while the request was still being written) ends the session: its
process is killed and the next action starts a new one. It used to live on, so the
next action got the previous action's reply (every later reply shifted by one), or
read the rest of a half-sent request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram.node_agent import sessions
from tangram.node_agent.exec_server import Built
from tangram.node_agent.execution import ExecError
from tangram.node_agent.sessions import PythonSession

from .host_env import fast_path, reach
from .service_harness import until
from .test_exec_server import alive, serving

GUARD_S = 60.0  # a scenario that has not ended by then hangs: a failure, not a wait
# Answers nothing, ever: an interrupt does not stop it.
DEAF = """
import time
while True:
    try:
        time.sleep(3600)
    except KeyboardInterrupt:
        pass
"""
# The driver reads no further request (it reads them through sys.stdin.readline).
STOP_READING = """
import sys, time
class Stuck:
    def readline(self):
        time.sleep(3600)
sys.stdin = Stuck()
"""


@pytest.fixture
def server(execd: Built) -> Iterator[tuple[Path, int]]:
    with serving(execd) as found:
        yield found


async def _started(sock: Path, pid: int, cwd: Path) -> tuple[PythonSession, int]:
    """A Python session and its interpreter's pid."""
    s = await PythonSession.start(sock, str(cwd), {}, server_pid=pid)
    reply = await s.run("import os; os.getpid()", timeout_s=None, output_cap=1000)
    return s, int(reply.stdout)


def test_a_session_cancelled_in_its_interrupts_grace_is_killed(
    server: tuple[Path, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sessions, "INTERRUPT_GRACE_S", 3600.0)  # the cancel comes first
    sock, pid = server
    fast, env = fast_path(), reach(sock, pid, tmp_path)
    key = ("t", "python", "main")

    async def go() -> tuple[int, str]:
        s = await fast.session_for(key, env, {})
        reply = await s.run("import os; os.getpid()", timeout_s=None, output_cap=1000)
        interpreter = int(reply.stdout)
        interrupted = asyncio.Event()
        interrupt = s._interrupt

        async def noted() -> None:
            await interrupt()
            interrupted.set()

        monkeypatch.setattr(s, "_interrupt", noted)
        run = asyncio.ensure_future(s.run(DEAF, timeout_s=0.1, output_cap=1000))
        await interrupted.wait()  # past its timeout: in the grace
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        assert not s.alive
        # The next action of the session gets a new one, and its own reply.
        nxt = await fast.session_for(key, env, {})
        said = await nxt.run("print('next')", timeout_s=None, output_cap=1000)
        nxt.chan.close()
        return interpreter, said.stdout

    interpreter, said = asyncio.run(asyncio.wait_for(go(), GUARD_S))
    until(lambda: not alive(interpreter), "the interrupted interpreter is killed")
    assert said == "next\n"


def test_a_session_cancelled_while_its_request_is_sent_is_killed(
    server: tuple[Path, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> tuple[PythonSession, int]:
        s, interpreter = await _started(*server, tmp_path)
        await s.run(STOP_READING, timeout_s=None, output_cap=1000)
        sending = asyncio.Event()
        send = s._send

        async def noted(code: str, cap: int, env: dict[str, str]) -> None:
            sending.set()
            await send(code, cap, env)

        monkeypatch.setattr(s, "_send", noted)
        # Far more than the pipe, the server and the socket hold: its writing must wait.
        run = asyncio.ensure_future(s.run("#" * (64 << 20), timeout_s=None, output_cap=1000))
        await sending.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return s, interpreter

    s, interpreter = asyncio.run(asyncio.wait_for(go(), GUARD_S))
    assert not s.alive  # half a request reached it: never used again
    until(lambda: not alive(interpreter), "the interpreter with half a request is killed")


def test_a_session_killed_again_after_its_channel_closed_is_no_error(
    server: tuple[Path, int], tmp_path: Path
) -> None:
    """A session whose server hung up (bash missing from the image, a failed action) is
    killed on each path that gives it up: the later kills write to a closed transport,
    which raised RuntimeError (not an ExecError), so each such action was answered as an
    agent failure with two tracebacks in the log, a tenant's to repeat at will. On
    uvloop, the loop the scheduler and `tangram up` run on, whose transports raise there."""
    uvloop = pytest.importorskip("uvloop")  # (uvicorn[standard], a dependency)
    sock, pid = server

    async def go() -> None:
        s = await sessions.BashSession.start(sock, str(tmp_path), {}, server_pid=pid)
        await s.kill()  # hangs up: the channel is closed
        await s.kill()
        with pytest.raises(ExecError, match="it has ended"):
            await s.run("true", timeout_s=5, output_cap=100)

    uvloop.run(asyncio.wait_for(go(), GUARD_S))
