"""The agent link over a real WebSocket to the real scheduler service: a current agent
takes the packing subprotocol and the execs of one scheduling round reach it in one frame;
an agent of an earlier release, which offers no subprotocol, still gets and sends one
message a frame, so a rolling upgrade of the DaemonSet keeps working."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import websockets

from tangram.api.wire import (
    AGENT_LEAVING,
    AgentHello,
    AgentReply,
    AgentRequest,
    EnvSpec,
    parse_agent_request,
    unpack,
)
from tangram.client import ActionStatus, Client
from tangram.node_agent import link
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.execution import ExecResult
from tangram.node_agent.inventory import read_inventory
from tangram.node_agent.key_journal import KeyJournal
from tangram.node_agent.noop_runtime import NoopRuntime
from tangram.service.agents import AgentLink
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import KeptRecords, service, until

pytestmark = [pytest.mark.xdist_group("service")]
CONFIG = PoolConfig(envs={"noop": EnvConfig(spec=EnvSpec(name="noop", image="none"))})
N = 6  # execs in one batch: one round places them all


class Frames:
    """Wraps the scheduler's socket to the agent: what each frame it sent held."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.frames: list[list[str]] = []

    async def send_text(self, data: str) -> None:
        self.frames.append(unpack(data))
        await self.socket.send_text(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def _batch_of_execs(client: Client) -> list[str]:
    ids = [client.open("noop").id for _ in range(N)]
    results = client.batch([{"trajectory": t, "exec": {"argv": ["true"]}} for t in ids])
    assert [r.status for r in results] == [ActionStatus.OK] * N
    return ids


def _tokens(tmp: Path) -> tuple[TokenStore, str]:
    """A token file in ``tmp``, and its agents' token."""
    tokens = TokenStore.create(tmp / "tokens")
    agent_token = tokens.token_for(AGENT_TENANT)
    assert agent_token is not None
    return tokens, agent_token


def test_a_current_agent_gets_the_execs_of_one_round_in_one_frame(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=N)
    with service(CONFIG, agent, tmp_path) as (running, token), Client(running.url, token) as c:
        link = running.engine.hub.links[agent.node]
        assert link.packed  # the real agent offered the subprotocol and the scheduler took it
        frames = Frames(link.socket)
        link.socket = frames
        _batch_of_execs(c)
        ops = [[parse_agent_request(m).op for m in f] for f in frames.frames]
        assert [f for f in ops if "exec" in f] == [["exec"] * N]


async def _old_agent(agent: NodeAgent, url: str, token: str, stop: threading.Event) -> None:
    """An agent link as releases before the subprotocol spoke it: no subprotocol offered,
    each request read as exactly one message, each reply sent in its own frame."""
    async with websockets.connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None
    ) as ws:
        assert ws.subprotocol is None  # the scheduler did not impose one
        await ws.send(agent.hello().model_dump_json())

        async def answer(text: str) -> None:
            reply = await agent.handle(parse_agent_request(text))
            await ws.send(reply.model_dump_json())

        tasks = set()
        while not stop.is_set():
            try:
                text = await asyncio.wait_for(ws.recv(), 0.2)
            except TimeoutError:
                await ws.send('{"heartbeat":true}')
                continue
            assert isinstance(text, str) and "\n" not in text  # one message a frame
            task = asyncio.create_task(answer(text))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def test_an_agent_of_an_earlier_release_gets_one_message_a_frame(tmp_path: Path) -> None:
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=N)
    agent_token = tokens.token_for(AGENT_TENANT)
    assert agent_token is not None
    stop, failure = threading.Event(), []

    with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
        url = running.url.replace("http://", "ws://") + "/v1/agents"

        def old() -> None:
            try:
                asyncio.run(_old_agent(agent, url, agent_token, stop))
            except BaseException as e:  # surfaced below
                failure.append(e)

        thread = threading.Thread(target=old, daemon=True)
        thread.start()
        until(lambda: agent.node in running.engine.hub.links or bool(failure), "no agent")
        assert not running.engine.hub.links[agent.node].packed
        with Client(running.url, token) as c:
            ids = _batch_of_execs(c)
            for t in ids:
                c.close(t)
        stop.set()
        thread.join(10)
    assert not failure, failure


