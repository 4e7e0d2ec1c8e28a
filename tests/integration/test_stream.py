"""The action stream (``/v1/stream``) against a real service and a real agent: the
async client's execs on one WebSocket, answered as the HTTP route answers them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram.api.wire import STREAM_PATH, EnvSpec
from tangram.client import ActionStatus, AsyncClient, Client, TangramError
from tangram.node_agent.agent import NodeAgent
from tangram.service import stream as stream_module
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.embedded import Running

from .service_harness import KeptRecords, on_processes, service, stream_socket

pytestmark = [pytest.mark.xdist_group("service")]
CONFIG = PoolConfig(envs={"noop": EnvConfig(spec=EnvSpec(name="noop", image="none"))})


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Running, str]]:
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=64)
    with service(CONFIG, agent, tmp_path) as (running, token):
        yield running, token


async def _raw(url: str, token: str, lines: list[bytes]) -> list[dict[str, Any]]:
    """Send ``lines`` in one frame on a stream of our own; the answers, by id order."""
    async with (
        aiohttp.ClientSession(url) as session,
        stream_socket(session, token) as ws,
    ):
        await ws.send_bytes(b"\n".join(lines))
        answers: list[dict[str, Any]] = []
        while len(answers) < len(lines):
            msg = await ws.receive(timeout=30)
            answers += [json.loads(line) for line in msg.data.split(b"\n")]
    return sorted(answers, key=lambda a: (a["id"] is None, a["id"] or 0))


def test_execs_share_one_stream_and_get_what_http_gives(running: tuple[Running, str]) -> None:
    run, token = running

    async def go() -> None:
        async with AsyncClient(run.url, token) as client:
            tids = [(await client.open("noop")).id for _ in range(20)]
            results = await asyncio.gather(*(client.exec(t, ["true"]) for t in tids * 5))
            assert client._stream is not None and not client._stream.closed
            assert all(r.status is ActionStatus.OK and r.exit_code == 0 for r in results)
            assert len({r.id for r in results}) == 100
            assert [r.trajectory for r in results] == tids * 5
            info = await client.get(tids[0])
            assert info.actions == 5
            for t in tids:
                await client.close(t)

    asyncio.run(go())
    assert len(run.engine.state.actions) == 0  # nothing left behind


def test_errors_are_the_http_routes_errors(running: tuple[Running, str]) -> None:
    """Same status, code, field and message on the stream as over HTTP."""
    run, token = running
    with Client(run.url, token) as sync:
        tid = sync.open("noop").id
    cases: list[tuple[str, dict[str, Any]]] = [
        ("t-nobody", {}),  # unknown trajectory: 404
        (tid, {"cores": 0}),  # a bad field: 400 naming it
        (tid, {"profile": "nope"}),  # the env has no such profile
    ]

    def outcome(e: TangramError) -> tuple[int, str, str, str | None]:
        return e.status, e.code, e.message, e.field

    async def streamed(t: str, kw: dict[str, Any]) -> TangramError:
        async with AsyncClient(run.url, token) as client:
            with pytest.raises(TangramError) as e:
                await client.exec(t, None if "profile" in kw else ["true"], **kw)
            assert client._stream is not None  # answered on the stream, not over HTTP
            return e.value

    for t, kw in cases:
        with Client(run.url, token, stream=False) as sync, pytest.raises(TangramError) as http:
            sync.exec(t, None if "profile" in kw else ["true"], **kw)
        assert outcome(asyncio.run(streamed(t, kw))) == outcome(http.value)


def test_a_broken_or_oversized_message_is_answered_and_the_stream_goes_on(
    running: tuple[Running, str],
) -> None:
    run, token = running
    with Client(run.url, token) as sync:
        tid = sync.open("noop").id
    good = json.dumps({"id": 1, "trajectory": tid, "exec": {"argv": ["true"]}}).encode()
    no_argv = json.dumps({"id": 2, "trajectory": tid, "exec": {}}).encode()
    bad_id = json.dumps({"id": "x", "trajectory": tid, "exec": {"argv": ["true"]}}).encode()
    huge = b'{"id":3,"trajectory":"' + b"x" * (2 << 20) + b'"}'
    answers = asyncio.run(_raw(run.url, token, [good, no_argv, huge, b"{not json", bad_id]))
    assert [(a["id"], a["status"]) for a in answers] == [
        (1, 200),
        (2, 400),
        (3, 413),
        (None, 400),
        (None, 400),
    ]
    assert answers[0]["result"]["status"] == "ok"
    assert answers[1]["error"]["details"][0]["field"] == "body"
    assert "give exactly one of argv" in answers[1]["error"]["message"]
    assert answers[2]["error"]["code"] == "too_large"
    assert answers[4]["error"]["details"][0]["field"] == "id"


def test_a_bad_token_is_refused_at_the_handshake_and_answered_as_http_does(
    running: tuple[Running, str],
) -> None:
    """... and logged as a refusal is, not as an ERROR of the server's for each (uvicorn's
    "ASGI callable returned without completing handshake")."""
    run, token = running
    said = KeptRecords()
    logging.getLogger("uvicorn.error").addHandler(said)

    async def go() -> None:
        async with aiohttp.ClientSession(run.url) as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await stream_socket(session, "wrong")
            assert e.value.status == 401
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:  # no subprotocol
                await session.ws_connect(STREAM_PATH, headers={"Authorization": f"Bearer {token}"})
            assert e.value.status == 400
        async with AsyncClient(run.url, "wrong") as client:
            with pytest.raises(TangramError) as err:
                await client.exec("t-any", ["true"])
            assert (err.value.status, err.value.code) == (401, "unauthorized")

    try:
        asyncio.run(go())
    finally:
        logging.getLogger("uvicorn.error").removeHandler(said)
    assert not said.records, [r.getMessage() for r in said.records]


def test_a_retry_after_the_stream_dropped_never_runs_the_action_twice(
    running: tuple[Running, str],
) -> None:
    """An answer lost with its stream: the same key, asked again on a new stream or over
    HTTP, gets the first run's result."""
    run, token = running
    with Client(run.url, token) as sync:
        tid = sync.open("noop").id
    key = "retry-after-drop-1"
    line = json.dumps(
        {"id": 7, "trajectory": tid, "exec": {"argv": ["true"], "idempotency_key": key}}
    ).encode()
    first = asyncio.run(_raw(run.url, token, [line]))[0]["result"]

    async def again() -> Any:
        async with AsyncClient(run.url, token) as client:
            return await client.exec(tid, ["true"], idempotency_key=key)

    streamed = asyncio.run(again())
    with Client(run.url, token, stream=False) as sync:
        over_http = sync.exec(tid, ["true"], idempotency_key=key)
        assert sync.get(tid).actions == 1
    assert streamed.id == over_http.id == first["id"]


