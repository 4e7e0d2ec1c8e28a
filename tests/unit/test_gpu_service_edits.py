"""RewardServices edited, removed or failing to load while calls of them come: the
engine's side of the GPU manager on its own event loop, with a fake GPU worker that
answers as the node agent does (it unloads an edited service before it loads the new
one, and refuses calls of a service it does not hold)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from tangram.api.demand import ChoicesDemand
from tangram.api.wire import (
    ActionResult,
    ActionStatus,
    AgentCall,
    AgentReply,
    AgentRequest,
    AgentServices,
    GpuWorkerInfo,
    ServiceCallRequest,
    ServiceDef,
    ServiceLoad,
    ServiceOutcome,
    ServiceStats,
)
from tangram.service.config import PoolConfig, ServiceConfig
from tangram.service.engine import Engine
from tangram.service.gpu_calls import elastic_call_spec
from tangram.service.records import ActionRecord, EngineError

CALL = ServiceCallRequest(inputs=[1])


class Worker:
    """A GPU node's agent as the engine's ``ask`` reaches it. A sync drops the services
    it no longer names as they were (edited or removed) at once, then loads the others
    once ``loads`` is set (a load fails with ``fail[name]``). A call reaches it once
    ``delivery`` is set, is refused unless it holds the service then, and ends once
    ``running`` is set; its output is the weights of what it ran."""

    def __init__(self) -> None:
        self.held: dict[str, ServiceDef] = {}
        self.fail: dict[str, str] = {}
        self.events: list[str] = []
        self.loads, self.delivery, self.running = asyncio.Event(), asyncio.Event(), asyncio.Event()
        for gate in (self.loads, self.delivery, self.running):
            gate.set()

    async def ask(self, node: str | None, req: AgentRequest) -> AgentReply:
        if isinstance(req, AgentServices):
            wanted = {d.name: d for d in req.services}
            for name in [n for n, d in self.held.items() if wanted.get(n) != d]:
                del self.held[name]
            self.events.append("sync")
            await self.loads.wait()
            loaded: dict[str, ServiceLoad] = {}
            for name, spec in wanted.items():
                if name in self.fail:
                    loaded[name] = ServiceLoad(ok=False, error=f"{name}: {self.fail[name]}")
                else:
                    self.held[name] = spec
                    loaded[name] = ServiceLoad(ok=True, bytes=1 << 20)
            self.events.append("synced")
            return AgentReply(rid=req.rid, ok=True, loaded=loaded)
        assert isinstance(req, AgentCall)
        if req.ahead:  # a restore ahead: nothing to see here
            return AgentReply(rid=req.rid, ok=True, call=_outcome(req.service, []))
        self.events.append(f"call {req.service}")
        await self.delivery.wait()
        held = self.held.get(req.service)
        if held is None:
            error = f"service {req.service}: not defined on this node"
            return AgentReply(rid=req.rid, ok=False, error=error)
        await self.running.wait()
        return AgentReply(rid=req.rid, ok=True, call=_outcome(req.service, [held.weights]))


def _outcome(service: str, outputs: list[Any]) -> ServiceOutcome:
    stats = ServiceStats(service=service, resident=True)
    return ServiceOutcome(outputs=outputs, exec_s=0.0, stats=stats)


def _pool(weights: str = "/v1.pt", gpu_memory_gb: float = 1, **kw: Any) -> PoolConfig:
    """One RewardService, ``judge``, of these weights (``kw``: the rest of its config)."""
    spec = ServiceDef(
        name="judge", entrypoint="m:build", weights=weights, gpu_memory_gb=gpu_memory_gb
    )
    return PoolConfig(services={"judge": ServiceConfig(spec=spec, **kw)})


def _devices(*devices: int) -> GpuWorkerInfo:
    return GpuWorkerInfo(backend="cpu", devices=list(devices),
                         memory_bytes=[2**31] * len(devices), h2d_gbps=1)  # fmt: skip


async def _until(check: Callable[[], bool]) -> None:
    """Let the engine's tasks run until ``check`` holds (a bounded number of loop turns)."""
    for _ in range(10_000):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


@asynccontextmanager
async def _engine(config: PoolConfig, worker: Worker, clock: Any = None) -> Any:
    """An engine whose GPU node ``g`` (one device) is ``worker``."""
    e = Engine(config) if clock is None else Engine(config, clock=clock)
    e.state.ask = worker.ask  # type: ignore[method-assign]
    await e.start()
    try:
        e.gpu.join("g", _devices(0))
        yield e
    finally:
        await e.stop(grace_s=0)


