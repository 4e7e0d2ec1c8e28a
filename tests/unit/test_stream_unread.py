"""An action stream whose client never reads: the answers of actions it had admitted keep
coming after the stream stops reading, and past ``UNREAD_BYTES`` unsent with nothing sent
for ``STALL_S`` (or past ``UNREAD_LIMIT_BYTES`` at all) the client is taken for gone. The
stream ends (1008) and drops what it held; what the client sent without a key is
cancelled while queued, and a keyed action goes on for its retry. A client that reads,
however slowly, keeps its stream when many answers wait at once."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tangram.api.wire import (
    AgentExec,
    AgentReply,
    AgentRequest,
    EnvSpec,
    ExecOutcome,
    ExecRequest,
)
from tangram.service import stream as stream_module
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine
from tangram.service.live import LiveExec
from tangram.service.records import ActionRecord, TrajectoryRecord
from tangram.service.stream import ActionStream

ANSWER_BYTES = 600_000  # each answer's output; two are over the bound set below


class _DeafClient:
    """A client that sent one frame and reads nothing: every send waits for good."""

    def __init__(self, frame: bytes) -> None:
        self.frames = [frame]
        self.closed: tuple[int, str | None] | None = None
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if self.frames:
            return {"type": "websocket.receive", "bytes": self.frames.pop()}
        await self.gone.wait()
        return {"type": "websocket.disconnect"}

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.Event().wait()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason)
        self.gone.set()


def _outcome(size: int) -> ExecOutcome:
    """A command's result whose output is ``size`` bytes."""
    return ExecOutcome(exit_code=0, stdout="x" * size, stderr="", stdout_truncated=False,
                       stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.01,
                       teardown_s=0.0, path="portable")  # fmt: skip


def _engine() -> Engine:
    from tangram.api.inventory import NodeInventory
    from tangram.api.wire import AgentHello

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    engine = Engine(PoolConfig(envs={"e": env}))
    engine.all_agents_joined()
    inventory = NodeInventory(node_id="n1", hostname="n1", numa=[[0, 1]], memory_gb=8.0,
                              cgroup_version=2)  # fmt: skip
    hello = AgentHello(node="n1", inventory=inventory, runtime="noop", action_cores=[0],
                       idle_cores=[1])  # fmt: skip
    link: Any = SimpleNamespace(hello=hello, node="n1")  # what the engine reads of a link
    asyncio.run(engine.membership.join(link))
    engine.core.open_trajectory("t1", 0.1)
    engine.core.place_trajectory("t1", "n1")
    engine.state.add_trajectory(TrajectoryRecord("t1", "u", "e", "n1", {}, 0.0, env))
    return engine


class _SlowClient:
    """A client that sent one frame and reads steadily, a frame every ``pace_s``."""

    def __init__(self, frame: bytes, pace_s: float) -> None:
        self.frame: bytes | None = frame
        self.pace_s = pace_s
        self.answers: list[dict[str, Any]] = []
        self.closed: tuple[int, str | None] | None = None
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if self.frame is not None:
            frame, self.frame = self.frame, None
            return {"type": "websocket.receive", "bytes": frame}
        await self.gone.wait()
        return {"type": "websocket.disconnect"}

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.sleep(self.pace_s)
        self.answers += [json.loads(line) for line in data.split(b"\n")]

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason)
        self.gone.set()


# Past UNREAD_BYTES: (never) sent for STALL_S, or past UNREAD_LIMIT_BYTES, sent or not.
CUT_OFF = {
    "nothing-sent": {"STALL_S": 0.05, "UNREAD_LIMIT_BYTES": 1 << 30},
    "over-the-limit": {"STALL_S": 3600.0, "UNREAD_LIMIT_BYTES": 1 << 20},
}


