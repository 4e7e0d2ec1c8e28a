"""The client against a peer that says nothing: a listener that never completes a
connect, the TCP keepalive that ends a connection to a host gone silent, and a server
that never answers, past the client's own timeout_s. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from tangram.client import AsyncClient, CallTimeoutError, ServiceUnreachableError
from tangram.client import aio as client_aio

GUARD_S = 60  # a call not ended by then hangs: a failure, not a wait


@contextlib.contextmanager
def _unanswered() -> Iterator[int]:
    """A port whose connects get no SYN-ACK: its listener's accept queue (backlog 0) is
    full, so the kernel drops further SYNs, as a host gone away or cut off does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port))  # queued, never accepted
    try:
        yield port
    finally:
        filler.close()
        listener.close()


def test_a_connect_nobody_answers_gives_up_and_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_aio, "CONNECT_S", 0.2)

    async def main(port: int) -> None:
        async with AsyncClient(
            f"http://127.0.0.1:{port}", "t" * 24, retries=1, backoff_s=0.01
        ) as c:
            with pytest.raises(ServiceUnreachableError):
                await asyncio.wait_for(c.get("t-1"), GUARD_S)

    with _unanswered() as port:
        asyncio.run(main(port))


def test_the_client_s_connections_have_tcp_keepalive() -> None:
    async def main() -> None:
        looked = asyncio.Event()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
            await looked.wait()  # the body, as a long exec's, once the test has looked
            writer.write(b"{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with (
            server,
            AsyncClient(f"http://127.0.0.1:{port}", "t" * 24) as c,
            c._http().get("/healthz") as response,
        ):
            assert response.connection is not None
            transport = response.connection.transport
            assert transport is not None
            sock = transport.get_extra_info("socket")
            keepalive = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            looked.set()
            assert await response.read() == b"{}"
        assert keepalive == 1
        assert idle == client_aio.KEEPALIVE_IDLE_S

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _silent_server() -> AsyncIterator[str]:
    """A server on 127.0.0.1 that reads every request and never answers: its URL."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(1 << 16):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        async with server:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.transport.abort()


def test_the_client_s_timeout_names_the_call_it_ended() -> None:
    """It was a bare ``TimeoutError()``: no call, no timeout, nothing of what it bounds."""

    async def main() -> None:
        async with _silent_server() as url, AsyncClient(url, "t" * 24, timeout_s=0.2) as c:
            with pytest.raises(CallTimeoutError) as write:
                await asyncio.wait_for(c.files("t-1").write("big.bin", b"x" * 1024), GUARD_S)
            said = str(write.value)
            assert "files.write('big.bin') of trajectory t-1" in said
            assert "timeout_s=0.2 s" in said and "a file's whole transfer included" in said
            assert write.value.timeout_s == 0.2 and write.value.call.startswith("files.write")
            assert isinstance(write.value, TimeoutError)  # what callers caught before
            with pytest.raises(CallTimeoutError, match=r"to get\('t-1'\)$"):
                await asyncio.wait_for(c.get("t-1"), GUARD_S)

    asyncio.run(main())