async def _black_hole_after(
    cut: asyncio.Event, up_port: int, ends: list[asyncio.StreamWriter]
) -> asyncio.Server:
    """A TCP proxy to ``up_port`` whose first connection goes silent once ``cut`` is
    set: nothing more passes either way, and nothing closes (a host that died, a
    partition). Later connections pass. ``ends``: every socket it holds."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        silenced = not ends
        ur, uw = await asyncio.open_connection("127.0.0.1", up_port)
        ends.extend((cw, uw))

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                if silenced and cut.is_set():
                    await asyncio.Event().wait()  # swallowed; the connection stays open
                w.write(data)
                await w.drain()

        await asyncio.gather(pump(cr, uw), pump(ur, cw), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_an_agent_reconnects_to_a_scheduler_gone_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeats go only to the scheduler: the agent learns that the scheduler is
    there from the answers to its pings, and reconnects when they stop coming."""
    monkeypatch.setattr(link, "PING_INTERVAL_S", 0.05)
    monkeypatch.setattr(link, "PING_TIMEOUT_S", 0.5)
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)

    async def scenario() -> None:
        hellos: asyncio.Queue[AgentHello] = asyncio.Queue()

        async def scheduler(ws: Any) -> None:
            await hellos.put(AgentHello.model_validate_json(await ws.recv()))
            async for _ in ws:  # heartbeats
                pass

        cut, ends = asyncio.Event(), list[asyncio.StreamWriter]()
        async with websockets.serve(scheduler, "127.0.0.1", 0) as upstream:
            up_port = upstream.sockets[0].getsockname()[1]
            proxy = await _black_hole_after(cut, up_port, ends)
            port = proxy.sockets[0].getsockname()[1]
            stop = asyncio.Event()
            url = f"ws://127.0.0.1:{port}/v1/agents"
            serving = asyncio.create_task(link.serve(agent, url, "token", stop))
            try:
                assert (await asyncio.wait_for(hellos.get(), 30)).node == agent.node
                cut.set()
                assert (await asyncio.wait_for(hellos.get(), 30)).node == agent.node
            finally:
                stop.set()
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)
                proxy.close()
                for end in ends:  # the server's close would wait on the swallowed one
                    end.transport.abort()

    asyncio.run(scenario())


def test_the_scheduler_answers_the_agents_pings(tmp_path: Path) -> None:
    """The agent's liveness check of the scheduler is a WebSocket ping: the scheduler's
    server answers it at the protocol level (as any release's, whatever uvicorn's
    WebSocket implementation)."""
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)
    agent_token = tokens.token_for(AGENT_TENANT)
    assert agent_token is not None

    async def ping(url: str) -> float:
        async with websockets.connect(
            url, additional_headers={"Authorization": f"Bearer {agent_token}"}
        ) as ws:
            await ws.send(agent.hello().model_dump_json())
            return await asyncio.wait_for(await ws.ping(), 30)

    with service(CONFIG, None, tmp_path, tokens=tokens) as (running, _):
        url = running.url.replace("http://", "ws://") + "/v1/agents"
        asyncio.run(ping(url))  # the pong came back (its wait is bounded: 30 s)


