"""The client's waits between retries: they ride out a scheduler's restart by default."""

from __future__ import annotations

from tangram.client.aio import RETRIES, AsyncClient
from tangram.client.common import backoff


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
