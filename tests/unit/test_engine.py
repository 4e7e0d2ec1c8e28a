"""The service engine on its own event loop, without HTTP or agents."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.demand import ChoicesDemand, duration
from tangram.api.wire import (
    ActionStatus,
    AgentCall,
    AgentCancel,
    AgentExec,
    AgentReply,
    AgentRequest,
    ApiLeaseRequest,
    ExecOutcome,
    ExecRequest,
    GpuWorkerInfo,
    RunningCall,
    ServiceCallRequest,
    ServiceDef,
    ServiceLoad,
    ServiceOutcome,
    ServiceStats,
)
from tangram.cli.up import load_pool
from tangram.scheduler.core.gpu_pool import Chunk
from tangram.service.config import PoolConfig, ServiceConfig
from tangram.service.engine import Engine
from tangram.service.gpu_calls import elastic_call_spec
from tangram.service.keys import request_digest
from tangram.service.records import ActionRecord, EngineError


def test_idempotency_keys_are_bounded_and_in_flight_ones_kept() -> None:
    async def scenario() -> None:
        e = Engine(PoolConfig(apis=(ApiSpec(name="search", concurrency=1),)))
        e.state.idempotent.max_keys = 3
        await e.start()
        try:
            for i in range(10):
                rec = e.lease_api("t", "search", ApiLeaseRequest(idempotency_key=f"k{i}"))
                result = await rec.done
                assert result.status is ActionStatus.OK and result.lease
                e.release("t", result.lease)
            assert len(e.state.idempotent) == 3
            assert e.state.idempotent.keys() == [("t", "k7"), ("t", "k8"), ("t", "k9")]
            assert e.state.leases == {}
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
        argv, spec, _ = e.admission._exec_spec(env, req)
        assert argv == ["true"] and spec.efficiency is not None
        assert e.admission._specs == {}

    asyncio.run(scenario())


def _teacher() -> ServiceConfig:
    return ServiceConfig(
        spec=ServiceDef(name="teacher", entrypoint="m:f", weights="w", gpu_memory_gb=1),
        dop_choices=(1, 2, 4),
        profiles=(
            (1, 1.2, (0, 4095)),
            (1, 3.5, (4096, 32768)),
            (2, 0.7, (0, 4095)),
            (2, 1.9, (4096, 32768)),
        ),
    )


def _judge_pool(**kw: Any) -> PoolConfig:
    """A pool of one RewardService, ``judge`` (``kw``: the rest of its ServiceConfig)."""
    spec = ServiceDef(name="judge", entrypoint="m:build", weights="/w.pt", gpu_memory_gb=1)
    return PoolConfig(services={"judge": ServiceConfig(spec=spec, **kw)})


def _devices(*devices: int) -> GpuWorkerInfo:
    """A GPU worker on these (CPU-backed) device indexes, 2 GiB each."""
    return GpuWorkerInfo(backend="cpu", devices=list(devices),
                         memory_bytes=[2**31] * len(devices), h2d_gbps=1)  # fmt: skip


def _scored(*outputs: float, exec_s: float = 1.0, **stats: Any) -> ServiceOutcome:
    """A judge call's outcome: ``outputs``, the instance resident unless ``stats`` say."""
    found = ServiceStats(**{"service": "judge", "resident": True, **stats})
    return ServiceOutcome(outputs=list(outputs), exec_s=exec_s, stats=found)


def test_a_call_is_estimated_from_the_profiles_of_its_input_size() -> None:
    cfg = _teacher()
    assert cfg.durations(100) == {1: 1.2, 2: 0.7}
    assert cfg.durations(5000) == {1: 3.5, 2: 1.9}
    assert cfg.durations(None) == {1: 3.5, 2: 1.9}  # unknown size: the slowest, to be safe
    assert cfg.durations(90_000) == {1: 3.5, 2: 1.9}  # beyond every range: the nearest
    for size, want in ((100, {1: 1.2, 2: 0.7}), (5000, {1: 3.5, 2: 1.9})):
        spec = elastic_call_spec(cfg, ServiceCallRequest(inputs=[0], input_size=size))
        assert spec.gpu == ChoicesDemand(choices=[1, 2])  # DoP 4 has no profile: not offered
        assert spec.t1_s is not None
        assert {k: duration(spec.t1_s, spec.efficiency, k) for k in want} == pytest.approx(want)


def test_a_call_narrows_its_dop_within_the_services_choices() -> None:
    cfg = _teacher()
    narrowed = elastic_call_spec(cfg, ServiceCallRequest(inputs=[0], gpu=2, input_size=1))
    assert narrowed.gpu == ChoicesDemand(choices=[2])
    # One DoP left: its profiled duration is the estimate, not k times it.
    assert duration(narrowed.t1_s or 0, narrowed.efficiency, 2) == pytest.approx(0.7)
    unprofiled = elastic_call_spec(cfg, ServiceCallRequest(inputs=[0], gpu=4, t1_s=3.0))
    assert unprofiled.gpu == ChoicesDemand(choices=[4]) and unprofiled.t1_s == 3.0
    with pytest.raises(EngineError, match=r"no DoP in \[8\].*dopChoices \[1, 2, 4\]") as e:
        elastic_call_spec(cfg, ServiceCallRequest(inputs=[0], gpu=8))
    assert e.value.field == "gpu"