def test_a_second_agent_of_the_pool_for_a_node_is_refused_and_the_first_keeps_it(
    tmp_path: Path,
) -> None:
    """A pool's CPU and GPU agents on one node say hello under the same node name: the
    second was taken as the first's reconnect, and the two took each other's place. It is
    refused (1008), saying why, on the pool's status; the first serves on."""
    tokens = TokenStore.create(tmp_path / "tokens")
    agent_token = tokens.token_for(AGENT_TENANT)
    first = NodeAgent.create(tmp_path / "cpu", runtime="noop", cores_for_actions=1, node="n1")
    second = NodeAgent.create(tmp_path / "gpu", runtime="noop", cores_for_actions=1, node="n1")
    assert first.agent_id and second.agent_id and first.agent_id != second.agent_id

    async def knock(url: str) -> websockets.frames.Close | None:
        async with websockets.connect(
            url, additional_headers={"Authorization": f"Bearer {agent_token}"}
        ) as ws:
            await ws.send(second.hello().model_dump_json())
            with pytest.raises(websockets.ConnectionClosed) as ended:
                await asyncio.wait_for(ws.recv(), 30)
            return ended.value.rcvd

    with (
        service(CONFIG, first, tmp_path, tokens=tokens) as (running, token),
        Client(running.url, token) as client,
    ):
        url = running.url.replace("http://", "ws://") + "/v1/agents"
        until(lambda: "n1" in running.engine.hub.links, "the first agent joined")
        link_before = running.engine.hub.links["n1"]
        closed = asyncio.run(knock(url))
        assert closed is not None and closed.code == 1008
        assert "another agent of this pool" in closed.reason
        assert running.engine.hub.links["n1"] is link_before  # the first one kept its place
        (problem,) = running.engine.figures().problems
        assert (problem.reason, problem.subject) == ("DuplicateAgent", "node n1")
        assert f"agent {second.agent_id} refused, agent {first.agent_id}" in problem.message
        t = client.open("noop")  # and it serves
        assert client.exec(t.id, ["true"]).status is ActionStatus.OK


class _Refusals(logging.Handler):
    """The agent's "refused" lines: the first one stops its link (``stop``)."""

    def __init__(self, stop: asyncio.Event) -> None:
        super().__init__(logging.ERROR)
        self.stop = stop
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("the scheduler refused this agent"):
            self.lines.append(record.getMessage())
            self.stop.set()


@pytest.mark.parametrize(
    ("how", "status", "said", "meaning"),
    [
        ("unknown token", 401, "a valid bearer token is required", "wrong token"),
        ("client token", 403, "the token of local is not a node agent's", "wrong role"),
        ("wrong path", 404, "no WebSocket endpoint at /wrong/path", "wrong path"),
    ],
)
def test_a_refused_agent_is_told_why_and_both_sides_log_it(
    tmp_path: Path, how: str, status: int, said: str, meaning: str
) -> None:
    """A refused agent got a bare 403 (a close before the accept), logged only "HTTP 403;
    retrying in 5.0s" for ever, and the scheduler logged nothing. The refusal carries its
    status and error body, the agent says what it was told and that its configuration is
    wrong and knocks again after REFUSED_BACKOFF_S, and the scheduler logs it (not the
    token)."""
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)
    agent_token = tokens.token_for(AGENT_TENANT)
    assert agent_token is not None
    token = {"unknown token": "wrongtoken1234567890abc", "client token": tokens.token_for("local")}
    sent = token.get(how, agent_token)
    assert sent is not None
    kept = KeptRecords()
    logging.getLogger("tangram.service").addHandler(kept)

    async def knock(url: str) -> tuple[list[str], websockets.InvalidStatus]:
        stop = asyncio.Event()
        refusals = _Refusals(stop)
        logging.getLogger("tangram.agent").addHandler(refusals)
        try:
            await asyncio.wait_for(link.serve(agent, url, sent, stop), 60)
        finally:
            logging.getLogger("tangram.agent").removeHandler(refusals)
        with pytest.raises(websockets.InvalidStatus) as raw:
            await websockets.connect(url, additional_headers={"Authorization": f"Bearer {sent}"})
        return refusals.lines, raw.value

    try:
        with service(CONFIG, None, tmp_path, tokens=tokens) as (running, _):
            path = "/wrong/path" if how == "wrong path" else "/v1/agents"
            lines, raw = asyncio.run(knock(running.url.replace("http://", "ws://") + path))
    finally:
        logging.getLogger("tangram.service").removeHandler(kept)
    (line,) = lines
    assert f"HTTP {status}: {said}" in line and f"a configuration error: {meaning}" in line
    assert line.endswith(f"retrying in {link.REFUSED_BACKOFF_S:.0f}s")
    assert raw.response.status_code == status
    assert said in json.loads(raw.response.body or b"")["error"]["message"]
    logged = [r.getMessage() for r in kept.records]
    assert any(f"({status})" in m and said in m for m in logged), logged
    assert not any(sent in m for m in logged)  # the token is never logged


