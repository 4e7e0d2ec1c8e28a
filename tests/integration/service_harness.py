"""A running scheduler service with a real local node agent, for the tests.

The service runs on its own event-loop thread (exactly as ``tangram up`` runs it), bound to
127.0.0.1 on a free port; tests talk to it through the real client over HTTP.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tangram.api.wire import AGENT_SUBPROTOCOL, STREAM_PATH, EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import TokenStore
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.embedded import Running, free_port, run
from tangram.service.learned_file import LearnedStore
from tangram.service.records import ActionRecord
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
    learned: LearnedStore | None = None,
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
                    learned=learned,
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


# The runtimes a test of environments runs on: the process runtime, and Docker containers
# (its tests share the worker that may start dockerd).


class KeptRecords(logging.Handler):
    """Log records of WARNING and above, kept for a test to read (add it to a logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


RUNTIMES = [
    pytest.param("process", marks=pytest.mark.xdist_group("service")),
    pytest.param(
        "docker", marks=[pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("docker")]
    ),
]


@contextmanager
def on_processes(
    config: PoolConfig, tmp: Path, **service_kw: Any
) -> Iterator[tuple[str, str, Any]]:
    """The service (``service_kw``: more of ``service``'s options) and a process-runtime
    agent (root: it writes cgroups) on every core: its URL, a client token and its engine."""
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    cores = len(os.sched_getaffinity(0))
    agent = NodeAgent.create(
        tmp / "agent", runtime="process", idle_cores=1, cores_for_actions=cores
    )
    with service(config, agent, tmp, **service_kw) as (running, token):
        yield running.url, token, running.engine


def action_started(engine: Any, key: str) -> bool:
    """Whether the local tenant's action of idempotency key ``key`` has started."""
    rec = engine.state.idempotent.get("local", key)
    return isinstance(rec, ActionRecord) and rec.started is not None


@contextmanager
def box_pool(
    request: pytest.FixtureRequest, kind: str, tmp: Path, *, image: str | None = None,
    user: str | None = None, **config: Any,
) -> Iterator[tuple[Running, str]]:  # fmt: skip
    """The service and a ``kind`` agent (root: it writes cgroups) serving one
    environment, ``box`` (workdir /work): of ``image``, else of the busybox test image on
    Docker, as ``user`` (None: the default rule's). ``config``: more PoolConfig fields."""
    if os.geteuid() != 0:
        pytest.skip("the agents write cgroups: needs root")
    if kind == "docker":
        request.getfixturevalue("docker_client")
        image = image or request.getfixturevalue("busybox")
    spec = EnvSpec(name="box", image=image or "unused-by-the-process-runtime", memory_gb=0.3,
                   workdir="/work", user=user)  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    agent = NodeAgent.create(tmp / "agent", runtime=kind, idle_cores=1, cores_for_actions=cores)
    with service(PoolConfig(envs={"box": EnvConfig(spec=spec)}, **config), agent, tmp) as s:
        yield s


def tar_of(*members: tuple[str, bytes, bytes | str]) -> bytes:
    """A tar of (name, type, content or link target) members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            content = data if isinstance(data, bytes) else b""
            if isinstance(data, str):
                info.linkname = data
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def stream_socket(session: Any, token: str) -> Any:
    """A raw action stream of ``token``'s tenant on ``session`` (an aiohttp ClientSession
    with the service's URL as its base): ``async with stream_socket(s, t) as ws``."""
    return session.ws_connect(
        STREAM_PATH, protocols=(AGENT_SUBPROTOCOL,), headers={"Authorization": f"Bearer {token}"}
    )