def test_reward_services_of_the_pool_become_its_service_configs() -> None:
    _, config = load_pool(["manifests/examples/mopd/pool.yaml"], None)
    assert sorted(config.services) == ["code-teacher", "judge", "math-teacher"]
    judge, math = config.services["judge"], config.services["math-teacher"]
    assert judge.spec.replicated and judge.spec.max_batch == 16 and judge.restore_s == 2.5
    assert (judge.max_calls, judge.batch_slowdown) == (8, 0.1)
    assert (math.max_calls, math.batch_slowdown) == (1, 0.0)  # unset: a call has it alone
    assert math.dop_choices == (1, 2) and math.durations(5000) == {1: 3.5, 2: 1.9}
    assert not config.services["code-teacher"].spec.replicated  # parallelism: shard
    assert config.gpus_per_node == 8


def test_the_pools_admission_bounds_reach_the_scheduler(tmp_path: Path) -> None:
    text = Path("manifests/examples/deepsearch/pool.yaml").read_text()
    text = text.replace("maxQueued: 50000", "maxQueued: 50000\n    maxRequestBytes: 4096")
    (tmp_path / "pool.yaml").write_text(text)
    _, config = load_pool([str(tmp_path / "pool.yaml")], "deepsearch")
    assert (config.max_queued, config.max_request_bytes) == (50000, 4096)


# ---- agents that leave and come back --------------------------------------------------
def _agent(trajectories: tuple[str, ...] | list[str] = (), problem: str | None = None) -> Any:
    """What the engine reads of an agent's link: its node and hello."""
    from tangram.api.inventory import NodeInventory
    from tangram.api.wire import AgentHello, Problem, TrajectoryMeta

    inventory = NodeInventory(node_id="n1", hostname="n1", numa=[[0, 1]], memory_gb=8.0,
                              cgroup_version=2)  # fmt: skip
    metas = [TrajectoryMeta(id=t, tenant="u", env="e", labels={}, opened_at=0.0)
             for t in trajectories]  # fmt: skip
    hello = AgentHello(
        node="n1", inventory=inventory, runtime="noop", action_cores=[0], idle_cores=[1],
        trajectories=metas,
        problem=Problem(reason="CPUManagerStatic", message=problem) if problem else None,
    )  # fmt: skip
    return SimpleNamespace(hello=hello, node="n1", leaving=False, answered=set())


def _engine_with_t1(grace_s: float = 120.0) -> Engine:
    from tangram.api.wire import EnvSpec
    from tangram.service.config import EnvConfig
    from tangram.service.records import TrajectoryRecord

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    engine = Engine(PoolConfig(envs={"e": env}, agent_grace_s=grace_s))
    engine.all_agents_joined()
    asyncio.run(engine.membership.join(_agent()))
    engine.core.open_trajectory("t1", 0.1)
    engine.core.place_trajectory("t1", "n1")
    engine.state.add_trajectory(TrajectoryRecord("t1", "u", "e", "n1", {}, 0.0, env))
    return engine


def test_a_trajectory_closed_while_its_agent_is_away_is_not_revived_by_its_return() -> None:
    engine = _engine_with_t1()

    async def go() -> None:
        await engine.membership.leave(_agent())
        assert engine.trajectories["t1"].state.value == "away"
        await engine.close_trajectory("u", "t1")
        await engine.membership.join(_agent(["t1"]))  # the agent hands it back: it is told to close

    closes: list[str] = []

    async def ask(node: str, req: Any) -> Any:
        if req.op != "warm":
            closes.append(f"{req.op} {getattr(req, 'trajectory', None)}")

    engine.state.ask = ask  # type: ignore[method-assign, assignment]
    asyncio.run(go())
    assert "t1" not in engine.trajectories and "t1" not in engine.core.trajectories
    assert closes == ["close t1"]


def test_a_restarted_scheduler_takes_back_a_trajectory_under_its_tenants_id() -> None:
    """Ids are per tenant: a trajectory opened while another tenant held its id runs under
    another key, and the agent's metadata carries both, so a restart keeps them apart."""
    from tangram.api.wire import AgentHello, EnvSpec, TrajectoryMeta
    from tangram.service.config import EnvConfig

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    engine = Engine(PoolConfig(envs={"e": env}))
    engine.all_agents_joined()
    agent = _agent(["x"])  # alice's "x", opened first: its key is its id
    bobs = TrajectoryMeta(id="x.0a1b2c3d", name="x", tenant="bob", env="e")
    hello: AgentHello = agent.hello
    hello.trajectories.append(bobs)
    asyncio.run(engine.membership.join(agent))
    assert engine.trajectory("u", "x").key == "x"
    assert engine.trajectory("bob", "x").key == "x.0a1b2c3d"
    assert engine.trajectory("bob", "x").info().id == "x"
    assert set(engine.core.trajectories) >= {"x", "x.0a1b2c3d"}