def test_admission_control_answers_429_on_the_stream(tmp_path: Path) -> None:
    """A frame of 20 execs, read in one tick against a queue of 5: 5 admitted (and run),
    15 answered 429 with a Retry-After."""
    config = PoolConfig(envs=CONFIG.envs, max_queued=5)
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    with service(config, agent, tmp_path) as (run, token):
        with Client(run.url, token) as sync:
            tid = sync.open("noop").id
        lines = [
            json.dumps({"id": i, "trajectory": tid, "exec": {"argv": ["true"]}}).encode()
            for i in range(1, 21)
        ]
        answers = asyncio.run(_raw(run.url, token, lines))
        assert [a["status"] for a in answers] == [200] * 5 + [429] * 15
        assert {a["error"]["code"] for a in answers[5:]} == {"overloaded"}
        assert {a["retry_after"] for a in answers[5:]} == {1}


@pytest.mark.skipif(os.geteuid() != 0, reason="the process runtime writes cgroups: needs root")
def test_stopping_the_service_answers_what_the_stream_admitted(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="process", cores_for_actions=1)
    config = PoolConfig(
        envs={"shell": EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))}
    )
    results: list[Any] = []

    async def go(run: Running, token: str, stopping: asyncio.Event) -> None:
        async with AsyncClient(run.url, token, retries=0) as client:
            tid = (await client.open("shell")).id
            task = asyncio.create_task(client.exec(tid, ["sh", "-c", "sleep 1; echo done"]))
            while not run.engine.core.running:  # until admitted and running
                await asyncio.sleep(0.01)
            stopping.set()
            results.append(await task)

    with service(config, agent, tmp_path, close_on_exit=False) as (run, token):
        stopping = asyncio.Event()
        loop = asyncio.new_event_loop()
        client_task = loop.create_task(go(run, token, stopping))
        loop.run_until_complete(stopping.wait())
    # the service stopped (the harness waited for it) while the action ran
    loop.run_until_complete(client_task)
    loop.close()
    assert results[0].status is ActionStatus.OK and results[0].stdout == "done\n"


