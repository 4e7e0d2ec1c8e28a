"""The idempotency key a submission ran under reaches its caller: on the result, also
from a scheduler of an earlier release that leaves it out of its answers, and on the
``ServiceUnreachableError`` of a submission whose answers were all lost (it may have been
submitted and run: retried under that key, it never runs twice). The scheduler is a
stand-in on 127.0.0.1 that answers as told."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar

import pytest

from tangram.api.wire import AGENT_SUBPROTOCOL, ActionResult, ActionStatus
from tangram.client import AsyncClient, Client, ServiceUnreachableError

from .http_stub import JsonHandler, http_serving

TOKEN = "t" * 24


def _old_result(kind: str = "exec") -> dict[str, Any]:
    """A result as an earlier release wrote it: no idempotency_key."""
    answer = ActionResult(id="a-1", kind=kind, status=ActionStatus.OK, exit_code=0)
    return answer.model_dump(mode="json", exclude={"idempotency_key"})


class _Stub(JsonHandler):
    """Answers as an earlier release (``lose`` False), or loses every answer: it reads the
    request, then drops the connection (``lose``)."""

    lose: ClassVar[bool] = False
    bodies: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server names it)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append((self.path, body))
        if self.lose:
            self.close_connection = True
            return
        if self.path == "/v1/batch":
            self.answer(200, {"results": [_old_result() for _ in body["actions"]]})
        else:
            self.answer(200, _old_result("api" if "/apis/" in self.path else "exec"))

    def do_GET(self) -> None:  # noqa: N802
        self.close_connection = True  # (lost)


@pytest.fixture
def stub() -> Iterator[str]:
    _Stub.lose, _Stub.bodies = False, []
    with http_serving(_Stub) as url:
        yield url


def _sent_keys(path: str) -> list[str]:
    return [b["idempotency_key"] for p, b in _Stub.bodies if p == path]


def test_results_name_the_key_the_client_made_when_the_scheduler_does_not(stub: str) -> None:
    with Client(stub, TOKEN, stream=False) as client:
        made = client.exec("t-1", ["true"])
        given = client.exec("t-1", ["true"], idempotency_key="mine")
        lease = client.lease("search")
        batch = client.batch([{"trajectory": "t-1", "exec": {"argv": ["true"]}}])
    assert [made.idempotency_key, given.idempotency_key] == _sent_keys("/v1/trajectories/t-1/exec")
    assert made.idempotency_key and given.idempotency_key == "mine"
    assert [lease.idempotency_key] == _sent_keys("/v1/apis/search/lease")
    ((_, sent),) = [(p, b) for p, b in _Stub.bodies if p == "/v1/batch"]
    assert [r.idempotency_key for r in batch] == [sent["actions"][0]["exec"]["idempotency_key"]]


def test_a_submission_whose_answers_were_all_lost_names_its_key(stub: str) -> None:
    """Every try of the exec reached the stand-in and lost its answer: the error says it
    may have been submitted and run, and names the one key all its tries carried; a
    request that submits nothing (a get) says neither."""
    _Stub.lose = True
    with Client(stub, TOKEN, stream=False, retries=1, backoff_s=0.01) as client:
        with pytest.raises(ServiceUnreachableError) as lost:
            client.exec("t-1", ["true"])
        with pytest.raises(ServiceUnreachableError) as unkeyed:
            client.get("t-1")
    (key,) = set(_sent_keys("/v1/trajectories/t-1/exec"))
    assert len(_sent_keys("/v1/trajectories/t-1/exec")) == 2  # (a first try and a retry)
    assert lost.value.idempotency_keys == [key]
    said = str(lost.value)
    assert said.startswith(f"cannot reach the ARL-Tangram service at {stub}: ")
    assert f"the action with idempotency key {key!r} may have been submitted and may " in said
    assert f"cancel('key:{key}')" in said
    assert lost.value.maybe_sent
    assert unkeyed.value.idempotency_keys == [] and "may have been submitted" not in (
        str(unkeyed.value)
    )


def _refusing_url() -> str:
    """A URL of 127.0.0.1 nothing listens at (connects to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_submission_no_try_of_which_connected_says_it_was_not_submitted(stream: bool) -> None:
    """Every try was refused its connection, so nothing was sent: the error said the
    action may have been submitted and run all the same."""
    with Client(_refusing_url(), TOKEN, stream=stream, retries=1, backoff_s=0.01) as client:
        with pytest.raises(ServiceUnreachableError) as one:
            client.exec("t-1", ["true"], idempotency_key="k1")
        with pytest.raises(ServiceUnreachableError) as many:
            client.batch([{"trajectory": "t-1", "exec": {"argv": ["true"], "idempotency_key": k}}
                          for k in ("a", "b")])  # fmt: skip
    assert one.value.idempotency_keys == ["k1"] and not one.value.maybe_sent
    said = str(one.value)
    assert said.endswith(
        "; none of the 2 tries reached the service: the action with idempotency key 'k1' "
        "was not submitted"
    )
    assert "may have been submitted" not in said and "cancel(" not in said
    assert not many.value.maybe_sent and str(many.value).endswith(
        "none of the 2 tries reached the service: the actions with idempotency keys 'a', "
        "'b' were not submitted"
    )


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server], Awaitable[None]]