def test_an_agent_back_without_an_environment_loses_its_trajectory_at_once() -> None:
    """Found on a real kubelet: a sandbox pod deleted while its agent restarted left its
    trajectory away, every exec a 503 to retry, for the whole grace, and then lost "as its
    agent did not come back", which it had, within seconds."""
    engine = _engine_with_t1(grace_s=120.0)

    async def go() -> None:
        await engine.membership.leave(_agent())
        await engine.membership.join(_agent([]))  # back, without t1's environment

    engine.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]
    asyncio.run(go())
    t1 = engine.trajectories["t1"]
    assert t1.state.value == "lost" and "came back without its environment" in t1.ended


def test_a_lost_trajectory_is_not_counted_as_open() -> None:
    """Counted, it held a pool's deletion for its whole drainSeconds (10 minutes by
    default) though it holds nothing, and the status said "1 trajectories still open"."""
    engine = _engine_with_t1()
    assert engine.figures().trajectories == 1
    engine.lifecycle.lose(engine.trajectories["t1"], "its pod was deleted")
    assert engine.figures().trajectories == 0


def test_the_grace_of_an_earlier_absence_does_not_end_a_later_one() -> None:
    engine = _engine_with_t1(grace_s=0.0)

    async def go() -> str:
        await engine.membership.leave(_agent())
        first = engine.trajectories["t1"].away_since
        await engine.membership.join(_agent(["t1"]))
        await engine.membership.leave(_agent())  # away again: its own grace
        engine.trajectories["t1"].away_since = first + 1.0  # as time passed in between
        await engine.membership.lose_after_grace("n1", ["t1"], first)  # the first absence's timer
        return engine.trajectories["t1"].state.value

    engine.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]
    assert asyncio.run(go()) == "away"


def test_a_refused_node_reconnecting_is_one_failure_not_one_a_reconnect() -> None:
    from tangram.service.agents import NodeRefusedError

    engine = Engine(PoolConfig())

    async def join(message: str) -> None:
        with pytest.raises(NodeRefusedError):
            await engine.membership.join(_agent(problem=message))

    for message in ("static", "static", "static", "static again"):
        asyncio.run(join(message))
    (seen,) = engine.figures().problems
    assert (seen.reason, seen.subject, seen.count) == ("CPUManagerStatic", "node n1", 2)


# ---- per-tenant limits ---------------------------------------------------------------
def test_a_tenants_max_queued_refuses_its_next_action_and_no_one_elses() -> None:
    from tangram.service.config import TenantLimits

    config = PoolConfig(
        apis=(ApiSpec(name="search", concurrency=1),),
        tenants={"flood": TenantLimits(max_queued=2)},
    )

    async def scenario() -> None:
        e = Engine(config)  # not started: nothing leaves the queue
        for _ in range(2):
            e.lease_api("flood", "search", ApiLeaseRequest())
        with pytest.raises(EngineError, match=r"flood has 2 actions waiting.*maxQueued") as err:
            e.lease_api("flood", "search", ApiLeaseRequest())
        assert (err.value.kind, err.value.field) == ("overloaded", "queue")
        e.lease_api("other", "search", ApiLeaseRequest())  # another tenant is not limited
        first = next(a for a, r in e.state.actions.items() if r.tenant == "flood")
        assert e.cancel("flood", first)  # one fewer waiting: room for one more
        e.lease_api("flood", "search", ApiLeaseRequest())
        assert e.core.queued_by_tenant == {"flood": 2, "other": 1}
        await e.stop(grace_s=0)
        assert not e.core.queued_by_tenant  # every one ended unstarted

    asyncio.run(scenario())


def _opening_engine(**pool: Any) -> Engine:
    """An engine of a pool with env "e" (and ``pool``'s other settings) whose agent on "n1",
    once a scenario joins it, opens every environment it is asked to."""
    from tangram.api.wire import AgentReply, EnvSpec
    from tangram.service.config import EnvConfig

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    engine = Engine(PoolConfig(envs={"e": env}, **pool))
    engine.all_agents_joined()

    async def ask(node: str, req: Any) -> AgentReply:
        return AgentReply(rid=1, ok=True, opened_s=0.0)

    engine.state.ask = ask  # type: ignore[method-assign, assignment]
    engine.hub.links["n1"] = _agent()
    return engine


def test_a_tenants_max_trajectories_refuses_its_next_open_until_one_closes() -> None:
    from tangram.api.wire import OpenTrajectory
    from tangram.service.config import ANY_TENANT, TenantLimits

    engine = _opening_engine(tenants={ANY_TENANT: TenantLimits(max_trajectories=2)})

    async def scenario() -> None:
        await engine.membership.join(_agent())
        first = await engine.open_trajectory("u", OpenTrajectory(env="e"))
        await engine.open_trajectory("u", OpenTrajectory(env="e"))
        with pytest.raises(EngineError, match=r"u has 2 trajectories open.*maxTrajectories"):
            await engine.open_trajectory("u", OpenTrajectory(env="e"))
        await engine.open_trajectory("v", OpenTrajectory(env="e"))  # each tenant its own
        await engine.close_trajectory("u", first.id)
        await engine.open_trajectory("u", OpenTrajectory(env="e"))

    asyncio.run(scenario())


