"""The scheduler's side of the agent link: requests queued in one loop tick leave in one
frame when the agent reads packed frames, one a frame when it does not; a packed frame of
replies answers each request; a failed send fails what waits instead of hanging it."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import weakref
from collections.abc import Iterator

import pytest

from tangram.api.inventory import NodeInventory
from tangram.api.wire import (
    STREAM_CHUNK,
    STREAM_WINDOW,
    AgentExec,
    AgentFiles,
    AgentHello,
    AgentInput,
    AgentReply,
    FileOp,
    pack,
    parse_agent_request,
    unpack,
)
from tangram.client.outbox import Outbox
from tangram.node_agent.execution import InputCutOffError
from tangram.node_agent.streams import Stream
from tangram.service.agents import AgentGoneError, AgentLink, LinkStream


class Socket:
    """Records what the link sends; ``receive_text`` hands out frames the test queues."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[str] = []
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.fail = fail
        self.closed_with: int | None = None

    async def send_text(self, data: str) -> None:
        if self.fail:
            raise RuntimeError("the connection is closed")
        self.sent.append(data)

    async def receive_text(self) -> str:
        return await self.inbox.get()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed_with = code


def _hello() -> AgentHello:
    inventory = NodeInventory(
        node_id="n1", hostname="n1", numa=[[0, 1]], memory_gb=1.0, cgroup_version=2
    )
    return AgentHello(
        node="n1", inventory=inventory, runtime="noop", action_cores=[0, 1], idle_cores=[]
    )


def _exec() -> AgentExec:
    return AgentExec(trajectory="t", argv=["true"])  # its rid is the link's to give


async def _requests_of_one_tick(packed: bool) -> tuple[list[str], list[AgentReply]]:
    socket = Socket()
    link = AgentLink(_hello(), socket, packed=packed)
    reader = asyncio.create_task(link.receive_forever())
    waiting = [asyncio.create_task(link.request(_exec())) for _ in range(3)]
    while sum(len(unpack(f)) for f in socket.sent) < 3:
        await asyncio.sleep(0)
    frames = list(socket.sent)
    replies = [AgentReply(rid=rid, ok=True).model_dump_json() for rid in (3, 2, 1)]
    (frame,) = pack(replies)  # all three answers in one frame
    await socket.inbox.put(frame)
    answered = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    reader.cancel()
    return frames, answered


def test_requests_of_one_tick_leave_in_one_frame_when_the_agent_reads_packed_frames() -> None:
    frames, answered = asyncio.run(_requests_of_one_tick(packed=True))
    assert len(frames) == 1
    assert [parse_agent_request(m).rid for m in unpack(frames[0])] == [1, 2, 3]
    assert [a.rid for a in answered] == [1, 2, 3]  # each request got its own reply


def test_an_agent_that_does_not_read_packed_frames_gets_one_message_a_frame() -> None:
    frames, answered = asyncio.run(_requests_of_one_tick(packed=False))
    assert [parse_agent_request(f).rid for f in frames] == [1, 2, 3]
    assert [a.rid for a in answered] == [1, 2, 3]


def test_a_send_that_fails_fails_the_waiting_requests_and_closes_the_link() -> None:
    async def go() -> None:
        socket = Socket(fail=True)
        link = AgentLink(_hello(), socket, packed=True)
        with pytest.raises(AgentGoneError):
            await asyncio.wait_for(link.request(_exec()), 5)
        assert link.closed
        await asyncio.sleep(0)
        assert socket.closed_with == 1011  # its reader ends too, and the node is drained
        with pytest.raises(AgentGoneError):  # nothing more is queued on a dead link
            await link.request(_exec())

    asyncio.run(go())


