"""``AsyncClient.aclose`` with calls under way whose connections are refused (connecting,
or waiting to try again): each raises ``ClientClosedError`` at once, wherever it was.
Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tangram.client import AsyncClient, ClientClosedError

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