def test_an_opens_key_reaches_the_agent_only_when_it_keeps_it() -> None:
    """A restarted scheduler learns an open's key from the agent that holds the trajectory;
    agents of releases before that are not sent the field (they would refuse it)."""
    from tangram.api.wire import OPEN_KEYS_FEATURE, AgentOpen, AgentReply, OpenTrajectory

    engine = _opening_engine()
    metas: list[Any] = []

    async def ask(node: str, req: Any) -> AgentReply:
        if isinstance(req, AgentOpen):
            metas.append(req.meta)
        return AgentReply(rid=1, ok=True, opened_s=0.0)

    engine.state.ask = ask  # type: ignore[method-assign, assignment]

    async def scenario() -> None:
        await engine.membership.join(_agent())
        await engine.open_trajectory("u", OpenTrajectory(env="e", idempotency_key="k1"))
        engine.hub.links["n1"].hello.features.append(OPEN_KEYS_FEATURE)
        await engine.open_trajectory("u", OpenTrajectory(env="e", idempotency_key="k2"))

    asyncio.run(scenario())
    assert [m.open_key for m in metas] == [None, "k2"]
    assert metas[1].open_digest == OpenTrajectory(env="e").digest()


def test_a_clients_expected_steps_reach_the_scheduler_as_its_hint() -> None:
    """The trajectory orderings read it (docs/scheduler.md, Ordering policies)."""
    from tangram.api.wire import OpenTrajectory

    engine = _opening_engine()

    async def scenario() -> None:
        await engine.membership.join(_agent())
        hinted = await engine.open_trajectory("u", OpenTrajectory(env="e", expected_steps=12))
        plain = await engine.open_trajectory("u", OpenTrajectory(env="e"))
        assert engine.core.trajectories[hinted.key].hint_steps == 12
        assert engine.core.trajectories[plain.key].hint_steps is None

    asyncio.run(scenario())


def test_a_key_still_to_be_closed_on_an_agents_return_is_not_given_again() -> None:
    engine = _engine_with_t1()
    free_key = engine.lifecycle.free_key
    assert free_key("t2") == "t2"
    assert free_key("t1") != "t1"  # t1 is open

    async def ask(node: str, req: Any) -> Any:
        raise AssertionError(f"nothing is asked of an absent agent: {req}")

    async def close_while_away() -> None:
        await engine.membership.leave(_agent())
        await engine.close_trajectory("u", "t1")

    engine.state.ask = ask  # type: ignore[method-assign, assignment]
    asyncio.run(close_while_away())
    assert "t1" not in engine.trajectories  # closed, but its environment is still to go
    again = free_key("t1")
    assert again.startswith("t1.") and len(again) == len("t1.") + 8


def test_a_pool_is_ready_without_agents_only_when_nothing_needs_a_node() -> None:
    """API quotas need no node; RewardService calls, like environments, need an agent (a
    pool of services alone used to say ready before its GPU agent was back)."""
    apis_only = Engine(PoolConfig(apis=(ApiSpec(name="search", concurrency=1),)))
    services = Engine(_judge_pool())
    assert apis_only.ready and not services.ready


def test_calls_a_worker_still_runs_are_adopted_where_they_run_and_answer_their_keys() -> None:
    """A GPU node's hello after a restart: calls batched on one instance are adopted into
    it (the oldest takes the chunk, the next joins it) as far as the service's maxCalls
    allows; a call of a service the pool no longer has is not. A retry of an adopted key
    waits for its call, whose reply, sent unasked, answers it."""
    started = [("b", "judge", 1.0), ("a", "judge", 2.0), ("c", "judge", 0.5), ("d", "gone", 3.0)]
    runs = [
        RunningCall(key=f"u\x1f{k}", service=service, gpus=[5], running_s=s)
        for k, service, s in started
    ]
    outcome = _scored(0.25, exec_s=1.5)

    async def scenario() -> None:
        e = Engine(_judge_pool(max_calls=2))
        await e.start()
        try:
            e.gpu.join("g", _devices(4, 5))
            assert e.gpu.adopt("g", runs) == 2  # c: the instance is full; d: no such service
            recs = {r.key: r for r in e.state.actions.values()}
            assert set(recs) == {"a", "b"}
            a, b = (e.core.running[recs[k].id].assignment for k in "ab")
            assert a.chunk == b.chunk == Chunk("g", 1, 1)  # device 5 is the node's GPU 1
            assert (a.sharing, b.sharing) == (0, 1)  # a started first: b joined it
            retry = e.submit_service(
                "u", "judge", ServiceCallRequest(inputs=[1], idempotency_key="a")
            )
            assert retry is recs["a"]  # the adopted call, not a new one
            e.membership.orphan("g", AgentReply(rid=0, ok=True, key="u\x1fa", call=outcome))
            result = await retry.done
            assert result.status is ActionStatus.OK and result.output == [0.25]
            assert recs["a"].id not in e.core.running and recs["b"].id in e.core.running
        finally:
            await e.stop(grace_s=0)

    asyncio.run(scenario())