class _Connects(logging.Handler):
    """The agent's "connected to" lines, at any level: the ``last``-th stops its link."""

    def __init__(self, stop: asyncio.Event, last: int) -> None:
        super().__init__(logging.DEBUG)
        self.stop, self.last = stop, last
        self.levels: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("connected to "):
            self.levels.append(record.levelno)
            if len(self.levels) == self.last:
                self.stop.set()


def test_a_node_refused_after_its_hello_logs_its_connects_as_its_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler that takes the hello and closes the link (a node it refuses then, a
    scheduler crash-looping): the agent logged "connected ... again" at info every cycle,
    though its failures warn only the first few times (then one a minute, made never
    here). A connect is at info when it is the first or ends a failure that warned."""
    monkeypatch.setattr(link, "next_wait", lambda backoff, lasted: (0.0, 0.0))  # no waits
    monkeypatch.setattr(link.Outage, "LOUD_EVERY_S", math.inf)
    caplog.set_level(logging.DEBUG, logger="tangram.agent.link")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)

    async def refuse(ws: Any) -> None:
        await ws.recv()  # the hello
        await ws.close(1008, "this node is refused")

    async def scenario() -> list[int]:
        stop = asyncio.Event()
        connects = _Connects(stop, last=10)
        logging.getLogger("tangram.agent.link").addHandler(connects)
        try:
            async with websockets.serve(refuse, "127.0.0.1", 0) as scheduler:
                port = scheduler.sockets[0].getsockname()[1]
                url = f"ws://127.0.0.1:{port}/v1/agents"
                await asyncio.wait_for(link.serve(agent, url, "token", stop), 60)
        finally:
            logging.getLogger("tangram.agent.link").removeHandler(connects)
        return connects.levels

    levels = asyncio.run(scenario())
    loud = link.Outage.LOUD_FIRST
    assert levels == [logging.INFO] * (1 + loud) + [logging.DEBUG] * (9 - loud), levels
    warned = [r for r in caplog.records if r.getMessage().startswith("scheduler link to ")]
    assert [r.levelno for r in warned[: loud + 1]] == [logging.WARNING] * loud + [logging.DEBUG]


class _Holding(NoopRuntime):
    """Commands named ``hold`` run until the test releases them (or they are killed);
    any other exits 0 at once."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = threading.Event()  # a hold runs
        self.release = threading.Event()

    async def exec(
        self, trajectory: str, argv: Sequence[str], cores: Sequence[int], **options: Any
    ) -> ExecResult:
        if argv[0] == "hold":
            self.holding.set()
            while not self.release.is_set():  # (the test's thread sets it)
                await asyncio.sleep(0.01)
        return await super().exec(trajectory, argv, cores, **options)


def _agent(runtime: _Holding, journal: Path) -> NodeAgent:
    """An agent of node n1 on ``runtime`` keeping its keys in ``journal``: a second one
    on the same two stands in for the next agent of a DaemonSet roll (the environments
    and the state directory outlive the pod)."""
    agent = NodeAgent(runtime, read_inventory(), [0, 1], [2], node="n1", agent_id="a1")
    agent.use_journal(KeyJournal(journal))
    return agent


