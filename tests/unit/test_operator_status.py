"""The operator's pure status functions: conditions, pool readiness, member references."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram.api.resources import ActionPool, TrajectoryEnv
from tangram.api.status import Condition, condition, parse_conditions, ready
from tangram.api.wire import PoolFigures, ProblemFigure
from tangram.cli.manifests import load_documents
from tangram.operator.status import (
    PoolObservation,
    invalid_member_status,
    last_figures,
    member_status,
    pool_status,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
T0, T1 = "2026-11-21T08:00:00Z", "2026-11-21T08:05:00Z"


def _coding() -> tuple[ActionPool, TrajectoryEnv]:
    resources = load_documents([EXAMPLES / "coding" / "pool.yaml"])
    pool = next(iter(resources.pools.values()))
    env = next(iter(resources.envs.values()))
    return pool, env


def _figures(**changes: object) -> PoolFigures:
    base: dict[str, object] = dict(
        pool="coding", epoch="e1", accepting=True, draining=False, nodes=2, cores=120,
        cores_in_use=7, gpus=0, gpus_in_use=0, queue_depth=3, running=5, trajectories=9,
        apis={}, environments=1,
    )  # fmt: skip
    return PoolFigures.model_validate({**base, **changes})


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = condition([], type="Ready", status="False", reason="NoNodes", message="a",
                      generation=1, now=T0)  # fmt: skip
    same = condition(first, type="Ready", status="False", reason="SchedulerUnreachable",
                     message="b", generation=2, now=T1)  # fmt: skip
    assert same[0].last_transition_time == T0 and same[0].reason == "SchedulerUnreachable"
    flipped = condition(same, type="Ready", status="True", reason="Ready", message="c",
                        generation=2, now=T1)  # fmt: skip
    assert len(flipped) == 1 and flipped[0].last_transition_time == T1
    assert flipped[0].observed_generation == 2


def test_unparseable_conditions_are_dropped() -> None:
    raw = [{"type": "Ready"}, Condition(type="Ready", status="True", reason="Ready",
           last_transition_time=T0).model_dump(by_alias=True)]  # fmt: skip
    assert [c.status for c in parse_conditions(raw)] == ["True"]
    assert parse_conditions("garbage") == []


@pytest.mark.parametrize(
    ("seen", "reason"),
    [
        (dict(scheduler_available=False), "SchedulerUnavailable"),
        (dict(scheduler_available=True, unreachable="refused"), "SchedulerUnreachable"),
        (dict(scheduler_available=True, figures=_figures(nodes=0)), "NoNodes"),
        # As a cluster shows it: /readyz fails while no agent is connected, so the pod is
        # not available; the Service publishes it anyway and the figures come back.
        (dict(scheduler_available=False, figures=_figures(nodes=0)), "NoNodes"),
        (dict(scheduler_available=True, figures=_figures()), "Ready"),
        # An agent roll on a one-node pool: its only agent stopping, the next not joined.
        (
            dict(scheduler_available=False, figures=_figures(nodes=1, stopping=1)),
            "AgentsStopping",
        ),
        (dict(scheduler_available=True, figures=_figures(nodes=2, stopping=1)), "Ready"),
        (dict(scheduler_available=False, figures=_figures()), "Ready"),  # answering: it runs
        (dict(deleting=True, figures=_figures(), drain_left_s=42.4), "Draining"),
        (dict(deleting=True, unreachable="no route", drain_left_s=42.4), "Draining"),
        (
            dict(scheduler_available=True, figures=_figures(), refused="apis[x]: no Secret"),
            "ConfigRefused",
        ),
    ],
)
def test_pool_ready_reasons(seen: dict[str, object], reason: str) -> None:
    pool, _ = _coding()
    obs = PoolObservation(generation=3, previous=[], endpoint="http://x", **seen)  # type: ignore[arg-type]
    status = pool_status(pool, obs, T0)
    cond = ready(status.conditions)
    assert cond is not None and cond.reason == reason
    assert cond.status == ("True" if reason == "Ready" else "False")
    assert status.observed_generation == 3 and cond.observed_generation == 3
    if reason == "SchedulerUnreachable":
        assert cond.message == "refused"
    if reason == "NoNodes":  # (its DaemonSet's status not read: both usual causes)
        assert cond.message == (
            "no node agent connected (DaemonSet tangram-coding-cpu-agent: check "
            "spec.cpu.nodeSelector, and its events for agent pods that could not be created "
            "(Pod Security admission, a ResourceQuota))"
        )
    if reason == "Draining" and obs.figures is not None:
        assert "9 trajectories still open" in cond.message and "42 s" in cond.message
    if reason == "Draining" and obs.figures is None:  # restarting: it is waited for
        assert "waiting for its scheduler (no route)" in cond.message and "42 s" in cond.message
    if reason == "AgentsStopping":
        assert cond.message.startswith("every node agent connected (1) is stopping")
    if reason == "ConfigRefused":
        assert cond.message.endswith("runs the ones before: apis[x]: no Secret")
        assert status.nodes == 2  # the figures of what it runs


def test_without_the_schedulers_figures_the_last_ones_stand() -> None:
    """A scheduler restarting mid-drain: its status must keep saying trajectories are
    open, or the drain's next pass (which reads it) would end at once."""
    pool, _ = _coding()
    shown = PoolObservation(generation=1, previous=[], endpoint="http://e",
                            scheduler_available=True, figures=_figures())  # fmt: skip
    stored = pool_status(pool, shown, T0).model_dump(by_alias=True, mode="json")
    away = PoolObservation(generation=1, previous=[], endpoint="http://e", deleting=True,
                           unreachable="refused", last=last_figures(stored))  # fmt: skip
    status = pool_status(pool, away, T1)
    assert (status.trajectories, status.nodes, status.queue_depth) == (9, 2, 3)
    assert last_figures({"conditions": "garbage"}) == {}


