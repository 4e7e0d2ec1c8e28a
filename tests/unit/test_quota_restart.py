"""API quotas across a scheduler restart: a lease its client still holds stays held (its
units are not granted twice; its release and its key's retry work), and a rate window
does not reopen. Both go in the learned state's document, saved at the stop (and every
30 s), read back at the start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from tangram.api.cluster import ApiSpec
from tangram.api.learned import MAX_STARTS, LearnedLease, LearnedState
from tangram.api.wire import ActionStatus, ApiLeaseRequest
from tangram.scheduler import Scheduler, SchedulerConfig
from tangram.scheduler.core.config import SchedulingError
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedFile, read_state, write_state

from .helpers import api_call, cluster, settle

HOUR = 3600.0


def _engine(
    store: LearnedFile, limits: dict[str, float], wall: Callable[[], float] = time.time
) -> Engine:
    """A pool of one quota, ``search`` (``limits``: its ApiSpec's), keeping its state in
    ``store``; ``wall``: its unix clock."""
    engine = Engine(PoolConfig(apis=(ApiSpec.model_validate({"name": "search", **limits}),)))
    engine.state.wall = wall
    engine.keep_learned(store)
    return engine


def _lease(key: str | None = None) -> ApiLeaseRequest:
    return ApiLeaseRequest(hold_s=600, idempotency_key=key)


def test_a_lease_held_across_a_restart_stays_held_until_released(tmp_path: Path) -> None:
    """A concurrency-1 quota: the first scheduler grants its unit and stops (a pod's
    restart); its client goes on using the lease. The next one does not grant the unit
    again; a retry of the lease's key gets the same lease; its release, by its id, frees
    the unit for the next waiter."""
    store = LearnedFile(tmp_path / "learned.json")

    async def go() -> None:
        first = _engine(store, {"concurrency": 1})
        await first.start()
        held = await first.lease_api("u", "search", _lease("k1")).done
        assert held.lease is not None
        await first.stop(grace_s=0)
        second = _engine(store, {"concurrency": 1})
        await second.start()
        try:
            assert second.core.quotas["search"].in_use == 1
            waiting = second.lease_api("v", "search", _lease())
            assert not await settle(waiting.done.done)  # the unit is held
            retry = second.lease_api("u", "search", _lease("k1"))
            assert await settle(retry.done.done)
            assert (await retry.done).lease == held.lease  # the same lease, not a new one
            released = second.release("u", held.lease)
            assert released.status is ActionStatus.OK
            assert (await waiting.done).lease not in (None, held.lease)
        finally:
            await second.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_rate_window_does_not_reopen_with_a_restart(tmp_path: Path) -> None:
    """2 starts a minute: both spent (and their leases given back) before the restart,
    the next scheduler grants no third within that minute."""
    store = LearnedFile(tmp_path / "learned.json")
    rate = {"rate_per_s": 2 / 60, "period_s": 60.0}

    async def go() -> None:
        first = _engine(store, rate)
        await first.start()
        for _ in range(2):
            lease = (await first.lease_api("u", "search", _lease()).done).lease
            assert lease is not None
            first.release("u", lease)
        await first.stop(grace_s=0)
        assert '"leases"' not in store.path.read_text()  # none held
        second = _engine(store, rate)
        await second.start()
        try:
            third = second.lease_api("u", "search", _lease())
            assert not await settle(third.done.done)
            assert len(second.core.quotas["search"].starts) == 2
        finally:
            await second.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_lease_held_across_a_restart_counts_its_start_once(tmp_path: Path) -> None:
    """3 starts a minute: one lease held, one given back, before the restart; after it,
    one more start is allowed in that minute, not none."""
    store = LearnedFile(tmp_path / "learned.json")
    rate = {"rate_per_s": 3 / 60, "period_s": 60.0}

    async def go() -> None:
        first = _engine(store, rate)
        await first.start()
        held = (await first.lease_api("u", "search", _lease()).done).lease
        given_back = (await first.lease_api("u", "search", _lease()).done).lease
        first.release("u", given_back or "")
        await first.stop(grace_s=0)
        second = _engine(store, rate)
        await second.start()
        try:
            assert second.core.quotas["search"].in_use == 1
            third = second.lease_api("u", "search", _lease())
            assert await settle(third.done.done)
            fourth = second.lease_api("u", "search", _lease())
            assert not await settle(fourth.done.done)
            assert second.release("u", held or "").status is ActionStatus.OK
        finally:
            await second.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_what_ended_while_the_scheduler_was_down_is_not_taken_back(tmp_path: Path) -> None:
    """The next scheduler starts after the lease's hold and the window's period have
    passed (by the unix clock): nothing is held, nothing counted, and the document then
    holds neither, as an earlier release writes it."""
    store = LearnedFile(tmp_path / "learned.json")
    rate = {"concurrency": 1, "rate_per_s": 1 / 60, "period_s": 60.0}

    async def go() -> None:
        first = _engine(store, rate)
        await first.start()
        assert (await first.lease_api("u", "search", _lease("k1")).done).lease
        await first.stop(grace_s=0)
        saved = read_state(store)
        assert saved is not None and len(saved.leases) == 1 and len(saved.windows["search"]) == 1
        second = _engine(store, rate, wall=lambda: time.time() + HOUR)
        await second.start()
        try:
            assert second.core.quotas["search"].in_use == 0
            assert second.core.windows(second.state.clock()) == {}
            fresh = second.lease_api("u", "search", _lease())
            assert (await fresh.done).lease
            second.release("u", (await fresh.done).lease or "")
        finally:
            await second.stop(grace_s=0)
        text = store.path.read_text()
        assert '"leases"' not in text and '"windows"' in text  # (the new start counts)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_the_document_leaves_out_what_is_empty_and_bounds_what_is_not(tmp_path: Path) -> None:
    store = LearnedFile(tmp_path / "learned.json")
    write_state(store, LearnedState())
    assert set(store.path.read_text().split('"')) & {"closing", "leases", "windows"} == set()
    held = LearnedLease(lease="l-1", tenant="u", api="search", units=2, started_at=1e9,
                        hold_s=300, key="k", digest="d")  # fmt: skip
    kept = LearnedState(leases=[held], windows={"search": [1e9, 1e9 + 1]})
    write_state(store, kept)
    assert read_state(store) == kept
    with pytest.raises(ValidationError, match=f"windows: more than {MAX_STARTS} starts"):
        LearnedState(windows={"search": [1e9] * (MAX_STARTS + 1)})


def test_the_core_holds_granted_units_again_and_counts_earlier_starts() -> None:
    """Pure: a lease granted by an earlier scheduler is held again whatever room its quota
    has (it was granted within it) without counting its start twice; the window counts
    the earlier starts it is given, and lets the next start when the oldest expires."""
    s = Scheduler(
        cluster(apis=[{"name": "search", "concurrency": 1, "rate_per_s": 0.1, "period_s": 20}]),
        SchedulerConfig(),
    )
    s.open_trajectory("t")
    s.resume_windows({"search": [95.0, 99.0], "gone": [99.0]})
    with pytest.raises(SchedulingError, match="no room"):  # (as a new one: the window is full)
        s.adopt("x", "t", api_call("search"), units=1, started_at=100.0)
    s.adopt("held", "t", api_call("search"), units=1, started_at=99.0, granted=True)
    quota = s.quotas["search"]
    assert (quota.in_use, list(quota.starts)) == (1, [95.0, 99.0])
    assert s.windows(100.0) == {"search": [95.0, 99.0]}
    s.complete("held", 101.0)
    s.submit("next", "t", api_call("search"), 101.0)
    assert not s.schedule(101.0).assignments  # the window is full until 95 + 20
    rnd = s.schedule(115.0)
    assert [a.action_id for a in rnd.assignments] == ["next"]
    assert s.windows(115.0) == {"search": [99.0, 115.0]}


def test_what_a_document_holds_beyond_the_quota_or_the_clock_is_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Leases over the quota's (new) concurrency are not held again, the oldest kept; a
    lease or a start dated ahead of this scheduler's clock (another host's clock, an
    edited document) counts from now: a lease holds at most its hold_s from here, and a
    start blocks the window for at most one period."""
    store, now = LearnedFile(tmp_path / "learned.json"), time.time()

    def held(lease: str, units: int, at: float) -> LearnedLease:
        return LearnedLease(lease=lease, tenant="u", api="search", units=units,
                            started_at=at, hold_s=600)  # fmt: skip

    async def go(leases: list[LearnedLease], windows: dict[str, list[float]],
                 limits: dict[str, float]) -> Engine:  # fmt: skip
        write_state(store, LearnedState(leases=leases, windows=windows))
        engine = _engine(store, limits)
        await engine.start()
        return engine

    async def check() -> None:
        over = [held("l-1", 2, now - 3), held("l-2", 2, now - 2), held("l-3", 2, now - 1)]
        engine = await go(over, {}, {"concurrency": 3})
        try:
            assert set(engine.state.leases) == {"l-1"}  # the oldest, within 3
            assert engine.core.quotas["search"].in_use == 2
        finally:
            await engine.stop(grace_s=0)
        assert "lease l-2 of search is not held again" in caplog.text

        ahead = now + 30 * 86400.0
        limits = {"concurrency": 2, "rate_per_s": 1 / 60, "period_s": 60.0}
        engine = await go([held("l-9", 1, ahead)], {"search": [now + 10 * 365 * 86400.0]}, limits)
        try:
            clock = engine.state.clock()
            rec = engine.state.actions[engine.state.leases["l-9"]]
            assert rec.started is not None and rec.started <= clock
            assert rec.expiry is not None
            assert rec.expiry.when() - asyncio.get_running_loop().time() <= 600
            assert engine.core.quotas["search"].next_expiry_s(clock) is not None
            assert engine.core.quotas["search"].next_expiry_s(clock) <= clock + 60  # type: ignore[operator]
        finally:
            await engine.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(check(), 30))
