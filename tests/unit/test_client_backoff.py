"""The client's waits between retries: they ride out a scheduler's restart by default,
at moments of each client's own, said in its log, and not for a refusal that no wait
clears."""

from __future__ import annotations

import asyncio
import logging
import random
import socket

import pytest

from tangram.client import ServiceUnreachableError, TangramError
from tangram.client.aio import RETRIES, AsyncClient
from tangram.client.common import backoff, retried


def test_retry_after_is_a_floor_not_the_whole_wait() -> None:
    waits = [backoff(1.0, attempt, 0.1) for attempt in range(RETRIES)]
    assert waits == [1.0, 1.0, 1.0, 1.0, 1.6, 3.2, 6.4, 10.0]
    assert backoff(120.0, 0, 0.1) == 30.0  # a service's wait is capped too


def test_the_default_retries_outlast_the_agents_reconnect_window() -> None:
    from tangram.service.records import RECONNECT_WINDOW_S

    # While agents reconnect after a restart, the scheduler answers 503 with Retry-After.
    assert sum(backoff(1.0, a, 0.1) for a in range(RETRIES)) > RECONNECT_WINDOW_S
    # A refused connection (the pod restarting) backs off from 0.1 s.
    assert sum(backoff(None, a, 0.1) for a in range(RETRIES)) > 20.0
    assert AsyncClient("http://127.0.0.1:9", "t" * 24).retries == RETRIES


def test_waits_are_stretched_at_random_never_shortened() -> None:
    """Every waiter refused at one moment (a scheduler's restart) came back at the same
    moments: 0.1, 0.3, 0.7 ... s after it."""
    rng = random.Random(7)
    plain = [backoff(None, a, 0.1) for a in range(RETRIES)]
    stretched = [backoff(None, a, 0.1, rng) for a in range(RETRIES)]
    assert all(p <= s < p * 1.5 for p, s in zip(plain, stretched, strict=True))
    assert stretched != plain
    floor = [backoff(1.0, a, 0.1, rng) for a in range(RETRIES)]
    assert min(floor) >= 1.0 and len(set(floor)) == RETRIES  # Retry-After: a floor still
    again = random.Random(7)  # seeded: the same waits
    assert [backoff(None, a, 0.1, again) for a in range(RETRIES)] == stretched


def test_a_refusal_waiting_cannot_clear_is_not_retried() -> None:
    """A 429 for the tenant's maxTrajectories ("close one first") was retried for 25 s."""
    assert not retried(429, "trajectory")
    assert all(retried(429, field) for field in ("queue", "env", "stream", None))
    assert retried(503, "trajectory") and not retried(404, None)
    assert not TangramError(429, "overloaded", "close one first", [
        {"field": "trajectory", "message": "..."}]).retryable  # fmt: skip


def test_each_retry_is_logged_with_its_reason_try_and_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """They were silent, even at DEBUG: 23 s of nothing before the error."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main() -> None:
        c = AsyncClient(url, "t" * 24, retries=2, backoff_s=0.001, rng=random.Random(3))
        async with c:
            with pytest.raises(ServiceUnreachableError):
                await c.get("t-1")

    with caplog.at_level(logging.INFO, logger="tangram.client"):
        asyncio.run(main())
    said = [r for r in caplog.records if "trying again" in r.getMessage()]
    assert [r.getMessage().split(" failed")[0] for r in said] == [
        "get('t-1'): try 1 of 3", "get('t-1'): try 2 of 3"]  # fmt: skip
    assert all("Cannot connect to host" in r.getMessage() for r in said)
    seeded = random.Random(3)  # the waits the client's rng drew
    assert [r.__dict__["wait_s"] for r in said] == [
        backoff(None, a, 0.001, seeded) for a in range(2)]  # fmt: skip
