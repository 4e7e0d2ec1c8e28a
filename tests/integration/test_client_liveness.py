"""A scheduler that goes silent mid-exec — its host gone, a partition: nothing arrives,
not even a FIN — is noticed by the action stream's pings, and the exec is retried under
its key on a new stream: it gets its result, and runs once. Real service, real agent
(process runtime), the real client, and a TCP proxy on 127.0.0.1 that stops forwarding
on the connections open at a moment without closing them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram.api.wire import EnvSpec
from tangram.client import AsyncClient
from tangram.client import stream as client_stream
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine

from .proxies import Proxy
from .service_harness import action_started, on_processes

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(
    envs={"shell": EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))}
)
GUARD_S = 60  # an exec not answered by then hangs: a failure, not a wait


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[str, str, Engine]]:
    with on_processes(CONFIG, tmp_path) as served:
        yield served


def test_an_exec_outlives_a_scheduler_gone_silent(
    running: tuple[str, str, Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, token, engine = running
    monkeypatch.setattr(client_stream, "HEARTBEAT_S", 1.0)  # (15 s by default)
    runs, go = tmp_path / "runs", tmp_path / "go"
    # It starts (a line in runs), then waits for the test to say go: its answer comes
    # only once the connection it was sent on is silent.
    script = f"echo run >> {runs}; while [ ! -e {go} ]; do sleep 0.01; done; echo done"

    def started() -> bool:
        return action_started(engine, "silent-1")

    async def main() -> None:
        async with AsyncClient(url, token) as direct:
            t = await direct.open("shell")
        async with Proxy(url) as proxy, AsyncClient(proxy.url, token) as c:
            await c.exec(t.id, ["true"])  # its stream is open, through the proxy
            task = asyncio.create_task(c.exec(t.id, ["sh", "-c", script],
                                              idempotency_key="silent-1"))  # fmt: skip
            async with asyncio.timeout(GUARD_S):
                while not started():
                    await asyncio.sleep(0.01)
            proxy.silence()
            go.touch()
            done, _ = await asyncio.wait({task}, timeout=GUARD_S)
            assert done, "the exec still waits on a stream that stays silent"
            r = task.result()
            assert (r.status.value, r.stdout) == ("ok", "done\n")
        assert runs.read_text() == "run\n"  # once: the retry got the first run's result
        async with AsyncClient(url, token) as direct:
            await direct.close(t.id)

    asyncio.run(main())
