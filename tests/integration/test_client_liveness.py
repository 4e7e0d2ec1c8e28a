"""A scheduler that goes silent mid-exec — its host gone, a partition: nothing arrives,
not even a FIN — is noticed by the action stream's pings, and the exec is retried under
its key on a new stream: it gets its result, and runs once. Real service, real agent
(process runtime), the real client, and a TCP proxy on 127.0.0.1 that stops forwarding
on the connections open at a moment without closing them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram.api.wire import EnvSpec
from tangram.client import AsyncClient
from tangram.client import stream as client_stream
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine

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


class SilencingProxy:
    """Forwards 127.0.0.1:port to the service. ``silence()`` stops every connection open
    now, both ways, holding it open: what arrives is read and never passed on. Later
    connections go through."""

    def __init__(self, upstream: str) -> None:
        self.up_port = int(upstream.rsplit(":", 1)[1])
        self.silenced: list[asyncio.Event] = []  # one per connection
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        self.closing = asyncio.Event()

    async def __aenter__(self) -> SilencingProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()
        self.closing.set()
        for writer in self.writers:  # every pipe's read ends
            writer.transport.abort()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def silence(self) -> None:
        for quiet in self.silenced:
            quiet.set()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.up_port)
        self.writers += [cw, uw]
        quiet = asyncio.Event()
        self.silenced.append(quiet)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await r.read(65536):
                    if quiet.is_set():
                        await self.closing.wait()  # silent from now on, closing nothing
                        return
                    w.write(data)
                    await w.drain()

        try:
            await asyncio.gather(pipe(cr, uw), pipe(ur, cw))
        finally:
            cw.transport.abort()
            uw.transport.abort()


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
        async with SilencingProxy(url) as proxy, AsyncClient(proxy.url, token) as c:
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
