"""The service engine on its own event loop, without HTTP or agents."""

from __future__ import annotations

import asyncio

import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.wire import ActionStatus, ApiLeaseRequest, ExecRequest
from tangram.service import engine as engine_module
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine, EngineError


def test_idempotency_keys_are_bounded_and_in_flight_ones_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module, "MAX_KEYS", 3)

    async def scenario() -> None:
        e = Engine(PoolConfig(apis=(ApiSpec(name="search", concurrency=1),)))
        await e.start()
        try:
            for i in range(10):
                rec = e.lease_api("t", "search", ApiLeaseRequest(idempotency_key=f"k{i}"))
                result = await rec.done
                assert result.status is ActionStatus.OK and result.lease
                e.release("t", result.lease)
            assert len(e.idempotent) == 3
            assert set(e.idempotent) == {("t", "k7"), ("t", "k8"), ("t", "k9")}
            assert e.leases == {}
            with pytest.raises(EngineError, match="idempotency_key"):
                e.submit_exec("t", "x", ExecRequest(argv=["true"], idempotency_key="k9"))
        finally:
            await e.stop(grace_s=0)

    asyncio.run(scenario())


def test_an_efficiency_table_is_not_cached_but_still_accepted() -> None:
    from tangram.api.demand import RangeDemand, TableEfficiency
    from tangram.api.wire import EnvSpec
    from tangram.service.config import EnvConfig

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    e_config = PoolConfig(envs={"e": env})

    async def scenario() -> None:
        e = Engine(e_config)
        req = ExecRequest(
            argv=["true"],
            cpu=RangeDemand(min=1, max=2),
            t1_s=1.0,
            efficiency=TableEfficiency(table={1: 1.0, 2: 0.9}),
        )
        argv, spec = e._exec_spec(env, req)
        assert argv == ["true"] and spec.efficiency is not None
        assert e._specs == {}

    asyncio.run(scenario())