def test_the_pools_request_limit_bounds_http_bodies_and_stream_messages(tmp_path: Path) -> None:
    """``admission.maxRequestBytes`` (2 KiB here): a 3 KiB exec is a 413 either way (a live
    exec's input is not bounded by it: ``test_live_exec``)."""
    config = PoolConfig(envs=CONFIG.envs, max_request_bytes=2048)
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    with service(config, agent, tmp_path) as (run, token):
        with Client(run.url, token, stream=False) as sync:
            tid = sync.open("noop").id
            with pytest.raises(TangramError) as e:
                sync.exec(tid, ["echo", "x" * 3000])
            assert (e.value.status, e.value.code) == (413, "too_large")
            assert sync.exec(tid, ["echo", "x" * 1000]).status is ActionStatus.OK
        big = {"id": 5, "trajectory": tid, "exec": {"argv": ["echo", "x" * 3000]}}
        answer = asyncio.run(_raw(run.url, token, [json.dumps(big).encode()]))[0]
        assert (answer["id"], answer["status"]) == (5, 413)
        assert answer["error"]["message"] == "message over 2048 bytes"


def test_an_action_cancelled_in_the_tick_it_starts_still_ends(
    running: tuple[Running, str],
) -> None:
    """Its task is cancelled before its first step, so its body never runs: the action
    must still end (cancelled), on either transport, and give its core back."""
    run, token = running
    engine = run.engine
    start = engine.rounds.start

    def start_then_cancel(asg: Any, now: float) -> None:
        start(asg, now)
        engine.cancel("local", asg.action_id)

    async def once(stream: bool) -> tuple[str, ActionStatus]:
        async with AsyncClient(run.url, token, stream=stream) as c:
            tid = (await c.open("noop")).id
            return tid, (await asyncio.wait_for(c.exec(tid, ["true"]), 30)).status

    engine.rounds.start = start_then_cancel  # type: ignore[method-assign]
    try:
        for stream in (True, False):
            tid, status = asyncio.run(once(stream))
            assert status is ActionStatus.CANCELLED
    finally:
        engine.rounds.start = start  # type: ignore[method-assign]
    with Client(run.url, token) as c:
        assert c.exec(tid, ["true"]).status is ActionStatus.OK
    assert not engine.trajectories[tid].running and not engine.core.running


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(["argv", "cpu", "profile", "session", "code", "env", "args"])
_OPTIONS = st.sampled_from(["cpu", "timeout_s", "t1_s", "env", "output_cap", "type"])


def test_fuzzed_messages_are_answered_below_500_and_the_stream_goes_on(
    running: tuple[Running, str],
) -> None:
    """Whatever a line holds — random bytes, random JSON, exec bodies of random fields,
    commands with random options — it gets exactly one answer, never a 5xx, and the
    stream keeps answering."""
    run, token = running
    with Client(run.url, token, stream=False) as sync:
        tid = sync.open("noop").id
    command = st.builds(
        lambda argv, options: {"argv": argv, **options},
        st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3),
        st.dictionaries(_OPTIONS, _JSON, max_size=2),
    )
    message = st.fixed_dictionaries(
        {
            "id": st.integers(min_value=0, max_value=1 << 53),
            "trajectory": st.sampled_from([tid, tid, tid, "t-nobody"]) | st.text(max_size=12),
            "exec": command | st.dictionaries(_FIELDS, _JSON, max_size=3),
        }
    )
    line = (
        message.map(lambda m: json.dumps(m).encode())
        | _JSON.map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=40)
    ).filter(lambda b: b.strip() and b"\n" not in b)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(line, min_size=1, max_size=8))
    def check(lines: list[bytes]) -> None:
        answers = asyncio.run(_raw(run.url, token, lines))
        assert len(answers) == len(lines)
        assert all(a["status"] < 500 for a in answers), answers
        assert all(("result" in a) == (a["status"] == 200) for a in answers)

    check()