async def _result(rec: ActionRecord) -> ActionResult:
    """``rec``'s result, once the engine's tasks have given it (a bounded number of turns)."""
    await _until(rec.done.done)
    return rec.done.result()


async def _settled(e: Engine) -> None:
    """Until a round has seen what was just done (the rounds consume their wake-up)."""
    await _until(lambda: not e.state.wake.is_set())


def test_a_call_sent_while_an_edited_service_reloads_waits_for_it() -> None:
    async def scenario() -> None:
        worker = Worker()
        async with _engine(_pool("/v1.pt"), worker) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            first = await _result(e.submit_service("u", "judge", CALL))
            assert first.status is ActionStatus.OK and first.output == ["/v1.pt"]
            worker.loads.clear()  # the worker takes its time to load the new weights
            e.reconfigure(_pool("/v2.pt"))
            rec = e.submit_service("u", "judge", CALL)  # not refused: it waits
            await _until(lambda: worker.events[-1] == "sync")
            await _settled(e)
            assert rec.id in e.core.stranded and rec.started is None
            worker.loads.set()
            result = await _result(rec)
            assert result.status is ActionStatus.OK, result.error
            assert result.output == ["/v2.pt"]
            assert worker.events[-3:] == ["sync", "synced", "call judge"]

    asyncio.run(scenario())


def test_a_call_the_worker_refused_for_an_edit_under_way_may_be_retried() -> None:
    """A call placed before the edit that reaches the worker after it dropped the old
    definition: refused there, retryable here (its retry runs on the new one)."""

    async def scenario() -> None:
        worker = Worker()
        async with _engine(_pool("/v1.pt"), worker) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            worker.delivery.clear()
            rec = e.submit_service("u", "judge", CALL)
            await _until(lambda: worker.events[-1:] == ["call judge"])
            worker.loads.clear()
            e.reconfigure(_pool("/v2.pt"))
            await _until(lambda: worker.events[-1] == "sync")  # v1 dropped, v2 loading
            worker.delivery.set()
            result = await _result(rec)
            assert result.status is ActionStatus.ERROR and result.error is not None
            assert result.error.retryable and "judge was edited" in result.error.message
            worker.loads.set()
            await _until(lambda: worker.events[-1] == "synced")
            again = await _result(e.submit_service("u", "judge", CALL))
            assert again.status is ActionStatus.OK and again.output == ["/v2.pt"]

    asyncio.run(scenario())


def test_a_service_no_node_can_load_is_a_conflict_once_every_node_said_so() -> None:
    async def scenario() -> None:
        worker = Worker()
        worker.fail["judge"] = "gpuMemoryGiB 99 is more than any GPU here has"
        worker.loads.clear()
        async with _engine(_pool(), worker) as e:
            with pytest.raises(EngineError) as loading:  # no answer yet: try again
                e.submit_service("u", "judge", CALL)
            assert loading.value.kind == "unavailable"
            worker.loads.set()
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            with pytest.raises(EngineError) as never:  # it never will, until an edit
                e.submit_service("u", "judge", CALL)
            assert never.value.kind == "conflict" and never.value.field == "service"
            assert "cannot load on any GPU node" in never.value.message
            assert "gpuMemoryGiB 99" in never.value.message

    asyncio.run(scenario())


def test_calls_waiting_for_an_edit_that_no_node_can_load_end_with_its_error() -> None:
    async def scenario() -> None:
        worker = Worker()
        async with _engine(_pool("/v1.pt"), worker) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            worker.loads.clear()
            worker.fail["judge"] = "bad entry point"
            e.reconfigure(_pool("/v2.pt"))
            rec = e.submit_service("u", "judge", CALL)  # still loading: it waits
            await _settled(e)
            worker.loads.set()
            result = await _result(rec)
            assert result.status is ActionStatus.REJECTED and result.error is not None
            assert not result.error.retryable
            assert "cannot load on any GPU node" in result.error.message
            assert "bad entry point" in result.error.message
            assert "call judge" not in worker.events
            with pytest.raises(EngineError) as later:
                e.submit_service("u", "judge", CALL)
            assert later.value.kind == "conflict"

    asyncio.run(scenario())