def test_a_call_answered_by_a_replay_teaches_no_duration_and_no_residency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent answered a call with its key's earlier reply (a retry after the call's
    node left): the call ran nothing now, so the core neither learns its time nor counts
    on the instance it was to restore."""
    replayed: list[bool] = []

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        """The GPU node's agent: it holds judge, and answers each call as told."""
        if not isinstance(req, AgentCall):
            loaded = {"judge": ServiceLoad(ok=True, bytes=1 << 20)}
            return AgentReply(rid=req.rid, ok=True, loaded=loaded)
        outcome = _scored(0.25, exec_s=2.0, resident=False, restore_s=0.5)
        return AgentReply(rid=req.rid, ok=True, call=outcome, replayed=replayed.pop(0))

    async def scenario() -> tuple[list[int], bool]:
        e = Engine(_judge_pool())
        monkeypatch.setattr(e.state, "ask", ask)
        await e.start()
        try:
            e.gpu.join("g", _devices(0))
            while not e.gpu.loads:  # its services synced (in the background)
                await asyncio.sleep(0)
            observed: list[int] = []  # the book's samples of the call's type, after each
            resident_after_replay = True
            for again in (True, False):
                replayed.append(again)
                req = ServiceCallRequest(inputs=[1], idempotency_key=f"k{again}")
                rec = e.submit_service("u", "judge", req)
                assert (await rec.done).status is ActionStatus.OK
                observed.append(e.core.book.version("service:judge"))
                if again:
                    resident_after_replay = bool(e.core.gpu.resident)
            return observed, resident_after_replay
        finally:
            await e.stop(grace_s=0)

    observed, resident = asyncio.run(scenario())
    assert observed[0] == 0 and not resident
    assert observed[1] == 1  # the same call, really run, is learned from


def test_a_queued_exec_keeps_its_profiles_command_and_time_limit_across_a_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a profile gives an exec is taken when it is admitted: a reload that changes
    or drops the profile meanwhile neither fails it (it did: a KeyError at dispatch, an
    internal error) nor runs its command under the new limit."""
    from tangram.service.config import ActionProfile

    engine = _engine_with_t1()
    env = engine.state.config.envs["e"]
    profiled = replace(env, profiles={"tests": ActionProfile(("pytest",), timeout_s=7)})
    engine.reconfigure(replace(engine.state.config, envs={"e": profiled}))
    sent: list[AgentExec] = []

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        assert isinstance(req, AgentExec)
        sent.append(req)
        out = ExecOutcome(exit_code=0, stdout="", stderr="", stdout_truncated=False,
                          stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.1,
                          teardown_s=0.0, path="portable")  # fmt: skip
        return AgentReply(rid=req.rid, ok=True, result=out)

    monkeypatch.setattr(engine.state, "ask", ask)

    async def scenario() -> ActionStatus:
        await engine.start()
        try:
            rec = engine.submit_exec("u", "t1", ExecRequest(profile="tests", args=["-x"]))
            renamed = {"tests-renamed": ActionProfile(("true",), timeout_s=1)}
            engine.reconfigure(replace(engine.state.config,
                                       envs={"e": replace(env, profiles=renamed)}))  # fmt: skip
            return (await rec.done).status
        finally:
            await engine.stop(grace_s=0)

    assert asyncio.run(scenario()) is ActionStatus.OK
    assert [(r.argv, r.timeout_s) for r in sent] == [(["pytest", "-x"], 7.0)]


def test_an_exec_answered_by_a_replay_teaches_no_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a command: a replayed reply says nothing of how long it takes."""
    engine = _engine_with_t1()
    replayed = [True, False]

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        out = ExecOutcome(exit_code=0, stdout="", stderr="", stdout_truncated=False,
                          stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.1,
                          teardown_s=0.0, path="portable")  # fmt: skip
        return AgentReply(rid=req.rid, ok=True, result=out, replayed=replayed.pop(0))

    monkeypatch.setattr(engine.state, "ask", ask)

    async def scenario() -> list[int]:
        await engine.start()
        observed: list[int] = []  # the book's samples of the command's type, after each
        try:
            for key in ("k1", "k2"):
                req = ExecRequest(argv=["true"], idempotency_key=key, type="probe")
                rec = engine.submit_exec("u", "t1", req)
                assert (await rec.done).status is ActionStatus.OK
                observed.append(engine.core.book.version("probe"))
        finally:
            await engine.stop(grace_s=0)
        return observed

    assert asyncio.run(scenario()) == [0, 1]