def test_an_exec_too_large_for_a_frame_goes_over_http(running: tuple[Running, str]) -> None:
    """Over a frame (1 MiB) the client does not put it on the stream (a frame far over the
    pool's maxRequestBytes would end the stream): HTTP answers it, here with the pool's
    413, and the stream stays up for the rest."""
    run, token = running

    async def go() -> None:
        async with AsyncClient(run.url, token) as client:
            tid = (await client.open("noop")).id
            assert (await client.exec(tid, ["true"])).status is ActionStatus.OK
            with pytest.raises(TangramError) as e:
                await client.exec(tid, ["echo", "x" * (3 << 20)])
            assert (e.value.status, e.value.code) == (413, "too_large")
            # HTTP's wording: the stream would have said "message over ..." instead.
            assert e.value.message.startswith("request body over")
            assert client._stream is not None and not client._stream.closed
            assert (await client.exec(tid, ["true"])).status is ActionStatus.OK

    asyncio.run(go())


def test_input_and_signals_name_what_they_cannot_reach(running: tuple[Running, str]) -> None:
    """A signal or input for an id with no streamed exec is a 404 naming the id; input for
    one not sent interactive, or an unknown signal, a 400; the stream goes on."""
    run, token = running
    with Client(run.url, token) as sync:
        tid = sync.open("noop").id
    plain = json.dumps({"id": 1, "trajectory": tid, "exec": {"argv": ["true"]}}).encode()
    nobody = json.dumps({"id": 7, "signal": "SIGINT"}).encode()
    hangup = json.dumps({"id": 8, "signal": "SIGHUP"}).encode()
    says_exec = json.dumps({"id": 9, "stdin": "exec"}).encode()  # input, whatever it holds
    session = {"session": {"kind": "bash"}, "code": "true"}
    streamed_session = json.dumps(
        {"id": 10, "trajectory": tid, "exec": session, "stream": True}
    ).encode()
    lines = [plain, nobody, hangup, says_exec, streamed_session]
    answers = asyncio.run(_raw(run.url, token, lines))
    assert [(a["id"], a["status"]) for a in answers] == [
        (1, 200), (7, 404), (8, 400), (9, 404), (10, 400)
    ]  # fmt: skip
    assert "7 is no streamed exec" in answers[1]["error"]["message"]
    # Only why the signal is refused: not also "signal: Extra inputs are not permitted",
    # from reading the message as input as well.
    assert answers[2]["error"]["details"] == [
        {"field": "signal", "message": "Input should be 'SIGINT', 'SIGTERM' or 'SIGKILL'"}
    ]
    assert answers[2]["error"]["message"].startswith("signal: Input should be 'SIGINT'")
    # Refused input is not an exec's answer: a client routes it apart.
    assert [a.get("about") for a in answers] == [None, "input", "input", "input", None]
    assert "session step is not streamed" in answers[4]["error"]["message"]


def test_a_message_of_the_wrong_json_types_is_refused_naming_the_field(
    running: tuple[Running, str],
) -> None:
    """The stream reads the exec as the HTTP route does, never converting a value; its
    own fields (the id, ``stream``) and control messages alike."""
    run, token = running
    with Client(run.url, token) as sync:
        tid = sync.open("noop").id
    lines = [
        json.dumps({"id": 1, "trajectory": tid, "exec": {"argv": ["true"], "pty": "yes"}}),
        json.dumps({"id": 2, "trajectory": tid, "exec": {"argv": ["true"], "cpu": True}}),
        json.dumps({"id": 3, "trajectory": tid, "exec": {"argv": ["true"]}, "stream": 1}),
        json.dumps({"id": 4, "trajectory": tid, "exec": {"argv": ["true"],
                                                         "cpu": {"min": 3, "max": 2}}}),
        json.dumps({"id": 5, "stdin": "x", "eof": "yes"}),
        json.dumps({"id": 6, "signal": "SIGINT", "stdin": "x"}),
    ]  # fmt: skip
    answers = asyncio.run(_raw(run.url, token, [line.encode() for line in lines]))
    assert [(a["id"], a["status"]) for a in answers] == [(i, 400) for i in range(1, 7)]
    fields = [[d["field"] for d in a["error"]["details"]] for a in answers]
    assert fields == [["pty"], ["cpu"], ["stream"], ["cpu"], ["eof"], ["stdin"]]