class _Served:
    """``link.run`` (with ``grace_s``: the stop of ``tangram agent``) or ``link.serve`` on
    a loop of its own thread, until ``stop``."""

    def __init__(self, agent: NodeAgent, url: str, token: str, grace_s: float | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        serving = (
            link.run(agent, url, token, self.stop, grace_s=grace_s)
            if grace_s is not None
            else link.serve(agent, url, token, self.stop)
        )
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(serving,), daemon=True
        )
        self.thread.start()

    def end(self) -> None:
        """Set ``stop`` and wait (a minute at most) for the agent's stop to end."""
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)
        assert not self.thread.is_alive()
        self.loop.close()


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``work`` run on a thread of its own: the thread, and where its answer lands."""
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(work()), daemon=True)
    thread.start()
    return thread, answers


def _not_taken(agent: NodeAgent) -> threading.Event:
    """Set once ``agent`` answers a request not taken (it came after the stop began)."""
    seen, handle = threading.Event(), agent.handle

    async def noting(req: AgentRequest) -> AgentReply:
        reply = await handle(req)
        if reply.not_taken:
            seen.set()
        return reply

    agent.handle = noting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("grace_s", [600.0, 0.0])
def test_an_agent_stopped_on_purpose_leaves_as_a_stop_not_a_loss(
    tmp_path: Path, grace_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM (a DaemonSet pod deleted) ended the agent at once, and the scheduler logged
    its node as lost (WARNING). A first stop on purpose then refused new work (clients
    spun on the leaving node for its grace) and answered what it killed at the grace's
    end exec_failed, not retryable, which the scheduler kept for its key. Now what runs
    may finish within the grace (its client gets the result); what still runs at its end
    is killed unanswered and ends outcome_unknown (not retryable: it ran in part), as
    does its key's retry, as docs/operator.md says of an agent roll; a request sent
    during the grace (it was
    sent to the agent, which left it unanswered) waits in the scheduler, never sent to
    the leaving agent, and ends node_lost as the link closes; and the scheduler logs
    "stopped" at INFO."""
    tokens, agent_token = _tokens(tmp_path)
    runtime = _Holding()
    agent = _agent(runtime, tmp_path / "keys.journal")
    not_taken = _not_taken(agent)
    caplog.set_level(logging.INFO, logger="tangram.service")
    try:
        with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
            url = running.url.replace("http://", "ws://") + "/v1/agents"
            first = _Served(agent, url, agent_token, grace_s)
            until(lambda: "n1" in running.engine.hub.links, "the agent joined")
            with Client(running.url, token) as client:
                t = client.open("noop")
                held, results = _in_thread(
                    lambda: client.exec(t.id, ["hold"], idempotency_key="k1")
                )
                until(runtime.holding.is_set, "the command runs")
                first.loop.call_soon_threadsafe(first.stop.set)
                if grace_s:
                    until(lambda: running.engine.hub.links["n1"].leaving, "told it leaves")
                    late, lates = _in_thread(lambda: client.exec(t.id, ["true"]))
                    until(lambda: bool(running.engine.core.stranded), "the late one queued")
                    assert late.is_alive()  # not refused: it waits for its node
                    runtime.release.set()
                    late.join(60)
                    (result,) = lates
                    assert result.error is not None and result.error.code == "node_lost"
                    assert result.error.retryable, result.error
                    assert not not_taken.is_set()  # never sent to the leaving agent
                held.join(60)
                first.end()
                assert not held.is_alive()
                until(lambda: "n1" not in running.engine.hub.links, "the node left")
                said = [r for r in caplog.records if r.getMessage().startswith("node n1 ")]
                (result,) = results
                if grace_s:
                    assert result.status is ActionStatus.OK, result
                else:  # killed at the grace's end: it ran in part, not to run again
                    assert result.error is not None, result
                    assert result.error.code == "outcome_unknown", result.error
                    assert not result.error.retryable and result.idempotency_key == "k1"
                    assert "agent stopped after the action was sent" in result.error.message
                    # The next agent (the roll's new pod) answers the key's retry.
                    second = _Served(_agent(runtime, tmp_path / "keys.journal"), url,
                                     agent_token, None)  # fmt: skip
                    try:
                        until(lambda: "n1" in running.engine.hub.links, "the agent is back")
                        again = client.exec(t.id, ["hold"], idempotency_key="k1")
                    finally:
                        second.end()
                    assert again.error is not None, again
                    assert again.error.code == "outcome_unknown", again.error
    finally:
        runtime.release.set()
    assert any(r.getMessage().startswith("node n1 stopped: ") for r in said), said
    assert all(r.levelno == logging.INFO for r in said), said