def test_heartbeats_in_a_packed_frame_are_skipped() -> None:
    async def go() -> None:
        socket = Socket()
        link = AgentLink(_hello(), socket, packed=True)
        reader = asyncio.create_task(link.receive_forever())
        waiting = asyncio.create_task(link.request(_exec()))
        await asyncio.sleep(0)
        reply = AgentReply(rid=1, ok=True).model_dump_json()  # the link's first rid
        (frame,) = pack(['{"heartbeat":true}', reply, '{"heartbeat":true}'])
        await socket.inbox.put(frame)
        assert (await asyncio.wait_for(waiting, 5)).rid == 1
        reader.cancel()

    asyncio.run(go())


def test_a_packed_frame_stops_growing_at_its_limit_and_a_big_message_goes_alone() -> None:
    small, big = "x" * 30, "y" * 250
    frames = pack([small, small, small, big, small], limit=100)
    assert [unpack(f) for f in frames] == [[small, small, small], [big], [small]]
    assert all(len(f) <= 100 for f in frames if f != big)
    assert pack([]) == []


def test_bytes_pack_into_bytes_frames_as_text_into_text() -> None:
    assert pack([b'{"id":1}', b'{"id":2}']) == [b'{"id":1}\n{"id":2}']
    assert pack([b"a" * 6, b"b" * 6], limit=10) == [b"a" * 6, b"b" * 6]
    single = b'{"id":3}'
    assert pack([single])[0] is single  # one message: sent as it is, no copy


def test_an_outbox_counts_what_it_has_not_sent_and_says_when_all_is_sent() -> None:
    async def go() -> None:
        release = asyncio.Event()
        sent: list[bytes] = []

        async def send(frame: bytes) -> None:
            await release.wait()  # a peer that does not read yet
            sent.append(frame)

        async def failed(e: Exception) -> None:
            raise AssertionError(e)

        box: Outbox[bytes] = Outbox(send, failed, packed=True)
        box.post(b"a" * 10)
        box.post(b"b" * 5)
        flushed = asyncio.create_task(box.flushed())
        await asyncio.sleep(0.01)
        assert box.backlog == 15 and not flushed.done()
        release.set()
        await asyncio.wait_for(flushed, 5)
        assert box.backlog == 0 and sent == [b"a" * 10 + b"\n" + b"b" * 5]
        box.close()

    asyncio.run(go())


def test_a_closed_outbox_drops_what_it_holds_and_lets_its_owner_go() -> None:
    """A peer that stopped reading: closed, its outbox drops the answers waiting for it
    and those posted later, and its owner (whose callback it holds, as it holds the
    outbox) is freed when dropped, with no collection of cycles (they are rare in the
    scheduler: a dead stream's answers stayed until a full collection)."""

    class Owner:
        def __init__(self) -> None:
            self.box: Outbox[bytes] = Outbox(self.send, self.failed, packed=True)

        async def send(self, frame: bytes) -> None:
            await asyncio.Event().wait()  # never read

        async def failed(self, e: Exception) -> None:
            raise AssertionError(e)

    async def go() -> weakref.ref[Owner]:
        owner = Owner()
        owner.box.post(b"a" * 1000)
        await asyncio.sleep(0.01)  # the writer holds it, sending
        owner.box.post(b"b" * 1000)
        assert owner.box.backlog == 2000
        owner.box.close()
        owner.box.post(b"c" * 1000)  # (an answer that ends after the peer left)
        assert owner.box.backlog == 0
        await asyncio.sleep(0.01)  # the writer's cancel lands
        await asyncio.wait_for(owner.box.flushed(), 5)  # nobody waits for a closed one
        return weakref.ref(owner)

    gc.disable()
    try:
        gone = asyncio.run(go())
        assert gone() is None
    finally:
        gc.enable()


def test_a_reply_field_from_a_newer_agent_is_ignored_not_a_broken_link() -> None:
    newer = '{"rid": 3, "ok": true, "resident": [], "from_a_later_release": {"x": 1}}'
    reply = AgentReply.model_validate_json(newer)
    assert reply.rid == 3 and reply.ok and not hasattr(reply, "from_a_later_release")