async def _raise_from(serve: Serve, **kw: Any) -> ServiceUnreachableError:
    """The ServiceUnreachableError of an exec against a server on 127.0.0.1 whose
    connections ``serve`` handles (it is given the server, to stop listening)."""
    server: asyncio.Server | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert server is not None
        try:
            await serve(reader, writer, server)
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server, AsyncClient(url, TOKEN, retries=1, backoff_s=0.01, **kw) as client:
        with pytest.raises(ServiceUnreachableError) as caught:
            await asyncio.wait_for(client.exec("t-1", ["true"], idempotency_key="k1"), 60)
    return caught.value


async def _request(reader: asyncio.StreamReader) -> bytes:
    """A request's head (its body read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if (length := re.search(rb"(?i)\ncontent-length: *(\d+)", head)) is not None:
        await reader.readexactly(int(length.group(1)))
    return head


async def _take_stream_and_drop_it(
    head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Accept the action stream's handshake, read the start of the exec sent on it, and
    return (the connection then drops: its answer is lost)."""
    match = re.search(rb"(?i)\nsec-websocket-key: *(\S+)", head)
    assert match is not None, head
    magic = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # (RFC 6455)
    accept = base64.b64encode(hashlib.sha1(match.group(1) + magic).digest())
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n"
        b"Sec-WebSocket-Protocol: " + AGENT_SUBPROTOCOL.encode() + b"\r\n\r\n"
    )
    assert await reader.read(1)  # (the exec's frame)


def test_a_streamed_exec_whose_answers_were_lost_may_have_been_submitted() -> None:
    """Each try's exec went out on the stream, which then dropped: it may have run."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: asyncio.Server) -> None:
        await _take_stream_and_drop_it(await _request(r), r, w)

    lost = asyncio.run(_raise_from(serve))
    assert lost.maybe_sent and "'k1' may have been submitted and may have run" in str(lost)


def test_an_exec_the_stream_carried_before_http_took_over_may_have_been_submitted() -> None:
    """Its first try went out on the stream, which dropped; the service then refused the
    stream (an earlier release rolled back to) and stopped listening, and no HTTP try
    connected: the error said it was not submitted, though it may have run."""
    streams: list[bytes] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: asyncio.Server) -> None:
        head = await _request(r)
        if not streams:
            streams.append(head)
            await _take_stream_and_drop_it(head, r, w)
            return
        s.close()  # (listening no more: the HTTP tries are refused)
        w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await w.drain()

    lost = asyncio.run(_raise_from(serve))
    assert streams and lost.maybe_sent
    assert "'k1' may have been submitted and may have run" in str(lost)


def test_an_exec_refused_then_unreachable_says_it_was_not_submitted() -> None:
    """A 503 (try again) took nothing, and the next try found nothing listening."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: asyncio.Server) -> None:
        await _request(r)
        s.close()
        body = json.dumps({"error": {"code": "unavailable", "message": "no node"}}).encode()
        w.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await w.drain()

    lost = asyncio.run(_raise_from(serve, stream=False))
    assert not lost.maybe_sent and (lost.tries, lost.refused) == (2, 1)
    assert str(lost).endswith(
        "none of the 2 tries was taken by the service (1 refused with a 429 or 503, the "
        "rest sent nothing): the action with idempotency key 'k1' was not submitted"
    )


def test_a_proxys_503_is_no_proof_that_nothing_was_submitted() -> None:
    """A gateway's own 503 (Envoy's reset upstream: it may have passed the request on),
    then nothing listening: the error said no try reached the service and the action was
    not submitted, as after the service's own 503. Only the service's 503 takes nothing."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: asyncio.Server) -> None:
        await _request(r)
        s.close()
        body = b"upstream connect error or disconnect/reset before headers"
        w.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await w.drain()

    lost = asyncio.run(_raise_from(serve, stream=False))
    assert lost.maybe_sent and (lost.tries, lost.refused) == (2, 0), str(lost)
    assert "'k1' may have been submitted and may have run" in str(lost)