def test_work_that_reaches_an_agent_whose_stop_began_ends_at_once_retryable(
    tmp_path: Path,
) -> None:
    """A request that crossed its agent's word that it stops (the stop began, the
    scheduler not yet told) was left unanswered: its command waited for the agent's
    whole grace, then ended outcome_unknown, not retryable, though nothing of it ran.
    Now the agent answers it not taken: the command ends at once node_lost, retryable,
    its key not held as run, so its retry under the key runs on the next agent."""
    tokens, agent_token = _tokens(tmp_path)
    runtime = _Holding()
    agent = _agent(runtime, tmp_path / "keys.journal")
    not_taken = _not_taken(agent)
    with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
        url = running.url.replace("http://", "ws://") + "/v1/agents"
        first = _Served(agent, url, agent_token, 600.0)
        try:
            until(lambda: "n1" in running.engine.hub.links, "the agent joined")
            with Client(running.url, token) as client:
                t = client.open("noop")
                first.loop.call_soon_threadsafe(agent.note_stop)  # (no word of it yet)
                until(lambda: agent.stop_began is not None, "the stop began")
                ran, results = _in_thread(lambda: client.exec(t.id, ["true"], idempotency_key="k1"))
                ran.join(30)  # (before: unanswered until the link closed)
                assert not ran.is_alive(), "the command waited for the agent's grace"
                (result,) = results
                assert not_taken.is_set()
                assert result.error is not None and result.error.code == "node_lost", result
                assert result.error.retryable and result.idempotency_key == "k1"
                assert "the node agent is stopping" in result.error.message
                assert "did not run" in result.error.message, result.error.message
                assert running.engine.hub.links["n1"].leaving  # (the answer said it stops)
            first.end()
            until(lambda: "n1" not in running.engine.hub.links, "the node left")
            second = _Served(_agent(runtime, tmp_path / "keys.journal"), url, agent_token, None)
            try:
                until(lambda: "n1" in running.engine.hub.links, "the agent is back")
                with Client(running.url, token) as client:
                    again = client.exec(t.id, ["true"], idempotency_key="k1")
            finally:
                second.end()
            assert again.status is ActionStatus.OK and not again.error, again  # ran: a first run
        finally:
            runtime.release.set()


