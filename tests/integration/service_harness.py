"""A running scheduler service with a real local node agent, for the tests.

The service runs on its own event-loop thread (exactly as ``tangram up`` runs it), bound to
127.0.0.1 on a free port; tests talk to it through the real client over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import TokenStore
from tangram.service.config import PoolConfig
from tangram.service.embedded import Running, free_port, run
from tangram.service.reviews import TokenReviewer


@contextmanager
def service(
    config: PoolConfig,
    agent: NodeAgent | None,
    tmp: Path,
    *,
    grace_s: float = 5.0,
    tokens: TokenStore | None = None,
    reviewer: TokenReviewer | None = None,
    close_on_exit: bool = True,
) -> Iterator[tuple[Running, str]]:
    """Yield the running service and a client token (of tenant ``local``, if any)."""
    tokens = tokens or TokenStore.create(tmp / "tokens")
    token = tokens.token_for("local") or ""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready: list[Running] = []
    started = threading.Event()
    failure: list[BaseException] = []

    def on_ready(r: Running) -> None:
        ready.append(r)
        started.set()

    def main() -> None:
        async def go() -> None:
            try:
                await run(
                    config,
                    tokens,
                    agent,
                    stop,
                    port=free_port(),
                    grace_s=grace_s,
                    on_ready=on_ready,
                    reviewer=reviewer,
                    close_on_exit=close_on_exit,
                )
            except BaseException as e:  # surfaced to the test below
                failure.append(e)
                started.set()

        loop.run_until_complete(go())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    started.wait(60)
    if failure:
        raise failure[0]
    try:
        yield ready[0], token
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)


def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for ``check`` (polled); fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