def test_trajectory_metadata_talks_to_releases_before_and_after_it() -> None:
    """Releases before ``name`` refuse unknown fields of a trajectory's metadata: it is
    sent only when set (another tenant held the id). A later release's field is ignored."""
    from tangram.api.wire import TrajectoryMeta

    plain = TrajectoryMeta(id="t-1", tenant="alice", env="shell")
    assert "name" not in plain.model_dump_json()
    keyed = TrajectoryMeta(id="t-1.0a1b2c3d", tenant="bob", env="shell", name="t-1")
    assert TrajectoryMeta.model_validate_json(keyed.model_dump_json()) == keyed
    later = '{"id": "t-1", "tenant": "alice", "env": "shell", "from_a_later_release": 1}'
    assert TrajectoryMeta.model_validate_json(later) == plain


def test_an_opens_key_goes_only_to_agents_that_keep_it() -> None:
    """The key of the open that made a trajectory goes into its metadata for agents that
    say they keep it; releases before ``name`` would refuse the open over the field."""
    from tangram.api.wire import EnvSpec, OpenTrajectory, TrajectoryMeta
    from tangram.service.config import EnvConfig
    from tangram.service.records import TrajectoryRecord

    req = OpenTrajectory(env="shell", labels={"a": "1", "b": "2"}, idempotency_key="k1")
    rec = TrajectoryRecord(
        "t-1", "alice", "shell", "n1", {}, 0.0, EnvConfig(spec=EnvSpec(name="shell", image="i"))
    )
    rec.open_key = ("k1", req.digest())
    assert "open_" not in rec.meta().model_dump_json()  # an agent that did not say so
    kept = rec.meta(open_key=True)
    assert (kept.open_key, kept.open_digest) == ("k1", req.digest())
    assert TrajectoryMeta.model_validate_json(kept.model_dump_json()) == kept
    # The digest is the request less its key, whatever the order of its labels.
    same = OpenTrajectory(env="shell", labels={"b": "2", "a": "1"}, idempotency_key="k2")
    assert same.digest() == req.digest()
    assert OpenTrajectory(env="shell", idempotency_key="k1").digest() != req.digest()


def test_a_trajectorys_variables_go_to_its_agent_only_when_it_has_some() -> None:
    """``env_vars`` ride in the metadata its agent keeps (a restarted scheduler reads
    them back from there); none given, the field is left out for earlier releases."""
    from pydantic import ValidationError

    from tangram.api.wire import EnvSpec, OpenTrajectory, TrajectoryMeta
    from tangram.service.config import EnvConfig
    from tangram.service.records import TrajectoryRecord

    rec = TrajectoryRecord(
        "t-1", "alice", "shell", "n1", {}, 0.0, EnvConfig(spec=EnvSpec(name="shell", image="i"))
    )
    assert "env_vars" not in rec.meta().model_dump_json()
    rec.env_vars = {"TOKEN": "s3cret", "EMPTY": ""}
    kept = TrajectoryMeta.model_validate_json(rec.meta().model_dump_json())
    assert kept.env_vars == {"TOKEN": "s3cret", "EMPTY": ""}
    assert "env_vars" not in rec.info().model_dump_json()  # no answer repeats them
    # They are part of what a keyed retry of the open must repeat.
    with_vars = OpenTrajectory(env="shell", env_vars={"A": "1"}, idempotency_key="k")
    assert with_vars.digest() != OpenTrajectory(env="shell", idempotency_key="k").digest()
    with pytest.raises(ValidationError) as bad:
        OpenTrajectory(env="shell", env_vars={"MY-VAR": "x"})
    (error,) = bad.value.errors()  # named by its field, as the 400 names it
    assert error["loc"] == ("env_vars",) and "'MY-VAR' is not a variable name" in error["msg"]
    # Bounded as every hello of its agent carries them, as JSON: 8 KiB, labels alike.
    OpenTrajectory(env="shell", env_vars={"A": "x" * 8184})  # {"A":"x…"}: 8,192 bytes
    with pytest.raises(ValidationError, match=r"8193 bytes as JSON, over the 8192") as big:
        OpenTrajectory(env="shell", env_vars={"A": "x" * 8185})
    assert big.value.errors()[0]["loc"] == ("env_vars",)
    # A control character takes six bytes in the hello: counted so.
    with pytest.raises(ValidationError, match=r"bytes as JSON, over the 8192") as odd:
        OpenTrajectory(env="shell", labels={"a": "\x01" * 1400})
    assert odd.value.errors()[0]["loc"] == ("labels",)