def test_during_an_agents_grace_new_work_goes_to_the_other_nodes(tmp_path: Path) -> None:
    """Two real agents; n1's is told to stop while a command of t runs there. New
    trajectories went on opening on n1 (it sorts first), and their opens, as t's next
    commands, were sent to an agent that took nothing more: they hung for its grace and
    ended unavailable or node_lost. Now a trajectory opened in the grace opens on n2 and
    its command runs there at once, while t's next command waits, is never sent to n1,
    and ends node_lost (retryable) once n1's agent has gone; the command that ran there
    when it was told to stop finishes with its result."""
    tokens, agent_token = _tokens(tmp_path)
    runtime = _Holding()
    leaving = _agent(runtime, tmp_path / "keys.journal")
    not_taken = _not_taken(leaving)
    staying = NodeAgent.create(tmp_path / "n2", runtime="noop", cores_for_actions=1, node="n2")
    try:
        with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
            url = running.url.replace("http://", "ws://") + "/v1/agents"
            first = _Served(leaving, url, agent_token, 600.0)
            other = _Served(staying, url, agent_token, None)
            links = running.engine.hub.links
            until(lambda: {"n1", "n2"} <= set(links), "both agents joined")
            with Client(running.url, token) as client:
                t, t0 = client.open("noop"), client.open("noop")  # one each: n1 sorts first
                nodes = [running.engine.state.trajectory("local", x.id).node for x in (t, t0)]
                assert nodes == ["n1", "n2"]
                held, results = _in_thread(lambda: client.exec(t.id, ["hold"]))
                until(runtime.holding.is_set, "the command runs")
                first.loop.call_soon_threadsafe(first.stop.set)
                until(lambda: links["n1"].leaving, "told it leaves")
                opening, opened = _in_thread(lambda: client.open("noop"))
                opening.join(30)  # (sent to n1, it waited for n1's link to close)
                (u,) = opened
                assert running.engine.state.trajectory("local", u.id).node == "n2"
                ran = client.exec(u.id, ["true"])
                assert ran.status is ActionStatus.OK and ran.allocation.node == "n2", ran
                late, lates = _in_thread(lambda: client.exec(t.id, ["true"]))
                until(lambda: bool(running.engine.core.stranded), "t's next command queued")
                assert late.is_alive()
                runtime.release.set()
                held.join(60)
                first.end()
                late.join(60)
                assert not held.is_alive() and not late.is_alive()
                other.end()
        (result,) = results
        assert result.status is ActionStatus.OK, result
        (lost,) = lates
        assert lost.error is not None and lost.error.code == "node_lost", lost
        assert lost.error.retryable and lost.allocation.node is None  # it never started
        assert not not_taken.is_set()  # nothing was sent to n1 once it said it stops
    finally:
        runtime.release.set()


async def _answers_then_leaves(agent: NodeAgent, url: str, token: str) -> None:
    """An agent that answers its first exec as it leaves on purpose: the leaving
    heartbeat, the exec's reply, then the close (1001), one right after the other."""
    async with websockets.connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None
    ) as ws:
        await ws.send(agent.hello().model_dump_json())
        while True:
            text = await ws.recv()
            assert isinstance(text, str)
            req = parse_agent_request(text)
            if req.op == "exec":
                await ws.send(AGENT_LEAVING)
                await ws.send((await agent.handle(req)).model_dump_json())
                await ws.close(1001, "the node agent is stopping")
                return
            await ws.send((await agent.handle(req)).model_dump_json())


def test_a_reply_a_leaving_agent_sent_ends_its_action_however_late_its_waiter_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler gave the waiters of a leaving agent's last replies 8 loop turns, then
    ended every action not yet done node_lost: a reply that came was dropped when its
    waiter needed more (a stream, a call's own task, a loaded loop). The actions answered
    are left to their waiters now, however many turns they take (here: far more)."""
    tokens, agent_token = _tokens(tmp_path)
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)
    request = AgentLink.request

    async def late(self: AgentLink, *args: Any, **kwargs: Any) -> AgentReply:
        reply = await request(self, *args, **kwargs)
        for _ in range(200):  # a loaded loop: the waiter resumes many turns later
            await asyncio.sleep(0)
        return reply

    monkeypatch.setattr(AgentLink, "request", late)
    with service(CONFIG, None, tmp_path, tokens=tokens) as (running, token):
        url = running.url.replace("http://", "ws://") + "/v1/agents"
        served, ended = _in_thread(
            lambda: asyncio.run(_answers_then_leaves(agent, url, agent_token))
        )
        until(lambda: agent.node in running.engine.hub.links, "the agent joined")
        with Client(running.url, token) as client:
            t = client.open("noop")
            result = client.exec(t.id, ["true"])
        served.join(60)
        assert ended == [None]  # it answered, then left
    assert result.status is ActionStatus.OK, result