def test_a_removed_service_fails_its_queued_calls_and_leaves_with_its_last() -> None:
    """... the scheduler's bookkeeping and its metrics."""

    async def scenario() -> None:
        worker = Worker()
        async with _engine(_pool(), worker) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            first = await _result(e.submit_service("u", "judge", CALL))
            assert first.status is ActionStatus.OK  # a series of judge's metrics
            worker.running.clear()
            running = e.submit_service("u", "judge", CALL)
            await _until(lambda: worker.events.count("call judge") == 2)
            queued = e.submit_service("u", "judge", CALL)  # behind it on the one GPU
            await _settled(e)
            e.reconfigure(PoolConfig())
            result = await _result(queued)
            assert result.status is ActionStatus.REJECTED and result.error is not None
            assert not result.error.retryable
            assert "RewardService judge was removed from the pool" in result.error.message
            assert "judge" in e.core.services  # its call still runs
            assert 'service="judge"' in e.metrics.scrape().decode()  # and so it stays
            worker.running.set()
            ran = await _result(running)
            assert ran.status is ActionStatus.OK and ran.output == ["/v1.pt"]
            assert "judge" not in e.core.services and not e.core.gpu.resident
            assert worker.events.count("call judge") == 2
            # Its series leave with it (they were exported for ever).
            assert 'service="judge"' not in e.metrics.scrape().decode()

    asyncio.run(scenario())


def test_a_call_gets_the_dop_that_fits_though_only_another_is_profiled() -> None:
    """dopChoices [1, 2] profiled at 2 only, on a pool of one GPU: DoP 1, learned online."""

    async def scenario() -> None:
        worker = Worker()
        async with _engine(_pool(dop_choices=(1, 2), profiles=((2, 0.5, None),)), worker) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            rec = e.submit_service("u", "judge", CALL)
            assert e.core.actions[rec.id].gpu == (1,)
            result = await _result(rec)
            assert result.status is ActionStatus.OK and result.allocation is not None
            assert result.allocation.gpus == [0]

    asyncio.run(scenario())


def _dops(fits: set[int], *profiled: int) -> tuple[Any, float | None]:
    """The DoPs a call of a service with dopChoices [1, 2, 4] is offered, and its t1, when
    ``fits`` fit the pool and ``profiled`` have a profile."""
    spec = ServiceDef(name="t", entrypoint="m:f", weights="w", gpu_memory_gb=1)
    cfg = ServiceConfig(
        spec=spec, dop_choices=(1, 2, 4), profiles=tuple((k, 1.0 / k, None) for k in profiled)
    )
    call = elastic_call_spec(cfg, ServiceCallRequest(inputs=[0]), fits=lambda k: k in fits)
    return call.gpu, call.t1_s


def test_the_dops_that_cannot_fit_go_before_the_unprofiled_ones() -> None:
    assert _dops({1}, 2) == (ChoicesDemand(choices=[1]), None)  # learned online
    assert _dops({1, 2}, 2, 4) == (ChoicesDemand(choices=[2]), 0.5)
    assert _dops({1, 2}, 2) == (ChoicesDemand(choices=[2]), 0.5)
    assert _dops({1, 2, 4}, 4) == (ChoicesDemand(choices=[4]), 0.25)
    # None fits: the DoPs it would have had, for the core to refuse by name.
    assert _dops(set(), 2) == (ChoicesDemand(choices=[2]), 0.5)


def test_a_call_cancelled_while_it_runs_counts_its_time_as_its_run() -> None:
    """Its time was its run's (it was on the GPU), not overhead: as for a timeout."""

    async def scenario() -> None:
        worker, now = Worker(), [100.0]
        async with _engine(_pool(), worker, clock=lambda: now[0]) as e:
            await _until(lambda: "judge" in e.gpu.loads.get("g", {}))
            worker.running.clear()
            rec = e.submit_service("u", "judge", CALL)
            await _until(lambda: worker.events[-1:] == ["call judge"])
            now[0] += 1.5
            assert e.cancel("u", rec.id)
            result = await _result(rec)
            assert result.status is ActionStatus.CANCELLED
            assert result.timings.exec_s == 1.5 and result.timings.overhead_s == 0.0
            worker.running.set()

    asyncio.run(scenario())


def test_the_gpu_memory_gauge_reads_as_the_sizes_declared() -> None:
    """Two instances of 0.1 and 0.2 GiB on one GPU hold 0.3 GiB, not 0.30000000000000004."""

    async def scenario() -> None:
        spec = ServiceDef(name="critic", entrypoint="m:build", weights="/c.pt", gpu_memory_gb=0.2)
        config = _pool(gpu_memory_gb=0.1)
        config.services["critic"] = ServiceConfig(spec=spec)
        async with _engine(config, Worker()) as e:
            await _until(lambda: "critic" in e.gpu.loads.get("g", {}))
            e.core.sync_resident("g", [("judge", 0, 1), ("critic", 0, 1)])
            assert e.live().gpu_memory_gb == {("g", 0): 0.3}
            assert 'gpu="0",node="g",pool="default"} 0.3\n' in e.metrics.scrape().decode()

    asyncio.run(scenario())
