"""How a streamed exec ends when its scheduler side is gone or stalled, through a real
agent, the real exec server (a host process serving the fast path) or the process
runtime:

- a reader that gives no credit does not hold the kill at the deadline back: the command
  dies and the action ends timed out (it used to wait for credit for ever, the command
  alive and its cores held);
- a keyed interactive command whose link drops mid-input is killed and reported cut off,
  not run to an ``ok`` end on the part of its input that came (its input used to end as
  if the client had ended it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tangram.api.inventory import NodeInventory
from tangram.api.wire import AgentExec, AgentInput, AgentOpen, AgentReply, EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.cgroups import detect
from tangram.node_agent.exec_server import Built

from .host_env import HostServer
from .test_exec_server import alive, serving

GUARD_S = 60.0  # what has not ended by then hangs: a failure, not a wait


def _cgroups_usable() -> bool:
    if os.geteuid() != 0:
        return False
    cg, probe = detect(), f"tangram-probe-{uuid.uuid4().hex[:8]}"
    try:
        cg.create(probe)
        cg.remove(probe)
    except (OSError, RuntimeError):
        return False
    return True


ENVS = [
    "exec-server",
    pytest.param(
        "process",
        marks=pytest.mark.skipif(not _cgroups_usable(), reason="needs root and writable cgroups"),
    ),
]


@asynccontextmanager
async def agent_on(
    kind: str, execd: Built, tmp: Path
) -> AsyncIterator[tuple[NodeAgent, list[int], Path]]:
    """An agent holding trajectory "t" on ``kind``: the agent, the cores an action gets,
    and the directory its commands run in."""
    if kind == "exec-server":
        work = tmp / "work"
        work.mkdir()
        with serving(execd) as (sock, pid):
            inventory = NodeInventory(node_id="n", hostname="n", numa=[[0, 1]], memory_gb=1.0,
                                      cgroup_version=2)  # fmt: skip
            agent = NodeAgent(HostServer(sock, pid, work), inventory, [1], [0], node="n")  # type: ignore[arg-type]
            yield agent, [1], work
        return
    agent = NodeAgent.create(tmp / "agent", runtime="process", idle_cores=1, cores_for_actions=1)
    spec = EnvSpec(name="box", image="unused")
    opened = await agent.handle(AgentOpen(rid=99, trajectory="t", env=spec))
    assert opened.ok, opened.error
    try:
        yield agent, agent.action_cores, Path(agent.runtime.inner.workdir("t"))  # type: ignore[attr-defined]
    finally:
        agent.close("t")
        await agent.shutdown()


def _output(posted: list[str], rid: int) -> str:
    """What the chunk replies of ``rid`` carried."""
    out = b""
    for text in posted:
        msg = json.loads(text)
        if msg.get("rid") == rid and msg.get("data"):
            out += base64.b64decode(msg["data"])
    return out.decode(errors="replace")


async def _until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + GUARD_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ENVS)
def test_a_streamed_exec_whose_reader_gives_no_credit_still_ends_at_its_timeout(
    kind: str, execd: Built, tmp_path: Path
) -> None:
    async def go() -> tuple[AgentReply, int]:
        async with agent_on(kind, execd, tmp_path) as (agent, cores, work):
            posted: list[str] = []  # the scheduler's reader: it takes nothing, credits nothing
            agent.attach(lambda reply: None, posted.append)
            argv = ["sh", "-c", "echo $$ > pid; exec yes"]
            req = AgentExec(rid=1, trajectory="t", argv=argv, cores=cores, stream=True,
                            timeout_s=2.0)  # fmt: skip
            agent.received(req)
            task = asyncio.ensure_future(agent.handle(req))
            done, _ = await asyncio.wait({task}, timeout=GUARD_S)
            if not done:  # (end it for the cleanup: closing the stream frees the kill)
                agent.detach()
                await task
                pytest.fail("the timed-out exec waited for credit instead of ending")
            return task.result(), int((work / "pid").read_text())

    reply, pid = asyncio.run(go())
    assert reply.ok and reply.result is not None, reply.error
    assert reply.result.timed_out and reply.result.exit_code is None
    assert not alive(pid)


@pytest.mark.parametrize("kind", ENVS)
def test_a_keyed_interactive_exec_cut_off_by_its_link_is_killed_and_fails(
    kind: str, execd: Built, tmp_path: Path
) -> None:
    script = 'while read line; do echo "got $line"; done; echo "$$" > ran-to-eof'

    async def go() -> tuple[list[AgentReply], bool]:
        async with agent_on(kind, execd, tmp_path) as (agent, cores, work):
            posted: list[str] = []
            unasked: list[AgentReply] = []
            agent.attach(unasked.append, posted.append)
            req = AgentExec(rid=1, trajectory="t", argv=["sh", "-c", script], cores=cores,
                            key="k1", stream=True, interactive=True)  # fmt: skip
            agent.received(req)
            answer = asyncio.ensure_future(agent.handle(req))
            line = base64.b64encode(b"step_one\n").decode()
            agent.input(AgentInput(target=1, data=line))
            await _until(lambda: "got step_one" in _output(posted, 1), "the first line read")
            # The link drops (link.py's end of a session): detach, then its tasks cancelled.
            agent.detach()
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)
            agent.attach(unasked.append, posted.append)  # the next link
            await _until(lambda: bool(unasked), "the run's unasked reply")
            return unasked, (work / "ran-to-eof").exists()

    unasked, saw_eof = asyncio.run(go())
    (reply,) = unasked
    assert reply.key == "k1" and not reply.ok, reply
    assert "input was cut off" in (reply.error or "")
    assert not saw_eof  # it was killed, never given an end of its input
