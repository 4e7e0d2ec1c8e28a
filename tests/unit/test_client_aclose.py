"""``AsyncClient.aclose`` with calls under way whose connections are refused (connecting,
or waiting to try again): each raises ``ClientClosedError`` at once, wherever it was.
Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from tangram.client import AsyncClient, ClientClosedError
from tangram.client import aio as client_aio
from tests.unit.test_client_liveness import _silent_server

GUARD_S = 60  # a call not ended by then hangs: a failure, not a wait


def _refusing_port() -> int:
    """A port of 127.0.0.1 nothing listens on (connects to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_aclose_ends_a_call_waiting_to_try_again() -> None:
    """It slept out its backoff, then tried on the closed session: aiohttp's bare
    ``RuntimeError('Session is closed')``, after as long as the wait was."""

    async def main() -> None:
        url = f"http://127.0.0.1:{_refusing_port()}"
        c = AsyncClient(url, "t" * 24, retries=3, backoff_s=3600.0)
        calls = [
            asyncio.ensure_future(call)
            for call in (c.get("t-1"), c.files("t-1").read("a"), c.cancel("key:k"))
        ]
        for _ in range(10):  # under way: connecting, or waiting to try again
            await asyncio.sleep(0)
        await asyncio.wait_for(c.aclose(), GUARD_S)
        for call in calls:
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(call, GUARD_S)
        with pytest.raises(ClientClosedError):  # and what comes after
            await c.get("t-1")

    asyncio.run(main())


async def _exec_under_way(url: str) -> tuple[AsyncClient, asyncio.Future[Any]]:
    """A client of ``url`` and its exec under way: sent, waiting for its answer."""
    c = AsyncClient(url, "t" * 24, stream=False)
    call = asyncio.ensure_future(c.exec("t-1", ["true"]))
    while not c._calls:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    return c, call


def _all_closed(c: AsyncClient) -> bool:
    """Whether both of the client's HTTP sessions are closed."""
    return bool(c._session and c._session.closed and c._cancel_session and c._cancel_session.closed)


def test_aclose_cancelled_while_its_calls_wind_down_still_closes_the_connections() -> None:
    """Its wait for the calls it ended (an exec's cancel by key, on a service that does
    not answer) was cut short: it left the connections open, and a second aclose(), the
    client already closing, returned at once, closing nothing."""

    async def main() -> None:
        async with _silent_server() as url:
            c, call = await _exec_under_way(url)
            with pytest.raises(TimeoutError):  # (the cancel by key waits up to CANCEL_S)
                await asyncio.wait_for(c.aclose(), 0.5)
            await c.aclose()
            assert _all_closed(c)
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(call, GUARD_S)

    asyncio.run(main())


@pytest.mark.parametrize("cut_short", [False, True])
def test_a_second_aclose_returns_once_the_first_is_done(
    monkeypatch: pytest.MonkeyPatch, cut_short: bool
) -> None:
    """The first waits for the calls it ended to wind down (an exec's cancel by key, on a
    service that does not answer); the second, finding the client closing, returned at
    once, its caller told the client was closed while the first still waited. Whether the
    first ends by itself or is cancelled, the second returns after it, all closed."""
    monkeypatch.setattr(client_aio, "CANCEL_S", 0.2)  # (the cancel by key's wait)

    async def main() -> None:
        async with _silent_server() as url:
            c, call = await _exec_under_way(url)
            first = asyncio.ensure_future(c.aclose())
            while c._drained is None:  # waiting for the exec to wind down
                await asyncio.sleep(0)
            second = asyncio.ensure_future(c.aclose())
            for _ in range(10):
                await asyncio.sleep(0)
            assert not second.done() and not first.done()
            if cut_short:
                first.cancel()
            await asyncio.wait_for(second, GUARD_S)
            assert _all_closed(c)
            assert call.done() or cut_short  # (wound down, unless the first stopped waiting)
            if cut_short:
                with pytest.raises(asyncio.CancelledError):
                    await first
            else:
                await first
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(call, GUARD_S)

    asyncio.run(main())


def test_an_aclose_cancelled_while_closing_still_closes_and_is_waited_for() -> None:
    """Cancelled again while it closed the stream, the first aclose left the closing half
    done, and a second aclose waiting for it returned with it."""

    class SlowStream:
        closed = False

        def __init__(self) -> None:
            self.closing, self.go_on = asyncio.Event(), asyncio.Event()

        async def aclose(self) -> None:
            self.closing.set()
            await self.go_on.wait()
            self.closed = True

    async def main() -> None:
        c = AsyncClient(f"http://127.0.0.1:{_refusing_port()}", "t" * 24)
        session = c._http()
        c._stream = stream = SlowStream()  # type: ignore[assignment]
        first = asyncio.ensure_future(c.aclose())
        await asyncio.wait_for(stream.closing.wait(), GUARD_S)
        second = asyncio.ensure_future(c.aclose())
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not second.done()
        stream.go_on.set()
        await asyncio.wait_for(second, GUARD_S)
        assert stream.closed and session.closed

    asyncio.run(main())


def test_a_live_exec_after_aclose_says_the_client_was_closed() -> None:
    """aclose turns the stream off (what still retries goes over HTTP): a live exec then
    said it needed the action stream, a ``TangramError`` naming no closed client."""

    async def main() -> None:
        c = AsyncClient(f"http://127.0.0.1:{_refusing_port()}", "t" * 24)
        await c.aclose()
        with pytest.raises(ClientClosedError):
            await c.exec_live("t-1", ["cat"], interactive=True)

    asyncio.run(main())


def test_a_stream_that_fails_to_close_leaves_no_session_open() -> None:
    """Its error came out of aclose before either HTTP session was closed: their
    connections were left open."""

    class FailingStream:
        closed = False

        async def aclose(self) -> None:
            raise OSError("the stream would not close")

    async def main() -> None:
        c = AsyncClient(f"http://127.0.0.1:{_refusing_port()}", "t" * 24)
        session, cancels = c._http(), c._cancels()
        c._stream = FailingStream()  # type: ignore[assignment]
        with pytest.raises(OSError, match="the stream would not close"):
            await c.aclose()
        assert session.closed and cancels.closed

    asyncio.run(main())


def test_giving_up_on_keys_once_the_client_is_closed_is_said_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call given up on (cancelled, past its timeout) cancels its keys on its way out;
    one that got there after aclose had closed the client raised ClientClosedError from
    making the cancels' session, in place of the caller's own error. It is a warning
    now, as a failed close of an open was already."""

    async def main() -> int | None:
        c = AsyncClient(f"http://127.0.0.1:{_refusing_port()}", "t" * 24)
        await c.aclose()
        return await c._abandon(["k1"])

    assert asyncio.run(main()) is None
    assert "could not cancel what was given up, by idempotency key 'k1'" in caplog.text
