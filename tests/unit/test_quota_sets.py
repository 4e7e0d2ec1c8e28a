"""Leases and calls that hold units of several API quotas at once (a step that calls two
rate-limited APIs): granted together, given back together, waiting by the pool's
``quotaWaiting`` rule, and held again after a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.learned import LearnedLease
from tangram.api.wire import ActionStatus, ApiLeaseRequest
from tangram.scheduler import SchedulerConfig
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedFile
from tangram.service.records import EngineError

from .helpers import settle


def _engine(waiting: str = "hold") -> Engine:
    apis = (ApiSpec(name="search", concurrency=2), ApiSpec(name="pdf", concurrency=1))
    return Engine(PoolConfig(apis=apis, scheduling=SchedulerConfig(quota_waiting=waiting)))  # type: ignore[arg-type]


def _lease(**quotas: int) -> ApiLeaseRequest:
    return ApiLeaseRequest(hold_s=600, quotas=quotas)


def test_a_lease_of_two_quotas_holds_and_gives_back_both() -> None:
    async def go() -> None:
        e = _engine()
        await e.start()
        try:
            both = await e.lease_api("u", "search", _lease(pdf=1)).done
            assert both.lease is not None
            assert (e.core.quotas["search"].in_use, e.core.quotas["pdf"].in_use) == (1, 1)
            pdf = e.lease_api("u", "pdf", _lease())
            assert not await settle(pdf.done.done)  # its one unit is held
            assert e.release("u", both.lease).status is ActionStatus.OK
            assert (await pdf.done).lease is not None
            assert e.core.quotas["search"].in_use == 0
        finally:
            await e.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize(("waiting", "passes"), [("hold", False), ("pass", True)])
def test_a_single_quota_lease_waits_behind_a_two_quota_one_only_under_hold(
    waiting: str, passes: bool
) -> None:
    """pdf is held; a lease of search + pdf waits for it. Under ``hold`` (the paper's
    FCFS reservation) a search lease behind it waits too; under ``pass`` it is granted."""

    async def go() -> None:
        e = _engine(waiting)
        await e.start()
        try:
            held = await e.lease_api("u", "pdf", _lease()).done
            both = e.lease_api("u", "search", _lease(pdf=1))
            single = e.lease_api("u", "search", _lease())
            assert await settle(single.done.done) is passes
            assert not both.done.done()
            assert held.lease is not None
            e.release("u", held.lease)
            assert (await both.done).lease is not None
            assert (await single.done).lease is not None
        finally:
            await e.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_lease_naming_its_own_or_an_unknown_quota_is_refused_naming_quotas() -> None:
    e = _engine()
    for quotas, words in (({"search": 1}, "whose units are this request's own"),
                          ({"maps": 1}, "unknown API quota 'maps'")):  # fmt: skip
        with pytest.raises(EngineError) as refused:
            e.api.spec("search", _lease(**quotas))
        assert (refused.value.field, refused.value.kind) == ("quotas", "invalid")
        assert words in refused.value.message

    async def over() -> EngineError:
        with pytest.raises(EngineError) as too_many:  # more than the quota ever has
            e.lease_api("u", "search", _lease(pdf=2))
        return too_many.value

    error = asyncio.run(over())
    assert error.field == "quotas" and "exceed its limit of 1" in error.message


def test_a_lease_of_two_quotas_is_held_again_after_a_restart(tmp_path: Path) -> None:
    store = LearnedFile(tmp_path / "learned.json")

    async def go() -> None:
        first = _engine()
        first.keep_learned(store)
        await first.start()
        held = await first.lease_api("u", "search", _lease(pdf=1)).done
        await first.stop(grace_s=0)
        second = _engine()
        second.keep_learned(store)
        await second.start()
        try:
            assert (second.core.quotas["search"].in_use, second.core.quotas["pdf"].in_use) == (
                1,
                1,
            )
            assert held.lease is not None
            second.release("u", held.lease)
            assert second.core.quotas["pdf"].in_use == 0
        finally:
            await second.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_lease_of_one_quota_is_saved_as_an_earlier_release_reads_it() -> None:
    """Its ``quotas`` is left out when empty: a scheduler before the field refuses it."""
    lease = LearnedLease(lease="l-1", tenant="u", api="search", units=1, started_at=1.0,
                         hold_s=60)  # fmt: skip
    assert "quotas" not in lease.model_dump_json()
    two = lease.model_copy(update={"quotas": {"pdf": 1}})
    assert LearnedLease.model_validate_json(two.model_dump_json()).quotas == {"pdf": 1}