@pytest.mark.parametrize("why", list(CUT_OFF))
def test_a_client_that_never_reads_has_its_stream_ended_and_its_unkeyed_work_cancelled(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    monkeypatch.setattr(stream_module, "BACKLOG_BYTES", 1 << 19)
    monkeypatch.setattr(stream_module, "UNREAD_BYTES", 1 << 19)
    for name, value in CUT_OFF[why].items():
        monkeypatch.setattr(stream_module, name, value)
    engine = _engine()
    gate = asyncio.Event()  # holds the keyed command, the last one on the only core

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        assert isinstance(req, AgentExec)
        if req.key is not None:
            await gate.wait()
        out = _outcome(ANSWER_BYTES)
        return AgentReply(rid=req.rid, ok=True, result=out)

    monkeypatch.setattr(engine.state, "ask", ask)
    admitted: list[ActionRecord] = []
    submit = engine.submit_exec

    def kept(tenant: str, tid: str, req: ExecRequest, live: LiveExec | None = None) -> Any:
        admitted.append(submit(tenant, tid, req, live))
        return admitted[-1]

    monkeypatch.setattr(engine, "submit_exec", kept)

    def message(mid: int, key: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"argv": ["true"], "output_cap": 1 << 20}
        if key is not None:
            body["idempotency_key"] = key
        return {"id": mid, "trajectory": "t1", "exec": body}

    # Two answers over the bounds, then one queued without a key, then one keyed.
    sent = [message(1), message(2), message(3, key="k"), message(4)]
    frame = b"\n".join(json.dumps(m).encode() for m in sent)

    async def scenario() -> _DeafClient:
        await engine.start()
        try:
            client = _DeafClient(frame)
            stream = ActionStream(engine, "u", client, refusal=_admitted)
            await asyncio.wait_for(stream.serve(), 30)
            gate.set()  # the keyed command ends: its result is kept for the retry
            await asyncio.wait_for(admitted[2].done, 30)
            return client
        finally:
            await engine.stop(grace_s=0)

    client = asyncio.run(scenario())
    assert client.closed is not None and client.closed[0] == 1008, client.closed
    assert "unread" in (client.closed[1] or "")  # cut off for not reading, not ended
    first, second, keyed, unkeyed = (r.done.result() for r in admitted)
    assert [first.status.value, second.status.value] == ["ok", "ok"]
    assert unkeyed.status.value == "cancelled"  # never run: nobody could collect it
    assert keyed.status.value == "ok" and keyed.stdout == "x" * ANSWER_BYTES


def test_a_client_that_reads_slowly_keeps_its_stream_while_many_answers_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers come faster than it reads, far past UNREAD_BYTES, but a frame leaves well
    within every STALL_S: all of them reach it and its stream goes on."""
    stall_s = 0.5
    monkeypatch.setattr(stream_module, "BACKLOG_BYTES", 1 << 19)
    monkeypatch.setattr(stream_module, "UNREAD_BYTES", 1 << 20)
    monkeypatch.setattr(stream_module, "STALL_S", stall_s)
    engine = _engine()

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        return AgentReply(rid=req.rid, ok=True, result=_outcome(ANSWER_BYTES))

    monkeypatch.setattr(engine.state, "ask", ask)
    count = 24  # read in a few STALL_S: watched while it reads, not only once it has read
    body = {"argv": ["true"], "output_cap": 1 << 20}
    sent = [{"id": mid, "trajectory": "t1", "exec": body} for mid in range(1, count + 1)]
    client = _SlowClient(b"\n".join(json.dumps(m).encode() for m in sent), stall_s / 10)

    async def scenario() -> ActionStream:
        await engine.start()
        try:
            stream = ActionStream(engine, "u", client, refusal=_admitted)
            serving = asyncio.create_task(stream.serve())
            while len(client.answers) < count and not serving.done():
                await asyncio.sleep(0.01)
            client.gone.set()
            await asyncio.wait_for(serving, 30)
            return stream
        finally:
            await engine.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 120))
    assert client.closed is None  # never cut off
    assert sorted(a["id"] for a in client.answers) == list(range(1, count + 1))
    assert all(a["status"] == 200 for a in client.answers)


class _Connection:
    """What the server lends of a client's connection (``TRANSPORT_EXTENSION``): the
    bytes written and not yet taken by the client, which takes ``rate`` bytes a second."""

    def __init__(self, rate: float) -> None:
        self.held, self.rate, self.aborted = 0, rate, False

    def get_write_buffer_size(self) -> int:
        return self.held

    def abort(self) -> None:
        self.aborted = True

    async def drain_forever(self, tick_s: float = 0.01) -> None:
        while True:
            await asyncio.sleep(tick_s)
            self.held = max(0, self.held - int(self.rate * tick_s))


class _PipeClient(_SlowClient):
    """A client behind a connection, as uvicorn sends to it: a frame is written whole at
    once, and the next waits until the connection holds under its high-water mark."""

    HIGH_WATER = 64 << 10

    def __init__(self, frame: bytes, connection: _Connection) -> None:
        super().__init__(frame, 0.0)
        self.connection = connection
        self.scope = {"extensions": {stream_module.TRANSPORT_EXTENSION: connection}}

    async def send_bytes(self, data: bytes) -> None:
        while self.connection.held > self.HIGH_WATER:
            await asyncio.sleep(0.005)
        self.connection.held += len(data) + 10  # (and its frame header)
        self.answers += [json.loads(line) for line in data.split(b"\n")]


@pytest.mark.parametrize("rate", [2e6, 0.0])
def test_a_large_answer_read_slowly_counts_as_reading_and_one_never_read_does_not(
    monkeypatch: pytest.MonkeyPatch, rate: float
) -> None:
    """Each answer takes its client longer than STALL_S to read, so no frame is sent
    within one: it still reads, and keeps its stream. One whose connection takes nothing
    (``rate`` 0) is cut off, the first answer written into its connection or not."""
    stall_s = 0.15
    monkeypatch.setattr(stream_module, "BACKLOG_BYTES", 1 << 19)
    monkeypatch.setattr(stream_module, "UNREAD_BYTES", 1 << 20)
    monkeypatch.setattr(stream_module, "STALL_S", stall_s)
    monkeypatch.setattr(stream_module, "CLOSE_WAIT_S", 0.1)
    engine = _engine()
    answer_bytes = 700_000  # 0.35 s at 2 MB/s: over two STALL_S each

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        return AgentReply(rid=req.rid, ok=True, result=_outcome(answer_bytes))

    monkeypatch.setattr(engine.state, "ask", ask)
    count = 5
    body = {"argv": ["true"], "output_cap": 1 << 20}
    sent = [{"id": mid, "trajectory": "t1", "exec": body} for mid in range(1, count + 1)]
    connection = _Connection(rate)
    client = _PipeClient(b"\n".join(json.dumps(m).encode() for m in sent), connection)

    async def scenario() -> None:
        await engine.start()
        draining = asyncio.create_task(connection.drain_forever())
        try:
            stream = ActionStream(engine, "u", client, refusal=_admitted)
            serving = asyncio.create_task(stream.serve())
            while len(client.answers) < count and client.closed is None:
                await asyncio.sleep(0.01)
            client.gone.set()
            await asyncio.wait_for(serving, 30)
        finally:
            draining.cancel()
            await engine.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 120))
    if rate:
        assert client.closed is None  # never cut off
        assert sorted(a["id"] for a in client.answers) == list(range(1, count + 1))
    else:
        assert client.closed is not None and client.closed[0] == 1008, client.closed
        assert len(client.answers) == 1  # the one its connection took in, and holds


async def _admitted() -> None:
    return None
