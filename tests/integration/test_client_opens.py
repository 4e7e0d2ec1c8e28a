"""An open the caller gives up on while the service still makes its environment (its task
cancelled, ``asyncio.timeout`` around ``client.trajectory()``, the client's own
``timeout_s``, ``aclose``, a sync ``Client`` shut down): the trajectory it opened is
closed by the open's idempotency key, not left holding an environment and its memory
until the idle timeout. Real service, real agent (process runtime) whose environment's
setup waits for the test to say go, the real client, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tangram.api.wire import EnvSpec
from tangram.client import (
    AsyncClient,
    CallTimeoutError,
    Client,
    ClientClosedError,
    ServiceUnreachableError,
)
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.engine import Engine

from .proxies import Proxy
from .service_harness import on_processes

pytestmark = [pytest.mark.xdist_group("service")]

GUARD_S = 60  # a wait not over by then hangs: a failure, not a wait


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[str, str, Engine, Path]]:
    """The service, whose env ``gated`` opens only once the file ``go`` exists."""
    go = tmp_path / "go"
    setup = [["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done"]]
    spec = EnvSpec(name="gated", image="unused", memory_gb=0.1, setup=setup)
    with on_processes(PoolConfig(envs={"gated": EnvConfig(spec=spec)}), tmp_path) as served:
        yield (*served, go)


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        while not check():
            await asyncio.sleep(0.01)


def _opened(engine: Engine) -> Callable[[], bool]:
    return lambda: bool(engine.trajectories)


GiveUp = Callable[[AsyncClient, str, Engine], Awaitable[BaseException]]


async def _cancelled(c: AsyncClient, token: str, engine: Engine) -> BaseException:
    task = asyncio.ensure_future(c.open("gated"))
    await _until(_opened(engine))
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    return caught.value


async def _timed_out_around_the_trajectory(
    c: AsyncClient, token: str, engine: Engine
) -> BaseException:
    limits: list[asyncio.Timeout] = []

    async def enter() -> None:
        async with asyncio.timeout(None) as limit:
            limits.append(limit)
            async with c.trajectory("gated"):
                raise AssertionError("entered a trajectory whose open never ended")

    task = asyncio.ensure_future(enter())
    await _until(_opened(engine))
    limits[0].reschedule(asyncio.get_running_loop().time())  # its deadline: now
    with pytest.raises(TimeoutError) as caught:
        await task
    return caught.value


async def _past_timeout_s(c: AsyncClient, token: str, engine: Engine) -> BaseException:
    async with AsyncClient(c.url, token, timeout_s=1.0) as short:
        with pytest.raises(CallTimeoutError) as caught:
            await short.open("gated")  # (its environment cannot be made before the go)
    assert engine.trajectories  # it reached the service
    return caught.value


async def _closed_client(c: AsyncClient, token: str, engine: Engine) -> BaseException:
    task = asyncio.ensure_future(c.open("gated"))
    await _until(_opened(engine))
    await c.aclose()
    with pytest.raises(ClientClosedError) as caught:
        await task
    return caught.value


async def _shut_down_sync_client(c: AsyncClient, token: str, engine: Engine) -> BaseException:
    sync = Client(c.url, token)
    got: list[BaseException] = []

    def opening() -> None:
        try:
            with sync.trajectory("gated"):
                raise AssertionError("entered a trajectory whose open never ended")
        except BaseException as e:
            got.append(e)

    waiter = threading.Thread(target=opening, daemon=True)
    waiter.start()
    await _until(_opened(engine))
    await asyncio.to_thread(sync.shutdown)
    await asyncio.to_thread(waiter.join, GUARD_S)
    assert len(got) == 1 and isinstance(got[0], ClientClosedError), got
    return got[0]


@pytest.mark.parametrize(
    "give_up",
    [
        _cancelled,
        _timed_out_around_the_trajectory,
        _past_timeout_s,
        _closed_client,
        _shut_down_sync_client,
    ],
    ids=["cancelled", "asyncio.timeout", "timeout_s", "aclose", "shutdown"],
)
def test_an_open_given_up_closes_the_trajectory_it_opened(
    gated: tuple[str, str, Engine, Path], give_up: GiveUp
) -> None:
    url, token, engine, go = gated

    async def main() -> None:
        c = AsyncClient(url, token)
        try:
            raised = await give_up(c, token, engine)
        finally:
            await c.aclose()
        if isinstance(raised, CallTimeoutError):  # it says what became of the trajectory
            said = str(raised)
            assert "open('gated')" in said and "timeout_s=1 s" in said
            assert "which it was opening, is closed once made" in said
        go.touch()  # its environment is made now: then closed
        await _until(lambda: not engine.trajectories)
        assert engine.state.metrics.closed.labels(engine.config.name)._value.get() == 1

    asyncio.run(main())


def test_a_close_by_a_key_no_open_came_with_refuses_that_open_later(
    gated: tuple[str, str, Engine, Path],
) -> None:
    """The close can come first (the open went on another connection); a key of any
    characters, as a cancel by key takes it."""
    url, token, engine, _ = gated
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=auth, timeout=GUARD_S) as http:
        closed = http.delete("/v1/trajectories/key:rollout-3%2Fopen%3F%23")
        assert closed.status_code == 404, closed.text
        assert closed.json()["error"]["details"][0]["field"] == "idempotency_key"
        late = http.post(
            "/v1/trajectories", json={"env": "gated", "idempotency_key": "rollout-3/open?#"}
        )
        assert late.status_code == 409 and "given up" in late.text, late.text
    assert not engine.trajectories


def test_an_open_whose_every_answer_was_lost_closes_what_it_opened(
    gated: tuple[str, str, Engine, Path],
) -> None:
    """Each try reached the service, which opened the trajectory (the same one: the same
    key), and each answer was cut off: the trajectory stayed open, its environment and
    memory held, until its idle timeout."""
    url, token, engine, go = gated
    go.touch()  # (made at once: the open answers)

    async def main() -> None:
        async with Proxy(url) as proxy:
            proxy.cut_after, proxy.cuts = 1, 2  # each try's answer; not the close's
            async with AsyncClient(proxy.url, token, retries=1, backoff_s=0.01) as c:
                with pytest.raises(ServiceUnreachableError) as caught:
                    await asyncio.wait_for(c.open("gated"), GUARD_S)
        assert caught.value.maybe_sent and proxy.cut == 2
        (note,) = caught.value.__notes__
        assert note.startswith("open('gated') may have reached the service: trajectory ")
        assert note.endswith(", which it opened, was closed")
        await _until(lambda: not engine.trajectories)
        assert engine.state.metrics.closed.labels(engine.config.name)._value.get() == 1

    asyncio.run(main())