def test_adoption_holds_the_gpus_of_a_call_whose_key_is_answered_and_keeps_late_answers() -> None:
    """A call still running whose key already has an action here (its answer, kept when
    it timed out) holds its GPUs until it ends but answers nobody; a call that ended while
    no one held it (its node was away) leaves its outputs as its key's answer."""
    outcome = _scored(0.75)

    async def scenario() -> None:
        e = Engine(_judge_pool(dop_choices=(1, 4)))
        await e.start()
        try:
            e.gpu.join("g", _devices(0, 1, 2, 3))
            answered = e.state.record("u", None, "service", ServiceCallRequest(inputs=[1]),
                                      None, target="call of service judge")  # fmt: skip
            e.state.idempotent.remember("u", "old", answered)  # (its answer: ended below)
            e.outcomes.finish(answered, ActionStatus.TIMEOUT)
            held = RunningCall(key="u\x1fold", service="judge", gpus=[0, 1, 2, 3], running_s=9)
            assert e.gpu.adopt("g", [held]) == 1
            (rec,) = e.state.actions.values()
            assert e.core.running[rec.id].assignment.units == 4
            assert e.core.gpu.chunk_counts() == (0, 0, 0, 0)  # its 4 GPUs are held
            e.membership.orphan("g", AgentReply(rid=0, ok=True, key="u\x1fold", call=outcome))
            assert e.core.gpu.chunk_counts() == (0, 0, 1, 0) and not e.state.actions
            kept = e.submit_service(
                "u", "judge", ServiceCallRequest(inputs=[1], idempotency_key="old")
            )
            assert (await kept.done).status is ActionStatus.TIMEOUT  # the key's answer stays
            asked = ServiceCallRequest(inputs=[1], idempotency_key="late")
            late_reply = AgentReply(
                rid=0, ok=True, key="u\x1flate", call=outcome, digest=request_digest(asked)
            )
            e.membership.orphan("g", late_reply)
            late = e.submit_service("u", "judge", asked)
            result = await late.done  # answered at once: nothing queued, nothing run
            assert result.status is ActionStatus.OK and result.output == [0.75]
            assert e.core.queued == 0 and not e.core.running
            with pytest.raises(EngineError) as other:  # its key, with another request
                e.submit_service(
                    "u", "judge", ServiceCallRequest(inputs=[2], idempotency_key="late")
                )
            assert other.value.kind == "conflict", other.value
        finally:
            await e.stop(grace_s=0)

    asyncio.run(scenario())


def _gpu_agent(calls: list[RunningCall], node: str = "g") -> Any:
    """A GPU node's link as the engine reads it: 2 devices, these calls running."""
    from tangram.api.inventory import NodeInventory
    from tangram.api.wire import AgentHello

    inventory = NodeInventory(node_id=node, hostname=node, numa=[[0, 1]], memory_gb=8.0,
                              cgroup_version=2)  # fmt: skip
    hello = AgentHello(node=node, inventory=inventory, runtime="noop", action_cores=[0],
                       idle_cores=[1], gpu=_devices(0, 1), calls=calls)  # fmt: skip
    return SimpleNamespace(hello=hello, node=node, leaving=False, answered=set())