# ---- streamed requests (a file's bytes): credit windows each way ---------------------


def _inputs(socket: Socket) -> list[dict[str, object]]:
    sent = [json.loads(m) for f in socket.sent for m in unpack(f)]
    return [m for m in sent if m.get("op") == "input"]


def _streaming(action: FileOp) -> tuple[Socket, LinkStream, asyncio.Task[None]]:
    """A link reading what the test queues, and one streamed request on it."""
    socket = Socket()
    link = AgentLink(_hello(), socket, packed=True)
    reader = asyncio.create_task(link.receive_forever())
    return socket, link.stream(AgentFiles(trajectory="t", action=action, path="/f")), reader


def _data_inputs(socket: Socket) -> int:
    return len([m for m in _inputs(socket) if m["data"]])


def test_a_streams_input_stops_at_its_window_until_the_agent_gives_credit() -> None:
    async def scenario() -> None:
        socket, stream, reader = _streaming("write")
        chunk = bytes(STREAM_CHUNK)
        sender = asyncio.create_task(stream.send(chunk * (STREAM_WINDOW + 4)))
        for _ in range(50):
            await asyncio.sleep(0)
        assert _data_inputs(socket) == STREAM_WINDOW
        assert not sender.done()
        credit = AgentReply(rid=stream.rid, ok=True, more=True, credit=4)
        socket.inbox.put_nowait(credit.model_dump_json())
        assert await sender is True
        assert _data_inputs(socket) == STREAM_WINDOW + 4
        # The agent refuses: its reply wakes a sender waiting on the window, which stops.
        blocked = asyncio.create_task(stream.send(chunk * (STREAM_WINDOW + 1)))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not blocked.done() and _data_inputs(socket) == STREAM_WINDOW + 4  # waiting
        refusal = AgentReply(rid=stream.rid, ok=False, error="no space", errno=28)
        socket.inbox.put_nowait(refusal.model_dump_json())
        assert await blocked is False
        assert (await stream.reply()).errno == 28
        await stream.close()
        reader.cancel()

    asyncio.run(scenario())


def test_a_streams_chunks_are_acknowledged_as_they_are_taken() -> None:
    async def scenario() -> None:
        socket, stream, reader = _streaming("read")
        for piece in (b"ab", b"cd"):
            data = base64.b64encode(piece).decode()
            chunk = AgentReply(rid=stream.rid, ok=True, more=True, data=data)
            socket.inbox.put_nowait(chunk.model_dump_json())
        socket.inbox.put_nowait(AgentReply(rid=stream.rid, ok=True).model_dump_json())
        got = [piece async for piece in stream.data()]
        assert got == [b"ab", b"cd"]
        for _ in range(10):  # the writer's turn
            await asyncio.sleep(0)
        assert [m["credit"] for m in _inputs(socket)] == [1, 1]
        assert (await stream.reply()).ok
        await stream.close()  # answered: nothing to cancel
        assert not [m for f in socket.sent for m in unpack(f) if '"cancel"' in m]
        reader.cancel()

    asyncio.run(scenario())


def test_a_stream_closed_before_its_reply_cancels_the_request() -> None:
    async def scenario() -> None:
        socket, stream, reader = _streaming("read")
        await stream.close(0.01)  # the HTTP client went away mid-download (no reply comes)
        await stream.close()  # as a caller's cleanup does after a cancel: nothing more
        await asyncio.sleep(0)
        sent = [parse_agent_request(m) for f in socket.sent for m in unpack(f)]
        cancels = [m for m in sent if getattr(m, "target", None) == stream.rid and m.op == "cancel"]
        assert len(cancels) == 1  # a second cancel would cut short the agent's kill
        reader.cancel()

    asyncio.run(scenario())