def test_pool_status_copies_the_scheduler_figures() -> None:
    pool, _ = _coding()
    obs = PoolObservation(generation=1, previous=[], endpoint="http://e", scheduler_available=True,
                          figures=_figures(apis={"search": 2}))  # fmt: skip
    status = pool_status(pool, obs, T0).model_dump(by_alias=True)
    assert {k: status[k] for k in ("nodes", "cores", "coresInUse", "queueDepth", "running")} == {
        "nodes": 2, "cores": 120, "coresInUse": 7, "queueDepth": 3, "running": 5,
    }  # fmt: skip
    assert status["apis"] == {"search": 2} and status["endpoint"] == "http://e"


def test_invalid_pool_spec_is_reported() -> None:
    obs = PoolObservation(generation=4, previous=[], endpoint="", invalid="spec.cpu.idleCores: bad")
    cond = ready(pool_status(None, obs, T0).conditions)
    assert cond is not None and (cond.reason, cond.message) == (
        "InvalidSpec",
        "spec.cpu.idleCores: bad",
    )


def test_member_status_names_the_pool_or_why_not() -> None:
    pool, env = _coding()
    ok = member_status(env, pool, [], T0)
    cond = ready(ok.conditions)
    assert cond is not None and cond.status == "True" and ok.pool == "rl/coding"
    missing = ready(member_status(env, None, ok.conditions, T1).conditions)
    assert missing is not None and missing.reason == "PoolNotFound"
    assert missing.last_transition_time == T1
    invalid = member_status(env, None, [], T0, "spec.apis: API names repeat: search")
    cond = ready(invalid.conditions)
    assert cond is not None and cond.status == "False" and cond.reason == "PoolInvalid"
    assert cond.message == "ActionPool rl/coding is invalid: spec.apis: API names repeat: search"
    no_cpu = pool.model_copy(update={"spec": pool.spec.model_copy(update={"cpu": None})})
    cond = ready(member_status(env, no_cpu, [], T0).conditions)
    assert cond is not None and cond.reason == "NoCpuSection"


def test_a_trajectory_envs_own_sandbox_failures_show_beside_its_ready() -> None:
    """Accepted (its pool serves it) and its image nowhere: SandboxesHealthy False with its
    own failures only; True once none is recent; as it was when the figures are unknown."""
    pool, env = _coding()
    problems = [
        ProblemFigure(reason="SandboxEvicted", subject="node n1", count=1,
                      message="evicted", last_s=1),
        ProblemFigure(reason="ImageUnavailable", subject="TrajectoryEnv swe", count=3,
                      message="image ghcr.io/example/swe-env:latest is not on node n1",
                      last_s=5),
        ProblemFigure(reason="SetupFailed", subject="TrajectoryEnv other", count=1,
                      message="exit 1", last_s=9),
    ]  # fmt: skip

    def healthy(conditions: list[Condition]) -> Condition:
        return next(c for c in conditions if c.type == "SandboxesHealthy")

    failing = member_status(env, pool, [], T0, problems=problems)
    cond = ready(failing.conditions)
    assert cond is not None and (cond.status, cond.reason) == ("True", "Accepted")
    said = healthy(failing.conditions)
    assert (said.status, said.reason) == ("False", "ImageUnavailable")
    assert said.message == (
        "ImageUnavailable (TrajectoryEnv swe, 3×): image ghcr.io/example/swe-env:latest is "
        "not on node n1"
    )
    unknown = member_status(env, pool, failing.conditions, T1)
    assert healthy(unknown.conditions) == said
    # Nothing changed, so nothing to patch: the conditions keep their order either way.
    assert unknown.conditions == failing.conditions
    quiet = healthy(member_status(env, pool, failing.conditions, T1, problems=[]).conditions)
    assert (quiet.status, quiet.reason) == ("True", "NoRecentFailures")
    assert quiet.last_transition_time == T1


def test_invalid_member_status() -> None:
    st = invalid_member_status(2, "coding", [], "spec.cpu: min > max", T0)
    cond = ready(st.conditions)
    assert cond is not None and cond.reason == "InvalidSpec" and st.pool == "coding"


def test_agent_pods_not_ready_are_sent_to_where_the_reason_is() -> None:
    """A Pending agent pod (no node with the CPU it requests) has no logs to see: the hint
    said "see their logs and events"."""
    from tangram.operator.status import _agents_hint

    pool, _ = _coding()
    ds = {"desiredNumberScheduled": 1, "currentNumberScheduled": 1, "numberReady": 0}
    said = _agents_hint(pool, "cpu", {"cpu": ds})
    assert "0 of 1 agent pods ready; `kubectl describe pod` of the others says why" in said
    assert "Pending: no node has the CPU or memory they request" in said