def test_a_client_that_never_reads_is_cut_off_and_its_connection_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers pile up past the bounds and none leaves for STALL_S: the stream ends. Its
    close frame cannot reach a client whose window is full, so the service lets go of
    the connection itself rather than hold it (and what it queued) until the client reads
    or goes. When the client reads at last, what was in flight comes, then the end."""
    bounds = {"BACKLOG_BYTES": 1 << 19, "UNREAD_BYTES": 1 << 20, "STALL_S": 0.2,
              "CLOSE_WAIT_S": 0.2}  # fmt: skip
    for name, value in bounds.items():
        monkeypatch.setattr(stream_module, name, value)
    shell = EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))
    with on_processes(PoolConfig(envs={"shell": shell}), tmp_path) as (url, token, _):
        with Client(url, token) as sync:
            tid = sync.open("shell").id
        asyncio.run(asyncio.wait_for(_submit_and_never_read(url, token, tid), 120))


async def _submit_and_never_read(url: str, token: str, tid: str) -> None:
    # 64 MB of answers: far more than the kernel's buffers on both ends hold.
    lines = _megabyte_answers(tid, 64)
    service_port = int(url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession(url) as session, stream_socket(session, token) as ws:
        client_port = ws.get_extra_info("sockname")[1]
        assert _service_holds(service_port, client_port)  # (found where it is looked for)
        await ws.send_bytes(b"\n".join(lines))
        while _service_holds(service_port, client_port):
            await asyncio.sleep(0.05)
        while (await ws.receive()).type is aiohttp.WSMsgType.BINARY:
            pass  # answers the kernel had taken before the service let go, then the end


def _megabyte_answers(tid: str, count: int) -> list[bytes]:
    """Stream messages of ``count`` execs, each answered with 1 MB of output."""
    body = {"argv": ["sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' x"],
            "output_cap": 1 << 20}  # fmt: skip
    return [json.dumps({"id": i, "trajectory": tid, "exec": body}).encode() for i in range(count)]


def _service_holds(service_port: int, client_port: int) -> bool:
    """Whether a process still holds the service's end of the connection from
    ``client_port``: Linux's table of TCP sockets gives an end let go no inode."""
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, inode = row.split()[1], row.split()[2], row.split()[9]
        if local.endswith(f":{service_port:04X}") and remote.endswith(f":{client_port:04X}"):
            return inode != "0"
    return False


def test_a_stopping_service_lets_go_of_a_client_that_never_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service stops while a client's answers wait unread (not yet cut off): after its
    bounded wait for them, the stream's 1001 close cannot reach the client either, and
    the stop does not wait on it: the connection is let go and the service ends."""
    monkeypatch.setattr(stream_module, "CLOSE_WAIT_S", 0.2)
    shell = EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))
    holding = threading.Event()
    stopped = threading.Event()

    def serve(ready: list[tuple[str, str, str]]) -> None:
        with on_processes(PoolConfig(envs={"shell": shell}), tmp_path, grace_s=0.5) as (
            url, token, _
        ):  # fmt: skip
            with Client(url, token) as sync:
                ready.append((url, token, sync.open("shell").id))
            holding.wait(120)
        stopped.set()

    ready: list[tuple[str, str, str]] = []
    server = threading.Thread(target=serve, args=(ready,), daemon=True)
    server.start()
    while not ready:
        assert server.is_alive(), "the service did not start"
        stopped.wait(0.05)
    asyncio.run(asyncio.wait_for(_stop_while_unread(*ready[0], holding, stopped), 120))


async def _stop_while_unread(
    url: str, token: str, tid: str, holding: threading.Event, stopped: threading.Event
) -> None:
    lines = _megabyte_answers(tid, 16)
    service_port = int(url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession(url) as session, stream_socket(session, token) as ws:
        client_port = ws.get_extra_info("sockname")[1]
        await ws.send_bytes(b"\n".join(lines))
        await asyncio.sleep(1)  # (the answers come and fill both ends' buffers)
        holding.set()  # stop the service, the client still not reading
        while _service_holds(service_port, client_port):  # (a stuck close holds it)
            await asyncio.sleep(0.05)
        while not stopped.is_set():
            await asyncio.sleep(0.05)