def test_the_agents_side_sends_within_its_window_and_takes_input_in_order() -> None:
    async def scenario() -> None:
        sent: list[str] = []
        stream = Stream(7, sent.append)
        posted = _Replies(sent)
        sender = asyncio.create_task(stream.send(1, bytes(STREAM_CHUNK * (STREAM_WINDOW + 2))))
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(posted) == STREAM_WINDOW and not sender.done()
        stream.take(AgentInput(target=7, credit=2))
        await sender
        assert len(posted) == STREAM_WINDOW + 2
        for piece in (b"one", b"two"):
            stream.take(AgentInput(target=7, data=base64.b64encode(piece).decode()))
        stream.take(AgentInput(target=7, eof=True))
        sent.clear()
        assert [piece async for piece in stream.received()] == [b"one", b"two"]
        assert [p.credit for p in posted] == [1, 1]  # each chunk taken is acknowledged

    asyncio.run(scenario())


class _Replies:
    """The messages a stream posted, read back as replies."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    def __len__(self) -> int:
        return len(self.sent)

    def __iter__(self) -> Iterator[AgentReply]:
        return (AgentReply.model_validate_json(m) for m in self.sent)


def test_a_closed_stream_drops_what_waits_for_the_window() -> None:
    """A cancelled command's output must not wait for credit that will never come: the
    collection would never end, and the kill never reach it."""

    async def scenario() -> None:
        sent: list[str] = []
        stream = Stream(7, sent.append)
        sender = asyncio.create_task(stream.send(1, bytes(STREAM_CHUNK * (STREAM_WINDOW + 3))))
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(sent) == STREAM_WINDOW and not sender.done()
        stream.close()
        await sender
        assert len(sent) == STREAM_WINDOW  # nothing more went out
        # Input not ended by its requester is cut off, never taken as its end.
        with pytest.raises(InputCutOffError):
            [piece async for piece in stream.received()]
        ended = Stream(8, sent.append)
        ended.take(AgentInput(target=8, eof=True))
        ended.close()
        assert [piece async for piece in ended.received()] == []  # ended before the close

    asyncio.run(scenario())


def test_an_exec_reply_with_a_signal_parses_at_a_scheduler_of_the_release_before() -> None:
    """Agents (a DaemonSet) are often upgraded first. A scheduler of the release before
    refuses an unknown field inside ExecOutcome (every exec reply would break its link),
    so the signal travels in AgentReply, whose unknown fields it ignores."""
    from tangram.node_agent.agent import outcome
    from tangram.node_agent.execution import ExecResult, Output

    before = {"exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
              "timed_out", "setup_s", "exec_s", "teardown_s", "path", "fallback"}  # fmt: skip
    killed = ExecResult.of(-9, Output(b"", False, b"", False), False, [0], (0.0, 0.0, 0.1, 0.1))
    assert (killed.exit_code, killed.signal) == (137, 9)
    reply = AgentReply(rid=1, ok=True, result=outcome(killed), signal=killed.signal)
    sent = json.loads(reply.model_dump_json())
    assert set(sent["result"]) <= before and sent["signal"] == 9


def test_an_agent_refused_at_once_backs_off_and_one_that_served_reconnects_at_once() -> None:
    """A scheduler that closes the link as it is made (it refuses the node) is knocked on
    ever more slowly, up to the cap; a link that served a while is made again at once."""
    from tangram.api.wire import AGENT_BACKOFF_MAX_S
    from tangram.node_agent.link import STABLE_S, next_wait

    backoff, waits = 0.1, []
    for _ in range(8):
        wait, backoff = next_wait(backoff, 0.01)  # closed as it was made
        waits.append(wait)
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, AGENT_BACKOFF_MAX_S, AGENT_BACKOFF_MAX_S]
    assert next_wait(backoff, STABLE_S) == (0.1, 0.2)
    assert next_wait(0.4, None) == (0.4, 0.8)  # no connection at all