def test_a_cancel_lost_with_its_link_is_sent_again_when_the_call_is_adopted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adopted call is cancelled; its node's link drops before the agent answers, and
    the agent, back, still runs it: adopted again, it is cancelled again (its waiter saw
    node_lost; a retry of its key then gets the cancelled reply)."""
    running = RunningCall(key="u\x1fk", service="judge", gpus=[1], running_s=5.0)
    cancels: list[str | None] = []

    async def ask(node: str | None, req: AgentRequest) -> AgentReply:
        if isinstance(req, AgentCancel):
            cancels.append(req.key)
        return AgentReply(rid=req.rid, ok=True)

    async def scenario() -> None:
        e = Engine(_judge_pool())
        monkeypatch.setattr(e.state, "ask", ask)
        await e.membership.join(_gpu_agent([running]))
        (rec,) = e.state.actions.values()
        assert e.cancel("u", rec.id)
        await asyncio.sleep(0)
        assert cancels == ["u\x1fk"]
        await e.membership.leave(_gpu_agent([]))  # before its reply: the cancel is lost
        assert (await rec.done).error.code == "node_lost"  # type: ignore[union-attr]
        await e.membership.join(_gpu_agent([running]))  # it still runs there
        await asyncio.sleep(0)
        assert cancels == ["u\x1fk", "u\x1fk"]
        (again,) = e.state.actions.values()
        assert again.cancelled and again.agent_key == "u\x1fk"
        e.membership.orphan("g", AgentReply(rid=0, ok=False, key="u\x1fk", error="cancelled"))
        assert (await again.done).status is ActionStatus.CANCELLED
        assert not e.core.running and "u\x1fk" not in e.state.cancelled_keys
        retry = e.submit_service("u", "judge", ServiceCallRequest(inputs=[1], idempotency_key="k"))
        assert (await retry.done).status is ActionStatus.CANCELLED

    asyncio.run(scenario())


def test_an_exec_still_running_under_an_answered_key_holds_its_cores_until_it_ends() -> None:
    """Its key's answer (it was cancelled while its link was down) stays; the run, which
    its agent went on with, holds its cores until its reply comes."""
    from tangram.api.wire import RunningAction

    engine = _engine_with_t1()
    s = engine.state

    async def scenario() -> None:
        answered = s.record("u", "t1", "exec", ExecRequest(argv=["true"]), None,
                            target="exec on t1")  # fmt: skip
        s.idempotent.remember("u", "k", answered)
        engine.outcomes.finish(answered, ActionStatus.CANCELLED)
        await engine.membership.leave(_agent())
        agent = _agent(["t1"])
        agent.hello.running.append(
            RunningAction(key="u\x1fk", trajectory="t1", cores=[0], running_s=2.0)
        )
        await engine.membership.join(agent)
        assert engine.core.cpu.nodes["n1"].free_cores == 0  # its core is held
        out = ExecOutcome(exit_code=0, stdout="", stderr="", stdout_truncated=False,
                          stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=2.0,
                          teardown_s=0.0, path="portable")  # fmt: skip
        engine.membership.orphan("n1", AgentReply(rid=0, ok=True, key="u\x1fk", result=out))
        assert engine.core.cpu.nodes["n1"].free_cores == 1 and not s.actions
        kept = s.idempotent.get("u", "k")
        assert kept is not None and b'"cancelled"' in kept.result  # type: ignore[union-attr]

    engine.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]
    asyncio.run(scenario())


def test_one_key_running_on_two_nodes_is_ended_by_each_nodes_own_reply() -> None:
    """A retry ran a call again on another node while the first ran on (its node was
    away); both nodes hand theirs back: each reply ends its own node's run, and the key
    answers with the first adopted."""
    outcome = _scored(0.5)

    async def scenario() -> None:
        e = Engine(_judge_pool())
        e.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]
        run = RunningCall(key="u\x1fk", service="judge", gpus=[0], running_s=3.0)
        await e.membership.join(_gpu_agent([run], "g1"))
        await e.membership.join(_gpu_agent([run.model_copy(update={"running_s": 1.0})], "g2"))
        by_node = {r.assignment.node: r for r in e.state.actions.values()}  # type: ignore[union-attr]
        assert set(by_node) == {"g1", "g2"}
        e.membership.orphan("g2", AgentReply(rid=0, ok=True, key="u\x1fk", call=outcome))
        assert by_node["g2"].done.done() and not by_node["g1"].done.done()
        assert [r.assignment.node for r in e.core.running.values()] == ["g1"]
        e.membership.orphan("g1", AgentReply(rid=0, ok=True, key="u\x1fk", call=outcome))
        assert (await asyncio.wait_for(by_node["g1"].done, 1)).output == [0.5]
        assert not e.state.actions and not e.core.running and not e.state.adopted

    asyncio.run(scenario())


async def _adopted_after_a_restart(engine: Engine) -> ActionRecord:
    """Its agent away and back (as after a scheduler restart), with a keyed run on t1's
    core that this scheduler adopts: the run's record."""
    from tangram.api.wire import RunningAction

    await engine.membership.leave(_agent())
    agent = _agent(["t1"])
    agent.hello.running.append(
        RunningAction(key="u\x1fk", trajectory="t1", cores=[0], running_s=2.0)
    )
    await engine.membership.join(agent)
    (rec,) = engine.state.actions.values()
    return rec


def test_an_adopted_run_whose_trajectory_ended_still_ends_when_its_node_leaves() -> None:
    """Its cores came back with its trajectory, but its record waited for the reply; the
    node leaving ends it (outcome_unknown: it ran there) and frees its key for a retry,
    instead of keeping both forever."""
    engine = _engine_with_t1()
    engine.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]

    async def scenario() -> None:
        rec = await _adopted_after_a_restart(engine)
        engine.lifecycle.environment_lost("t1", "SandboxExited", "its container exited")
        await engine.membership.leave(_agent())
        result = await asyncio.wait_for(rec.done, 1)
        assert result.error is not None and result.error.code == "outcome_unknown"
        assert ("u", "k") not in engine.state.idempotent and not engine.state.adopted

    asyncio.run(scenario())


def test_an_adopted_run_ended_by_its_node_leaving_leaves_its_trajectorys_running_set() -> None:
    """Every way an action ends takes it out of its trajectory's running set, a node
    leaving included (its adopted runs end there without going back to the core)."""
    engine = _engine_with_t1()
    engine.state.background = lambda work: work.close()  # type: ignore[method-assign, union-attr]

    async def scenario() -> None:
        rec = await _adopted_after_a_restart(engine)
        assert rec.trajectory is not None
        traj = engine.state.trajectories[rec.trajectory]
        assert traj.running == {rec.id}
        await engine.membership.leave(_agent())
        result = await asyncio.wait_for(rec.done, 1)
        assert result.error is not None and result.error.code == "outcome_unknown"
        assert traj.running == set()

    asyncio.run(scenario())


def test_a_background_task_that_fails_is_said_unless_its_agent_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tangram.service.records import EngineError
    from tangram.service.state import _said

    loop = asyncio.new_event_loop()
    try:
        failed, gone = loop.create_future(), loop.create_future()
        failed.set_exception(ValueError("the warm-up could not start"))
        gone.set_exception(EngineError("unavailable", "node", "node n1 has no agent connected"))
        with caplog.at_level(logging.WARNING, logger="tangram.service"):
            _said(failed)
            _said(gone)
    finally:
        loop.close()
    assert [r.getMessage() for r in caplog.records] == [
        "background work failed: ValueError: the warm-up could not start"
    ]


