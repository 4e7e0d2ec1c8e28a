"""A request that reached the scheduler but whose answer was lost on the way back (a load
balancer's idle cut, a reset): the client retries it, and the retry must take nothing
twice. Real service, real agent (process runtime), the real client, and a TCP proxy on
127.0.0.1 that cuts the connection of the first answer to the path under test."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.wire import EnvSpec
from tangram.client import Client, TangramError
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import on_processes

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(
    envs={"shell": EnvConfig(spec=EnvSpec(name="shell", image="unused", memory_gb=0.1))},
    apis=(ApiSpec(name="search", concurrency=4),),
)


class LossyProxy:
    """Forwards 127.0.0.1:port to the service; the first request whose first line holds
    ``cut`` is forwarded, but its answer is dropped and the client's connection reset."""

    def __init__(self, upstream: str, cut: bytes) -> None:
        self.host, _, port = upstream.removeprefix("http://").partition(":")
        self.up_port, self.cut, self.cuts = int(port), cut, 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        async def main() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            with contextlib.suppress(asyncio.CancelledError):  # closed by the test
                await self.server.serve_forever()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(main())
        # The connections still piped end here, on their loop, before it closes.
        left = asyncio.all_tasks(self.loop)
        for task in left:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.loop.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(self.host, self.up_port)
        first = await cr.read(65536)
        lose = self.cuts == 0 and self.cut in first.split(b"\r\n", 1)[0]
        uw.write(first)
        await uw.drain()
        if lose:
            self.cuts += 1
            await ur.read(65536)  # the service answered: that answer is lost
            cw.transport.abort()
            uw.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)  # serve_forever ends: main does
        self.thread.join(10)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[str, str, object]]:
    with on_processes(CONFIG, tmp_path) as served:
        yield served


@contextlib.contextmanager
def _through(url: str, token: str, cut: bytes) -> Iterator[tuple[LossyProxy, Client]]:
    """A client of the service behind a proxy that loses the first answer to ``cut``."""
    proxy = LossyProxy(url, cut)
    client = Client(proxy.url, token, stream=False, backoff_s=0.05)
    try:
        yield proxy, client
    finally:
        client.shutdown()
        proxy.close()


def test_a_lease_whose_answer_was_lost_is_taken_once(running: tuple[str, str, object]) -> None:
    url, token, engine = running
    with _through(url, token, b"/v1/apis/search/lease") as (proxy, client):
        got = client.lease("search", units=1, hold_s=300)
        assert proxy.cuts == 1 and got.lease
        assert engine.core.quotas["search"].in_use == 1  # type: ignore[attr-defined]
        client.release(got.lease)


def test_a_batch_whose_answer_was_lost_admits_each_action_once(
    running: tuple[str, str, object],
) -> None:
    url, token, engine = running
    with _through(url, token, b"POST /v1/batch") as (proxy, client):
        items = [{"api": "search", "lease": {"units": 1, "hold_s": 300}} for _ in range(2)]
        results = client.batch(items)
        assert proxy.cuts == 1 and all(r.lease for r in results)
        assert engine.core.quotas["search"].in_use == 2  # type: ignore[attr-defined]
        for r in results:
            client.release(r.lease or "")


def test_an_open_whose_answer_was_lost_opens_one_trajectory(
    running: tuple[str, str, object],
) -> None:
    url, token, engine = running
    for given in (None, "mine"):
        with _through(url, token, b"POST /v1/trajectories ") as (proxy, client):
            info = client.open("shell", id=given)
            assert proxy.cuts == 1 and info.id == (given or info.id)
            opened = [t.id for t in engine.trajectories.values()]  # type: ignore[attr-defined]
            assert opened == [info.id]
            assert client.close(info.id).state.value == "closed"


def test_an_idempotency_key_of_another_open_is_a_conflict(
    running: tuple[str, str, object],
) -> None:
    url, token, _ = running
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=auth) as http:
        first = http.post("/v1/trajectories", json={"env": "shell", "idempotency_key": "k1"})
        again = http.post("/v1/trajectories", json={"env": "shell", "idempotency_key": "k1"})
        assert first.status_code == again.status_code == 201
        assert first.json()["id"] == again.json()["id"]
        reused = {"env": "shell", "id": "other", "idempotency_key": "k1"}
        other = http.post("/v1/trajectories", json=reused)
        assert other.status_code == 409, other.text
        assert other.json()["error"]["details"][0]["field"] == "idempotency_key"
        assert http.delete(f"/v1/trajectories/{first.json()['id']}").status_code == 200
        # Once closed, the key names a trajectory that has ended: not opened again.
        late = http.post("/v1/trajectories", json={"env": "shell", "idempotency_key": "k1"})
        assert late.status_code == 409 and "has since ended" in late.text


def test_a_remove_whose_answer_was_lost_is_done(running: tuple[str, str, object]) -> None:
    url, token, _ = running
    with Client(url, token, stream=False) as direct:
        t = direct.open("shell")
        direct.files(t.id).write("gone.txt", "x")
        path = f"DELETE /v1/trajectories/{t.id}/files".encode()
        with _through(url, token, path) as (proxy, client):
            client.files(t.id).remove("gone.txt")  # the retry's 404: the first try did it
            assert proxy.cuts == 1
        assert not direct.files(t.id).exists("gone.txt")
        with pytest.raises(TangramError) as missing:  # a plain 404 is still one
            direct.files(t.id).remove("gone.txt")
        assert missing.value.status == 404
        direct.close(t.id)


def test_a_rename_whose_answer_was_lost_is_done(running: tuple[str, str, object]) -> None:
    url, token, _ = running
    with Client(url, token, stream=False) as direct:
        t = direct.open("shell")
        direct.files(t.id).write("a.txt", "x")
        with _through(url, token, b"/files/rename") as (proxy, client):
            client.files(t.id).rename("a.txt", "b.txt")
            assert proxy.cuts == 1
        assert direct.files(t.id).read_text("b.txt") == "x"
        assert not direct.files(t.id).exists("a.txt")
        direct.close(t.id)


def test_a_release_whose_answer_was_lost_is_done(running: tuple[str, str, object]) -> None:
    url, token, engine = running
    with Client(url, token, stream=False) as direct:
        lease = direct.lease("search", units=1, hold_s=300).lease or ""
        assert engine.core.quotas["search"].in_use == 1  # type: ignore[attr-defined]
        with _through(url, token, b"DELETE /v1/leases") as (proxy, client):
            got = client.release(lease)
            assert proxy.cuts == 1 and got.status.value == "ok" and got.lease == lease
        assert engine.core.quotas["search"].in_use == 0  # type: ignore[attr-defined]
        with pytest.raises(TangramError) as missing:  # a plain 404 is still one
            direct.release(lease)
        assert missing.value.status == 404
