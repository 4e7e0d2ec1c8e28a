"""The trace generator: determinism, wire validity and the workload statistics it promises.

The statistics are those of docs/trace-generator.md (workload shape, never speed-ups). Large
batches are generated once per module so the file stays fast.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest

from tangram.api.action import ActionKind
from tangram.api.demand import AmdahlEfficiency, RangeDemand, TableEfficiency, duration
from tangram.api.trace import TrajectoryTrace, load_trace
from tangram.scheduler.core.scheduler import Scheduler
from tangram.sim.tracegen import (
    JUDGE,
    LogNormal,
    generate,
    restore_seconds,
    scenario_cluster,
    service_efficiency,
)

SCENARIOS = ("coding", "deepsearch", "mopd", "mixed")


def _lines(trajs: list[TrajectoryTrace]) -> list[str]:
    return [t.model_dump_json(exclude_none=True) for t in trajs]


@pytest.fixture(scope="module")
def coding() -> list[TrajectoryTrace]:
    # Independent draws (no GRPO groups) so that 2000 trajectories are 2000 samples.
    return generate("coding", 2000, seed=1, group_size=1)


@pytest.fixture(scope="module")
def deepsearch() -> list[TrajectoryTrace]:
    return generate("deepsearch", 600, seed=2)


@pytest.fixture(scope="module")
def mopd() -> list[TrajectoryTrace]:
    return generate("mopd", 1200, seed=3, group_size=1)


# --- Determinism and wire format --------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_same_seed_gives_identical_lines(scenario: str) -> None:
    assert _lines(generate(scenario, 40, seed=7)) == _lines(generate(scenario, 40, seed=7))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_different_seed_gives_different_lines(scenario: str) -> None:
    assert _lines(generate(scenario, 40, seed=7)) != _lines(generate(scenario, 40, seed=8))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_line_round_trips_through_load_trace(scenario: str) -> None:
    trajs = generate(scenario, 150, seed=11)
    assert load_trace(_lines(trajs)) == trajs
    assert len({t.id for t in trajs}) == len(trajs)
    for t in trajs:
        assert t.version == 1
        assert t.id.startswith(f"{t.task}-")
        assert t.memory_gb >= 0
        assert t.steps


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scheduler_accepts_every_action_on_the_scenario_cluster(scenario: str) -> None:
    sched = Scheduler(scenario_cluster(scenario))
    for t in generate(scenario, 30, seed=5):
        sched.open_trajectory(t.id, t.memory_gb)
        for i, step in enumerate(t.steps):
            sched.submit(f"{t.id}/{i}", t.id, step.action, 0.0)


# --- coding -----------------------------------------------------------------------------------


def test_coding_busy_fraction_matches_the_paper(coding: list[TrajectoryTrace]) -> None:
    # [T] §2.3: the environment is busy 47% of a trajectory's life, on average; computed as
    # the note defines it: DoP 1, no queueing, busy = sum(t1) / (sum(t1) + sum(think)).
    busy = [_busy_s(t) / (_busy_s(t) + sum(s.think_s for s in t.steps)) for t in coding]
    assert float(np.mean(busy)) == pytest.approx(0.47, abs=0.02)


def test_coding_is_short_shell_actions_then_one_elastic_reward(
    coding: list[TrajectoryTrace],
) -> None:
    shells: list[float] = []
    for t in coding:
        *head, last = (s.action for s in t.steps)
        assert len(t.steps) >= 2
        for a in head:
            assert (a.kind, a.type, a.cpu, a.efficiency) == (
                ActionKind.EXEC,
                "coding.shell",
                1,
                None,
            )
            assert a.t1_s is not None
            shells.append(a.t1_s)
        assert (last.kind, last.type) == (ActionKind.EXEC, "coding.reward")
        assert last.cpu == RangeDemand(min=1, max=32)
        assert isinstance(last.efficiency, AmdahlEfficiency)
        assert 0.85 <= last.efficiency.amdahl <= 0.98
        assert last.elastic_key() == "cpu"
    assert float(np.mean(shells)) == pytest.approx(0.42, abs=0.05)  # [P] Table 3
    assert min(shells) >= 0.001  # [T] §2.4 "down to 1ms"


def test_coding_prompt_groups_share_the_test_suite() -> None:
    trajs = generate("coding", 48, seed=4)  # three GRPO groups of 16
    rewards = [(t.steps[-1].action.t1_s, t.memory_gb) for t in trajs]
    assert [len(set(rewards[g : g + 16])) for g in (0, 16, 32)] == [1, 1, 1]
    assert len(set(rewards)) == 3


# --- deepsearch -------------------------------------------------------------------------------


def test_deepsearch_uses_the_cluster_quotas_and_ends_with_the_judge(
    deepsearch: list[TrajectoryTrace],
) -> None:
    cluster = scenario_cluster("deepsearch")
    apis = {a.name for a in cluster.apis}
    assert [s.name for s in cluster.services] == [JUDGE]
    pdf = 0
    calls = 0
    for t in deepsearch:
        *head, last = (s.action for s in t.steps)
        assert head
        for a in head:
            assert a.kind is ActionKind.API
            assert a.api in apis
            assert set(a.quotas) <= apis
            pdf += bool(a.quotas)
            calls += 1
        assert (last.kind, last.service, last.type) == (ActionKind.SERVICE, JUDGE, "search.judge")
        assert isinstance(last.efficiency, TableEfficiency)
        assert last.gpu is None  # DoP choices come from the service
    assert pdf / calls == pytest.approx(0.2, abs=0.02)


# --- mopd and mixed ---------------------------------------------------------------------------


def test_mopd_calls_only_teachers_the_cluster_serves(mopd: list[TrajectoryTrace]) -> None:
    cluster = scenario_cluster("mopd")
    services = {s.name for s in cluster.services}
    apis = {a.name for a in cluster.apis}
    assert len(services) == 9
    calls: Counter[str] = Counter()
    for t in mopd:
        last = t.steps[-1].action
        assert (last.kind, last.type) == (ActionKind.SERVICE, "mopd.teacher")
        assert last.service in services
        calls[last.service] += 1
        for step in t.steps[:-1]:
            a = step.action
            assert a.kind is ActionKind.API or a.type == "coding.shell"
            assert a.api is None or a.api in apis
            assert set(a.quotas) <= apis
    assert calls.most_common(1)[0][0] == "teacher-1"  # Zipf: rank 1 is the busiest
    single = sum(len(t.steps) == 1 for t in mopd) / len(mopd)
    assert single == pytest.approx(0.4, abs=0.05)
    # Exec steps need memory on a CPU node; the cluster has those nodes.
    assert any(n.cpus for n in cluster.nodes)


def test_mixed_runs_mopd_and_deepsearch_on_one_cluster() -> None:
    trajs = generate("mixed", 200, seed=9)
    cluster = scenario_cluster("mixed")
    assert Counter(t.task for t in trajs) == {"mopd": 100, "deepsearch": 100}
    assert {t.arrival_s for t in trajs if t.task == "mopd"} == {0.0}
    offsets = {t.arrival_s for t in trajs if t.task == "deepsearch"}
    assert len(offsets) == 1  # one RL step: the whole DeepSearch batch arrives together
    assert offsets.pop() > 0
    names = {s.name for s in cluster.services}
    assert len(names) == 10
    assert JUDGE in names
    assert {t.steps[-1].action.service for t in trajs} <= names


# --- GPU service models -----------------------------------------------------------------------


def test_service_efficiency_prefers_tp8_only_at_long_context() -> None:
    short, long = service_efficiency(5), service_efficiency(40)
    assert short.table[4] / short.table[8] == pytest.approx(1.31, abs=1e-3)  # [E] §3.2
    assert long.table[8] / long.table[4] == pytest.approx(1.05, abs=1e-3)


def test_restore_cost_is_the_note_model_at_every_dop() -> None:
    # Note §1.6: restore(m) = 1 s + (weights / m) / 25 GB/s.
    for svc in scenario_cluster("mixed").services:
        for m in svc.dop_choices:
            assert svc.restore_cost(m) == pytest.approx(
                1.0 + svc.gpu_memory_gb / m / 25.0, abs=1e-3
            )
    assert restore_seconds(64.0) == pytest.approx(2.56)


# --- Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "overrides", "names"),
    [
        (("chess", 10, 0), {}, "scenario"),
        (("coding", 0, 0), {}, "trajectories"),
        (("coding", -3, 0), {}, "trajectories"),
        (("coding", 10, -1), {}, "seed"),
        (("coding", 10, 0), {"no_such": 1}, "no_such"),
        (("coding", 10, 0), {"group_size": 0}, "group_size"),
        (("coding", 10, 0), {"group_size": 2.5}, "group_size"),
        (("coding", 10, 0), {"think_s": 5.0}, "think_s"),
        (("coding", 10, 0), {"think_s": LogNormal(-1.0, 0.7)}, "think_s: median"),
        (("coding", 10, 0), {"shell_s": LogNormal(1.0, -0.1)}, "shell_s: sigma"),
        (("deepsearch", 10, 0), {"judge_s": LogNormal(1.0, 0.1, 5, 1)}, "judge_s: lo"),
        (("mopd", 10, 0), {"teacher_s": LogNormal(0.0, 0.3)}, "teacher_s: median"),
        (("deepsearch", 10, 0), {"pdf_fraction": 1.5}, "pdf_fraction"),
        (("mopd", 10, 0), {"teachers": 12}, "teachers"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(
    args: tuple[str, int, int], overrides: dict[str, Any], names: str
) -> None:
    with pytest.raises(ValueError, match=names):
        generate(*args, **overrides)


def test_overrides_change_the_parameters() -> None:
    trajs = generate("coding", 20, seed=0, think_s=LogNormal(1.0, 0.1), reward_max_cpu=8)
    assert all(s.think_s < 2 for t in trajs for s in t.steps)
    assert all(t.steps[-1].action.cpu == RangeDemand(min=1, max=8) for t in trajs)


def test_unknown_cluster_scenario_raises() -> None:
    with pytest.raises(ValueError, match="scenario"):
        scenario_cluster("chess")


def _busy_s(t: TrajectoryTrace) -> float:
    return sum(s.action.t1_s or 0.0 for s in t.steps)


@pytest.mark.parametrize(("scenario", "n"), [("coding", 1280), ("deepsearch", 2048)])
def test_invocations_vary_by_about_three_orders_of_magnitude(scenario: str, n: int) -> None:
    # [T] §2.3 (Fig. 3d): "the number of invocations varies up to three orders of magnitude".
    # Nothing is tuned for it: submissions of an unqueued replay, counted per 10 s window.
    times = []
    for t in generate(scenario, n, 0):
        now = t.arrival_s
        for step in t.steps:
            now += step.think_s
            times.append(now)
            a = step.action
            now += duration(a.t1_s or 1.0, a.efficiency, 1)
    counts = np.bincount((np.array(times) // 10).astype(int))
    busy = counts[counts > 0]
    assert busy.max() / busy.min() >= 500


def test_the_restore_cost_can_be_a_measured_one() -> None:
    # One H200 restored at 44.4 GB/s with a few ms of set-up (docs/benchmarks.md).
    for svc in scenario_cluster("mixed", restore_gbps=44.4, restore_fixed_s=0.1).services:
        for m in svc.dop_choices:
            assert svc.restore_cost(m) == pytest.approx(
                0.1 + svc.gpu_memory_gb / m / 44.4, abs=1e-3
            )


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"restore_gbps": 0.0}, "restore_gbps"),
        ({"restore_gbps": -25.0}, "restore_gbps"),
        ({"restore_gbps": math.inf}, "restore_gbps"),
        ({"restore_gbps": math.nan}, "restore_gbps"),
        ({"restore_fixed_s": -1.0}, "restore_fixed_s"),
        ({"restore_fixed_s": math.nan}, "restore_fixed_s"),
    ],
)
def test_a_restore_cost_that_is_no_cost_is_refused_naming_it(
    given: dict[str, float], named: str
) -> None:
    restore = {"restore_gbps": 25.0, "restore_fixed_s": 1.0, **given}
    with pytest.raises(ValueError, match=named):
        scenario_cluster(
            "mopd", restore_gbps=restore["restore_gbps"], restore_fixed_s=restore["restore_fixed_s"]
        )