def test_an_open_cut_off_by_its_agent_leaving_leaves_nothing_and_may_be_retried() -> None:
    """The hub fails the open's request and marks the node's trajectories away in one
    step: the open finds its record AWAY, not OPEN, and must still forget it (else it
    would stay, holding memory, and the retry of that id would be a conflict)."""
    from tangram.api.wire import AgentOpen, EnvSpec, OpenTrajectory
    from tangram.service.config import EnvConfig
    from tangram.service.records import EngineError

    env = EnvConfig(spec=EnvSpec(name="e", image="i", memory_gb=0.1))
    engine = Engine(PoolConfig(envs={"e": env}, agent_grace_s=120))
    engine.all_agents_joined()

    async def go() -> tuple[str, bool, bool]:
        await engine.membership.join(_agent())
        pending: asyncio.Future[AgentReply] = asyncio.get_running_loop().create_future()

        async def ask(node: str | None, req: AgentRequest) -> AgentReply:
            if isinstance(req, AgentOpen) and not pending.done():  # (the first try's)
                return await pending
            return AgentReply(rid=0, ok=True, opened_s=0.0)

        engine.state.ask = ask  # type: ignore[method-assign]
        req = OpenTrajectory(env="e", id="mine", idempotency_key="k1")
        opener = asyncio.ensure_future(engine.open_trajectory("u", req))
        await asyncio.sleep(0)
        pending.set_exception(EngineError("unavailable", "node", "node n1: the agent left"))
        await engine.membership.leave(_agent())  # (what the hub does in the same step)
        with pytest.raises(EngineError) as first:
            await opener
        gone = "mine" not in engine.trajectories and "mine" not in engine.core.trajectories
        await engine.membership.join(_agent())  # back, without it
        again = await engine.open_trajectory("u", req)  # the client's retry
        return first.value.kind, gone, again.id == "mine"

    assert asyncio.run(go()) == ("unavailable", True, True)


def test_a_reload_reports_what_only_a_restart_applies_and_keeps_the_running_values() -> None:
    """The agents' core sets are sized when they start and the name keys the learned
    state: a reload that changes them says so, not "no changes", and the config keeps
    what actually runs."""

    async def scenario() -> None:
        e = Engine(PoolConfig(name="a", idle_cores=1))
        changes = e.reconfigure(PoolConfig(name="b", idle_cores=2, cores_per_node=4))
        assert changes == [
            "needs a restart, kept as running: idleCores 1 -> 2, coresPerNode all -> 4, "
            "pool name a -> b"
        ]
        running = e.state.config
        assert (running.name, running.idle_cores, running.cores_per_node) == ("a", 1, None)
        assert e.metrics.pool == "a"
        assert e.reconfigure(PoolConfig(name="a", idle_cores=1)) == []

    asyncio.run(scenario())


def test_a_reload_names_every_setting_it_changed() -> None:
    """A reload that set ``admission.maxQueued`` was applied (the next requests were
    refused at the new bound) but said "no changes"."""

    async def scenario() -> None:
        e = Engine(PoolConfig())
        changed = PoolConfig(max_queued=3, access_namespaces=("rl", "eval"),
                             gpus_per_node=2, agent_grace_s=30.0)  # fmt: skip
        assert e.reconfigure(changed) == [
            "spec.admission.maxQueued 100000 -> 3",
            "spec.access.namespaces [] -> [rl, eval]",
            "spec.gpu.gpusPerNode (nodes joining from now on) unset -> 2",
            "spec.scheduler.agentGraceSeconds 120 -> 30",
        ]
        assert e.state.config.max_queued == 3
        assert e.reconfigure(changed) == []

    asyncio.run(scenario())


def test_agents_are_told_every_env_kept_warm_when_they_join_and_when_envs_change() -> None:
    """The whole set, each time: an agent removes the warm sandboxes of any other env (one
    removed, or set to warm 0, while it ran or while it was away), which would otherwise
    hold their memory on the node for good."""
    from tangram.api.wire import AgentWarm, EnvSpec
    from tangram.service.config import EnvConfig

    def env(name: str, warm: int) -> EnvConfig:
        return EnvConfig(spec=EnvSpec(name=name, image="i", memory_gb=0.1, warm=warm))

    engine = Engine(PoolConfig(envs={"a": env("a", 2), "b": env("b", 0), "c": env("c", 1)}))
    told: list[tuple[str, list[str]]] = []

    async def ask(node: str, req: Any) -> Any:
        if isinstance(req, AgentWarm):
            told.append((node, [e.name for e in req.envs]))

    engine.state.ask = ask  # type: ignore[method-assign, assignment]

    async def scenario() -> None:
        await engine.membership.join(_agent())
        engine.hub.links["n1"] = SimpleNamespace(closed=False)  # type: ignore[assignment]
        await asyncio.sleep(0)
        engine.reconfigure(PoolConfig(envs={"a": env("a", 0), "b": env("b", 0)}))
        await asyncio.sleep(0)
        engine.reconfigure(PoolConfig(envs={"a": env("a", 0), "b": env("b", 0)}, name="x"))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    # Joining: a and c. Then a set to warm 0 and c removed: none. No env change: not told.
    assert told == [("n1", ["a", "c"]), ("n1", [])]
