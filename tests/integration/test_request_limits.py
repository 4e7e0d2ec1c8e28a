"""What the scheduler reads of a request before it can refuse it: a request head, and a
frame of a client's action stream, are bounded as they arrive (raw sockets on 127.0.0.1);
the agents' link keeps reading frames of many MiB."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from tangram.api.wire import AGENT_SUBPROTOCOL, AGENTS_PATH, STREAM_PATH, EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.embedded import HEAD_BYTES, Running
from tangram.service.stream import frame_limit

from .service_harness import service, stream_socket

pytestmark = [pytest.mark.xdist_group("service")]
CONFIG = PoolConfig(envs={"noop": EnvConfig(spec=EnvSpec(name="noop", image="none"))})
WAIT_S = 30.0  # for an answer that comes at once; only a missing one waits this long
# The exec server's bounds on a command (exec_server.c's MAX_ARGS, MAX_FRAME).
EXEC_MAX_ENTRIES, EXEC_MAX_BYTES = 4096, 1 << 20


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Running, str]]:
    with service(CONFIG, None, tmp_path) as (run, token):
        yield run, token


def _connect(run: Running) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(run.url.rsplit(":", 1)[1])))
    s.settimeout(WAIT_S)
    return s


def _send_until_refused(s: socket.socket, chunks: Iterator[bytes]) -> None:
    """Send each chunk; stop when the server has closed the connection."""
    for chunk in chunks:
        try:
            s.sendall(chunk)
        except OSError:  # (EPIPE, ECONNRESET) refused: what it answered is still there
            return


def _read_all(s: socket.socket) -> bytes:
    got = b""
    try:
        while data := s.recv(65536):
            got += data
    except ConnectionResetError:  # it closed with what we sent unread: the rest is lost
        pass
    except TimeoutError:
        pytest.fail(f"no answer and no close in {WAIT_S:g} s (got {got[:200]!r})")
    return got


def test_a_request_head_past_the_bound_gets_431_and_the_connection_closes(
    running: tuple[Running, str],
) -> None:
    """Header lines that never end were all kept (hundreds of MiB, no answer), before
    any token is checked: past ``HEAD_BYTES`` the answer is 431."""
    run, _ = running
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    with _connect(run) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        _send_until_refused(s, (line for _ in range(16 * HEAD_BYTES // len(line))))
        got = _read_all(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert b"connection: close" in got.lower()


def test_a_large_head_within_the_bound_is_served(running: tuple[Running, str]) -> None:
    run, _ = running
    filler = "".join(f"X-Filler-{i}: {'a' * 1000}\r\n" for i in range(HEAD_BYTES // 2 // 1000))
    with _connect(run) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: x\r\n{filler}Connection: close\r\n\r\n".encode())
        got = _read_all(s)
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]


def _ws_handshake(run: Running, token: str, path: str) -> socket.socket:
    s = _connect(run)
    s.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {AGENT_SUBPROTOCOL}\r\n"
        f"Authorization: Bearer {token}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        data = s.recv(4096)
        assert data, head
        head += data
    assert head.startswith(b"HTTP/1.1 101 "), head
    assert head.endswith(b"\r\n\r\n")  # nothing sent after it before we send
    return s


def _frame_head(opcode: int, length: int, *, fin: bool) -> bytes:
    """A client frame's header, masked with a zero key (the payload goes as it is)."""
    first = (0x80 if fin else 0) | opcode
    if length < 126:
        head = struct.pack("!BB", first, 0x80 | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", first, 0x80 | 126, length)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, length)
    return head + b"\0\0\0\0"


def _close_code(data: bytes) -> int | None:
    """The code of the close frame among the server's frames in ``data``, if any."""
    while len(data) >= 2:
        opcode, length = data[0] & 0x0F, data[1] & 0x7F
        at = 2
        if length == 126:
            (length,), at = struct.unpack("!H", data[2:4]), 4
        elif length == 127:
            (length,), at = struct.unpack("!Q", data[2:10]), 10
        payload, data = data[at : at + length], data[at + length :]
        if opcode == 0x8:
            return int(struct.unpack("!H", payload[:2])[0]) if len(payload) >= 2 else None
    return None


_BINARY, _CONT = 0x2, 0x0


def test_a_stream_frame_past_the_bound_ends_the_stream_before_it_is_read(
    running: tuple[Running, str],
) -> None:
    """A frame that says it holds 48 MiB was read whole (frames up to 64 MiB, for the
    agents' link) before its message got its 413: ten such streams held over a GiB. Now
    its header alone ends the stream (1009, message too big), its payload never read."""
    run, token = running
    declared = 48 << 20
    assert declared > frame_limit(run.engine.config.max_request_bytes)
    with _ws_handshake(run, token, STREAM_PATH) as s:
        s.sendall(_frame_head(_BINARY, declared, fin=True) + b'{"id": 1, "x": "' + b"a" * 65536)
        got = _read_all(s)
    assert _close_code(got) == 1009, got[:200]


def test_a_stream_message_in_fragments_past_the_bound_ends_the_stream(
    running: tuple[Running, str],
) -> None:
    """Fragments of 256 KiB, none of them too large, that never end the message: the
    fragment that takes it past the bound ends the stream (1009)."""
    run, token = running
    piece = 256 << 10
    count = 4 * frame_limit(run.engine.config.max_request_bytes) // piece
    frames = (
        _frame_head(_BINARY if i == 0 else _CONT, piece, fin=False) + b"a" * piece
        for i in range(count)
    )
    with _ws_handshake(run, token, STREAM_PATH) as s:
        _send_until_refused(s, frames)
        got = _read_all(s)
    assert _close_code(got) == 1009, got[:200]


def test_a_message_over_the_request_limit_within_the_bound_is_answered_413(
    tmp_path: Path,
) -> None:
    """Under the frame bound, a message over ``maxRequestBytes`` is answered 413 and the
    stream goes on (here its limit is 4 MiB: the bound is over 8)."""
    config = PoolConfig(envs=CONFIG.envs, max_request_bytes=4 << 20)
    assert frame_limit(config.max_request_bytes) > 8 << 20

    async def go(url: str, token: str) -> list[dict[str, object]]:
        async with (
            aiohttp.ClientSession(url) as session,
            stream_socket(session, token) as ws,
        ):
            big = b'{"id":7,"trajectory":"t-none","exec":{"argv":["' + b"a" * (6 << 20) + b'"]}}'
            small = b'{"id":8,"trajectory":"t-none","exec":{"argv":["true"]}}'
            await ws.send_bytes(big)
            await ws.send_bytes(small)
            answers: list[dict[str, object]] = []
            while len(answers) < 2:
                msg = await ws.receive(timeout=WAIT_S)
                assert msg.type is aiohttp.WSMsgType.BINARY, msg
                answers += [json.loads(line) for line in msg.data.split(b"\n")]
            return answers

    with service(config, None, tmp_path) as (run, token):
        answers = asyncio.run(go(run.url, token))
    status = {a["id"]: a["status"] for a in answers}
    assert status[7] == 413 and status[8] != 413  # (no agent here: 503, answered all the same)


def test_a_command_the_exec_server_cannot_start_is_refused_before_it_takes_a_core(
    tmp_path: Path,
) -> None:
    """Over the exec server's 4,096 arguments (or its 1 MiB request, under a pool that
    takes larger bodies, or Linux's 128 KiB for one argument) an exec was admitted, took a
    core and only then failed (``exec_failed``): it is a 400 naming ``argv`` now, over
    HTTP, in a batch and on the stream, and nothing of it is queued. At the bound it runs."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=2)
    config = PoolConfig(envs=CONFIG.envs, max_request_bytes=4 << 20)
    over = ["echo", *["x"] * EXEC_MAX_ENTRIES]
    refused = [
        ({"argv": ["echo", *["x"] * 50_002]}, "argv", "50003 entries, over the exec server's 4096"),
        ({"argv": over}, "argv", "4097 entries"),
        ({"argv": ["echo", *["a" * 100_000] * 11]}, "argv", f"over the {EXEC_MAX_BYTES}"),
        ({"argv": ["echo", "a" * (128 << 10)]}, "argv", "an argument of 131073 bytes"),
        ({"argv": ["true"], "env": {"V": "a" * (128 << 10)}}, "env", "'V': 131075 bytes"),
        ({"argv": ["true"], "env": {f"V{i}": "" for i in range(EXEC_MAX_ENTRIES)}}, "env",
         "4097 variables"),
    ]  # fmt: skip

    async def streamed(url: str, token: str, tid: str) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession(url) as session,
            stream_socket(session, token) as ws,
        ):
            message = {"id": 1, "trajectory": tid, "exec": {"argv": over}}
            await ws.send_bytes(json.dumps(message).encode())
            msg = await ws.receive(timeout=WAIT_S)
            return dict(json.loads(msg.data))

    with service(config, agent, tmp_path) as (run, token):
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=run.url, headers=auth, timeout=WAIT_S) as http:
            tid = http.post("/v1/trajectories", json={"env": "noop"}).json()["id"]
            for body, field, words in refused:
                answer = http.post(f"/v1/trajectories/{tid}/exec", json=body)
                assert answer.status_code == 400, answer.text[:300]
                error = answer.json()["error"]
                assert error["details"][0]["field"] == field and words in error["message"], error
            batch = {"actions": [{"trajectory": tid, "exec": {"argv": ["true"]}},
                                 {"trajectory": tid, "exec": {"argv": over}}]}  # fmt: skip
            answer = http.post("/v1/batch", json=batch)
            assert answer.status_code == 400, answer.text[:300]
            assert answer.json()["error"]["details"][0]["field"] == "actions.1.exec.argv"
            on_stream = asyncio.run(streamed(run.url, token, tid))
            assert on_stream["status"] == 400, on_stream
            assert on_stream["error"]["details"][0]["field"] == "argv"
            assert http.get(f"/v1/trajectories/{tid}").json()["actions"] == 0
            assert not run.engine.state.actions  # nothing queued, no core taken

            answer = http.post(f"/v1/trajectories/{tid}/exec", json={"argv": over[:-1]})
            assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text


def test_the_agents_link_still_reads_frames_of_many_mib(tmp_path: Path) -> None:
    """The stream's bound is not the agents' link's: an agent's hello of 24 MiB (a field
    this scheduler does not know, as a newer agent's) joins the node."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    hello = agent.hello().model_dump(mode="json") | {"padding": "x" * (24 << 20)}

    async def join(run: Running, token: str) -> str:
        async with (
            aiohttp.ClientSession(run.url) as session,
            session.ws_connect(
                AGENTS_PATH,
                protocols=(AGENT_SUBPROTOCOL,),
                headers={"Authorization": f"Bearer {token}"},
            ) as ws,
        ):
            await ws.send_str(json.dumps(hello))
            closed = asyncio.ensure_future(_until_closed(ws))
            deadline = time.monotonic() + WAIT_S
            while agent.node not in run.engine.hub.links:
                if closed.done():
                    return f"the link closed ({ws.close_code})"
                if time.monotonic() > deadline:
                    return "the node did not join"
                await asyncio.sleep(0.01)
            closed.cancel()
            return "joined"

    with service(CONFIG, None, tmp_path) as (run, _):
        token = TokenStore.load(tmp_path / "tokens").token_for(AGENT_TENANT)
        assert token is not None
        assert asyncio.run(join(run, token)) == "joined"


async def _until_closed(ws: aiohttp.ClientWebSocketResponse) -> None:
    async for _ in ws:  # what the scheduler asks of the node: left unanswered
        pass


def test_a_body_sent_as_a_form_is_refused_naming_its_content_type(
    running: tuple[Running, str],
) -> None:
    """``curl -d`` sends a form's content type; the framework then reads no JSON, and the
    answer was "body: Input should be a valid dictionary". It names the header now (415);
    a JSON body of the wrong shape is still a 400 naming its field."""
    run, token = running
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=run.url, headers=auth, timeout=WAIT_S) as http:
        for kind in ("application/x-www-form-urlencoded", "text/plain"):
            answer = http.post(
                "/v1/trajectories", content=b'{"env": "noop"}', headers={"content-type": kind}
            )
            assert answer.status_code == 415, answer.text
            error = answer.json()["error"]
            assert error["code"] == "unsupported_media_type"
            assert "Content-Type: application/json" in error["message"] and kind in error["message"]
        answer = http.post("/v1/trajectories", json={"env": 3})
        assert answer.status_code == 400 and answer.json()["error"]["details"][0]["field"] == "env"
