"""Service calls sharing a running instance (``ServiceSpec.max_calls``), as an inference
server batches them: who joins, when a chunk of its own is better, and what a waiting call
is owed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.api.action import ActionSpec
from tangram.api.cluster import ApiSpec, ServiceSpec
from tangram.scheduler import Scheduler
from tangram.scheduler.core.config import SchedulerConfig, SchedulingError
from tangram.scheduler.core.gpu_pool import Chunk, Instance
from tangram.scheduler.core.resource import GPU

from .helpers import cluster, service_call, started


def batching(gpus: int = 1, restore_s: float = 2.0, ahead: bool = False, **svc: Any) -> Scheduler:
    """``gpus`` GPUs, service ``a``: one GPU per call, up to 3 calls an instance, each
    call in flight slowing a joiner by 10 %; trajectory ``t`` open. Restores ahead only
    with ``ahead``: these tests are about who joins whom."""
    spec = {
        "name": "a",
        "gpu_memory_gb": 10,
        "dop_choices": [1],
        "restore_s": restore_s,
        "max_calls": 3,
        "batch_slowdown": 0.1,
        **svc,
    }
    s = Scheduler(
        cluster(nodes=[{"name": "g", "gpus": gpus, "gpu_memory_gb": 80}], services=[spec]),
        SchedulerConfig(restore_ahead=ahead),
    )
    s.open_trajectory("t")
    return s


def test_calls_join_a_running_instance_up_to_max_calls_and_the_rest_wait() -> None:
    s = batching()
    for i in range(5):
        s.submit(f"x{i}", "t", service_call("a", t1=1.0), 0.0)
    first = s.schedule(0.0)
    # The first restores the instance; the round says to run another at once, where the
    # next two join it (a plan joins only instances that run).
    assert [a.action_id for a in first.assignments] == ["x0"] and first.again
    r = s.schedule(0.0)
    assert not r.again
    got = {a.action_id: (a.chunk, a.sharing, a.restore) for a in first.assignments + r.assignments}
    gpu0 = Chunk("g", 0, 1)
    assert got == {"x0": (gpu0, 0, True), "x1": (gpu0, 1, False), "x2": (gpu0, 2, False)}
    expected = {a.action_id: a.expected_s for a in first.assignments + r.assignments}
    # The joiners wait for the 2 s restore, then run slowed by the calls before them.
    assert expected == pytest.approx({"x0": 3.0, "x1": 2.0 + 1.1, "x2": 2.0 + 1.2})
    assert "x3" in dict(r.blocked) and s.queued == 2
    # One call ends: one waiting call takes its place, with two calls already in flight.
    s.complete("x1", 1.1)
    (joined,) = s.schedule(1.1).assignments
    assert (joined.action_id, joined.chunk, joined.sharing) == ("x3", gpu0, 2)
    # The chunk is held until the instance's last call ends.
    for aid in ("x0", "x2"):
        s.complete(aid, 3.0)
    assert s.gpu.chunk_counts() == (0, 0, 0, 0)
    s.complete("x3", 3.0)
    assert s.gpu.chunk_counts() == (1, 0, 0, 0) and not s.gpu.busy


def test_a_call_takes_a_warm_chunk_of_its_own_but_joins_rather_than_restore() -> None:
    cold = batching(gpus=2, restore_s=2.0)
    cold.submit("x0", "t", service_call("a"), 0.0)
    cold.schedule(0.0)
    cold.submit("x1", "t", service_call("a"), 0.5)
    (asg,) = cold.schedule(0.5).assignments
    # GPU 1 is free but cold: 1 s + a 2 s restore there, against the 1.5 s left of the
    # restore on GPU 0 and 1.1 s there.
    assert (asg.chunk, asg.sharing, asg.restore) == (Chunk("g", 0, 1), 1, False)
    assert asg.expected_s == pytest.approx(1.5 + 1.1)

    warm = batching(gpus=2, restore_s=0.0)
    warm.submit("x0", "t", service_call("a"), 0.0)
    warm.schedule(0.0)
    warm.submit("x1", "t", service_call("a"), 0.5)
    (asg,) = warm.schedule(0.5).assignments
    # Nothing to restore: 1 s alone on GPU 1 beats 1.1 s shared.
    assert (asg.chunk, asg.sharing) == (Chunk("g", 1, 1), 0)


def test_a_call_lands_on_an_instance_restored_ahead_and_waits_for_the_rest() -> None:
    s = batching(gpus=2, restore_s=2.0, ahead=True)
    s.submit("x0", "t", service_call("a"), 0.0)
    r = s.schedule(0.0)
    # x0 restores a on GPU 0; the round restores a ahead on GPU 1, which is free and has
    # the memory free, for the next call (done at 2 s).
    (ahead,) = r.ahead
    assert (ahead.service, ahead.chunk, ahead.ready_at) == ("a", Chunk("g", 1, 1), 2.0)
    assert s.gpu.warm_at("a", 1) == 2.0  # the DP adds what is left, not a whole restore
    s.submit("x1", "t", service_call("a"), 0.5)
    (asg,) = s.schedule(0.5).assignments
    # 1.5 s left of the restore ahead + 1 s alone on GPU 1 beats joining x0 on GPU 0
    # (1.5 s left of its restore + 1.1 s shared); no restore of its own.
    assert (asg.chunk, asg.sharing, asg.restore) == (Chunk("g", 1, 1), 0, False)
    assert asg.ready_in_s == pytest.approx(1.5)
    assert asg.expected_s == pytest.approx(1.5 + 1.0)
    # Its restore ahead ends while it waits: the instance stays, and stays after the call.
    s.ahead_done("a", Chunk("g", 1, 1))
    s.complete("x1", 2.5)
    assert Instance("a", Chunk("g", 1, 1)) in s.gpu.resident and not s.gpu.ahead


def test_no_restore_ahead_without_calls_or_with_the_instance_warm() -> None:
    s = batching(gpus=2, restore_s=2.0, ahead=True)
    assert s.schedule(0.0).ahead == ()  # nothing queued or running: nothing is wanted
    s.submit("x0", "t", service_call("a"), 0.0)
    (first,) = s.schedule(0.0).ahead
    s.ahead_done("a", first.chunk)
    s.submit("x1", "t", service_call("a"), 0.1)
    # x1 takes the instance restored ahead (it beats joining); with both GPUs running a,
    # no free chunk is left to restore into.
    r = s.schedule(0.1)
    assert [a.chunk for a in r.assignments] == [first.chunk] and r.ahead == ()


def test_a_failed_restore_ahead_frees_its_memory() -> None:
    s = batching(gpus=2, restore_s=2.0, ahead=True)
    s.submit("x0", "t", service_call("a"), 0.0)
    (ahead,) = s.schedule(0.0).ahead
    s.ahead_done("a", ahead.chunk, ok=False)
    assert Instance("a", ahead.chunk) not in s.gpu.resident
    assert s.gpu.nodes["g"].used_gb == [10.0, 0.0]


def test_one_call_per_instance_without_max_calls() -> None:
    s = batching(max_calls=1)
    for i in range(2):
        s.submit(f"x{i}", "t", service_call("a"), 0.0)
    (asg,) = s.schedule(0.0).assignments
    assert asg.action_id == "x0" and asg.sharing == 0


def _one_gpu_two_services(joining: str) -> Scheduler:
    return Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": 1, "gpu_memory_gb": 80}],
            services=[
                {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], "max_calls": 8},
                {"name": "b", "gpu_memory_gb": 10, "dop_choices": [1]},
            ],
        ),
        SchedulerConfig(gpu_joining=joining),  # type: ignore[arg-type]
    )


def test_a_joiner_never_delays_a_call_waiting_for_the_chunk() -> None:
    """``b`` waits for the only GPU, which ``a``'s instance holds until 10 s; under
    "no-delay" later calls of ``a`` may join only if they end by then, so ``b`` starts at
    10 s whatever comes."""
    s = _one_gpu_two_services("no-delay")
    s.open_trajectory("t")
    s.submit("a0", "t", service_call("a", t1=10.0), 0.0)
    s.schedule(0.0)
    s.submit("b0", "t", service_call("b", t1=1.0), 1.0)
    s.submit("long", "t", service_call("a", t1=10.0), 1.0)  # would end at 11 s
    s.submit("short", "t", service_call("a", t1=2.0), 1.0)  # ends at 3 s
    r = s.schedule(1.0)
    assert [a.action_id for a in r.assignments] == ["short"]
    assert "b0" in dict(r.blocked) and set(s.running) == {"a0", "short"}
    s.complete("short", 3.0)
    s.complete("a0", 10.0)
    (b,) = s.schedule(10.0).assignments
    assert b.action_id == "b0"


def test_joiners_keep_the_chunk_from_a_waiting_call_until_it_is_overdue() -> None:
    """Under "until-overdue" (the default) calls of ``a`` join its busy instance past
    ``b`` waiting for the only GPU, and may keep it longer than its calls before, but end
    no later than ``b`` is overdue (after 4 x its 2 s, at 9 s); ``b`` starts when the last
    of them ends. (Under "no-delay" it would start at 2 s, when ``a0`` ends.)"""
    assert SchedulerConfig().gpu_joining == "until-overdue"
    s = _one_gpu_two_services("until-overdue")
    s.open_trajectory("t")
    s.submit("a0", "t", service_call("a", t1=2.0), 0.0)
    s.schedule(0.0)
    s.submit("b0", "t", service_call("b", t1=2.0), 1.0)  # owed the GPU at 9 s
    s.submit("j1", "t", service_call("a", t1=3.0), 1.0)  # ends at 4 s, after a0: joins
    r = s.schedule(1.0)
    assert [a.action_id for a in r.assignments] == ["j1"] and "b0" in dict(r.blocked)
    s.complete("a0", 2.0)
    assert s.schedule(2.0).assignments == ()
    s.submit("j2", "t", service_call("a", t1=4.0), 3.0)  # ends at 7 s
    assert [a.action_id for a in s.schedule(3.0).assignments] == ["j2"]
    s.complete("j1", 4.0)
    s.submit("late", "t", service_call("a", t1=3.5), 6.0)  # would end at 9.5 s: waits
    s.submit("inside", "t", service_call("a", t1=2.0), 6.0)  # ends at 8 s, before 9 s
    r = s.schedule(6.0)
    assert [a.action_id for a in r.assignments] == ["inside"] and "late" not in s.running
    s.complete("j2", 7.0)
    assert s.schedule(7.0).assignments == ()
    s.complete("inside", 8.0)
    (b,) = s.schedule(8.0).assignments
    assert b.action_id == "b0"


@settings(max_examples=80, deadline=None)
@given(
    joiners=st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=20
    ),
    b_at=st.integers(1, 20),
    b_s=st.sampled_from([1, 2, 4]),
    slowdown=st.sampled_from([0.0, 0.1, 0.5]),
    restore_s=st.sampled_from([0.0, 3.0]),
)
def test_a_call_waiting_for_gpus_is_never_starved_by_joiners(
    joiners: list[tuple[int, int]], b_at: int, b_s: int, slowdown: float, restore_s: float
) -> None:
    """Starvation-freedom of "until-overdue", against a brute-force replay: however calls
    of ``a`` keep joining its instance on the only GPU (in halves of a second, slowed by
    the calls they join, after a restore), ``b`` starts by the later of the time it is
    overdue and the end of the calls of ``a`` that came before it (each call taking what
    the scheduler expects of it: a call ahead of ``b`` joins as if it were not there)."""
    config = SchedulerConfig(learn=False)  # durations stay as profiled
    a_spec = {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], "max_calls": 64}
    a_spec |= {"batch_slowdown": slowdown, "restore_s": restore_s}
    s = Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": 1, "gpu_memory_gb": 80}],
            services=[
                a_spec,
                {"name": "b", "gpu_memory_gb": 10, "dop_choices": [1], "restore_s": 0},
            ],
        ),
        config,
    )
    s.open_trajectory("t")
    arrivals = [(0.0, "a-first", "a", 8.0), (b_at / 2, "b", "b", float(b_s))]
    arrivals += [(at / 2, f"a{i}", "a", float(d)) for i, (at, d) in enumerate(joiners)]
    arrivals.sort()
    submitted = {aid: at for at, aid, _, _ in arrivals}
    ends: dict[str, float] = {}
    started_at: dict[str, float] = {}
    expected_end: dict[str, float] = {}
    while arrivals or ends:
        now = min([*ends.values(), *(arrivals[0][:1] if arrivals else ())])
        for aid in [aid for aid, end in ends.items() if end <= now]:
            s.complete(aid, now)
            del ends[aid]
        while arrivals and arrivals[0][0] <= now:
            _, aid, service, d = arrivals.pop(0)
            s.submit(aid, "t", service_call(service, t1=d), now)
        for asg in s.schedule(now).assignments:
            started_at[asg.action_id] = now
            ends[asg.action_id] = expected_end[asg.action_id] = now + asg.expected_s
    before = max(
        # (calls of ``a`` submitted with ``b`` are ahead of it: sorted first)
        (end for aid, end in expected_end.items() if aid != "b" and submitted[aid] <= b_at / 2),
        default=0.0,
    )
    owed = b_at / 2 + config.overdue_after(b_s)
    assert started_at["b"] <= max(owed, before) + 1e-9


def test_an_unknown_gpu_joining_rule_is_refused() -> None:
    with pytest.raises(SchedulingError, match="gpu_joining"):
        SchedulerConfig(gpu_joining="sometimes")  # type: ignore[arg-type]


def test_a_redefined_instance_takes_no_joiners() -> None:
    s = batching()
    s.submit("x0", "t", service_call("a"), 0.0)
    s.schedule(0.0)
    s.set_services(
        [
            ServiceSpec(
                name="a",
                gpu_memory_gb=10,
                dop_choices=[1],
                restore_s=2,
                revision="v2",
                max_calls=3,
                batch_slowdown=0.1,
            )
        ]
    )
    s.submit("x1", "t", service_call("a"), 0.5)
    assert s.schedule(0.5).assignments == ()  # waits: the running instance is the old one
    s.complete("x0", 3.0)
    (fresh,) = s.schedule(3.0).assignments
    assert fresh.restore and fresh.sharing == 0


def test_a_failed_restore_leaves_nothing_resident_after_its_joiners_end() -> None:
    s = batching()
    s.submit("x0", "t", service_call("a"), 0.0)
    s.submit("x1", "t", service_call("a"), 0.0)
    assert s.schedule(0.0).again
    (joined,) = s.schedule(0.0).assignments
    assert joined.sharing == 1
    s.complete("x0", 1.0, ok=False)  # the restore failed: the joiner fails with it
    s.submit("x2", "t", service_call("a"), 1.0)
    assert s.schedule(1.0).assignments == ()  # no joining a broken instance
    s.complete("x1", 1.0, ok=False)
    (again,) = s.schedule(1.0).assignments
    assert again.restore


def test_a_joiner_that_succeeds_after_a_failed_restore_leaves_the_instance_resident() -> None:
    """Its worker restored the instance again for it (it waited for the failed one)."""
    s = batching()
    s.submit("x0", "t", service_call("a"), 0.0)
    s.submit("x1", "t", service_call("a"), 0.0)
    s.schedule(0.0)
    s.schedule(0.0)
    s.complete("x0", 1.0, ok=False)
    s.complete("x1", 4.0)
    s.submit("x2", "t", service_call("a"), 4.0)
    (warm,) = s.schedule(4.0).assignments
    assert not warm.restore and warm.sharing == 0


def _explain(tmp_path: Path, capsys: pytest.CaptureFixture[str], state: dict[str, Any]) -> Any:
    """``tangram explain --json`` of ``state`` (one GPU, service ``a`` and trajectory ``t``
    added): the decision."""
    from tangram.cli.main import main

    a = {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], **state.pop("service")}
    state["cluster"] = {"nodes": [{"name": "g", "gpus": 1, "gpu_memory_gb": 80}], "services": [a]}
    state["trajectories"] = [{"id": "t"}]
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert main(["explain", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


CALL = {"kind": "service", "service": "a", "t1_s": 1.0}


def _queued(n: int, at: float) -> list[dict[str, Any]]:
    return [{"id": f"x{i}", "trajectory": "t", "action": CALL, "submitted_s": at} for i in range(n)]


def test_explain_shows_calls_joining_an_instance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tangram.cli.main import main

    state = {
        "service": {"max_calls": 2, "batch_slowdown": 0.5},
        "now": 0.0,
        "queue": _queued(3, 0.0),
    }
    decision = _explain(tmp_path, capsys, state)
    started = {a["action"]: a["sharing"] for a in decision["assignments"]}
    assert started == {"x0": 0, "x1": 1}
    assert [w["action"] for w in decision["waiting"]] == ["x2"]
    assert main(["explain", str(tmp_path / "state.json")]) == 0
    assert "x1: 1 units on g, GPU 0 (joins an instance running 1 calls)" in (
        capsys.readouterr().out
    )


def test_explain_takes_running_calls_that_share_an_instance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two calls already share the only GPU's instance (room for three): the queued call
    joins them as the third; the fourth waits."""
    run = {"trajectory": "t", "action": CALL, "units": 1}
    running = [
        {"id": "r0", **run, "started_s": 0.0},
        {"id": "r1", **run, "started_s": 0.5, "joins": "r0"},
    ]
    state = {"service": {"max_calls": 3}, "now": 1.0, "running": running, "queue": _queued(2, 1.0)}
    decision = _explain(tmp_path, capsys, state)
    assert {a["action"]: a["sharing"] for a in decision["assignments"]} == {"x0": 2}
    assert [w["action"] for w in decision["waiting"]] == ["x1"]


def test_adopting_a_call_into_an_instance_names_what_is_wrong() -> None:
    s = batching(gpus=2)  # max_calls 3
    s.adopt("r0", "t", service_call("a"), units=1, started_at=0.0)
    s.adopt("r1", "t", service_call("a"), units=1, started_at=0.0, joins="r0")
    assert s.running["r1"].assignment.sharing == 1
    assert s.running["r1"].assignment.chunk == s.running["r0"].assignment.chunk
    # Slowed by the call already there (10 % per call), as a joiner is.
    assert s.running["r1"].assignment.expected_s == pytest.approx(1.1)
    with pytest.raises(SchedulingError, match="joins: nope is not a running call of a"):
        s.adopt("r2", "t", service_call("a"), units=1, started_at=0.0, joins="nope")
    s.adopt("r2", "t", service_call("a"), units=1, started_at=0.0, joins="r1")
    with pytest.raises(SchedulingError, match="joins: the instance of r0 has no room"):
        s.adopt("r3", "t", service_call("a"), units=1, started_at=0.0, joins="r0")
    assert set(s.running) == {"r0", "r1", "r2"} and s.queued == 0  # refusals leave no trace


def test_a_call_is_adopted_on_the_chunk_it_runs_on() -> None:
    """A restarted scheduler adopts a call where its worker runs it, not where a new
    call would go: the chunk is taken, its instance resident, the rest stays free."""
    spec = {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1, 2]}
    s = Scheduler(cluster(nodes=[{"name": "g", "gpus": 8, "gpu_memory_gb": 80}], services=[spec]))
    s.open_trajectory("t")
    asg = s.adopt("r0", "t", service_call("a"), units=2, started_at=0.0, node="g", gpu_start=6)
    assert asg.chunk == Chunk("g", 6, 2) and asg.node == "g"
    assert Instance("a", Chunk("g", 6, 2)) in s.gpu.resident
    assert s.gpu.chunk_counts() == (0, 1, 1, 0)  # 6-7 taken: 0-3 and 4-5 stay free
    for start, units, why in [
        (6, 2, "gpu_start: GPUs \\[6, 7\\] of g are not free"),
        (7, 1, "gpu_start: GPUs \\[7\\] of g are not free"),  # within the taken chunk
        (3, 2, "gpu_start: no chunk of 2 GPUs starts at GPU 3 of g"),  # not aligned
        (8, 1, "gpu_start: no chunk of 1 GPUs starts at GPU 8 of g"),  # past its GPUs
    ]:
        with pytest.raises(SchedulingError, match=why):
            s.adopt("x", "t", service_call("a"), units=units, started_at=0.0, node="g",
                    gpu_start=start)  # fmt: skip
    with pytest.raises(SchedulingError, match="node: 'h' is not a GPU node"):
        s.adopt("x", "t", service_call("a"), units=1, started_at=0.0, node="h", gpu_start=0)
    with pytest.raises(SchedulingError, match="gpu_start: a call joins an instance or takes"):
        s.adopt("x", "t", service_call("a"), units=2, started_at=0.0, node="g", gpu_start=4,
                joins="r0")  # fmt: skip
    assert set(s.running) == {"r0"} and s.gpu.chunk_counts() == (0, 1, 1, 0)  # no trace
    s.adopt("r1", "t", service_call("a"), units=1, started_at=0.0, node="g", gpu_start=5)
    assert s.running["r1"].assignment.chunk == Chunk("g", 5, 1)
    assert s.gpu.chunk_counts() == (1, 0, 1, 0)  # the buddy of GPU 5 stays free


def test_only_a_service_call_joins_an_instance_or_takes_a_chunk() -> None:
    spec = {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], "max_calls": 3}
    s = Scheduler(
        cluster(
            nodes=[{"name": "n", "cpus": 2, "memory_gb": 8, "gpus": 1, "gpu_memory_gb": 80}],
            services=[spec],
        )
    )
    s.open_trajectory("t")
    s.adopt("r0", "t", service_call("a"), units=1, started_at=0.0)
    with pytest.raises(SchedulingError, match="joins: e0 is not a service call"):
        s.adopt("e0", "t", ActionSpec(kind="exec", cpu=1), units=1, started_at=0.0, joins="r0")
    with pytest.raises(SchedulingError, match="gpu_start: e0 is not a service call"):
        s.adopt("e0", "t", ActionSpec(kind="exec", cpu=1), units=1, started_at=0.0, node="n",
                gpu_start=0)  # fmt: skip


def test_a_joined_call_is_not_learned_from() -> None:
    """Its time holds the batch's slowdown and the wait for the restore, not the call."""
    s = batching(restore_s=0.0)
    unprofiled = {"kind": "service", "service": "a"}
    for i in range(2):
        s.submit(f"x{i}", "t", ActionSpec.model_validate(unprofiled), 0.0)
    s.schedule(0.0)
    (joined,) = s.schedule(0.0).assignments
    kind = s.running["x0"].action.type
    s.complete("x1", 3.0)  # slowed by the batch: not what a call of a takes alone
    assert s.book.learned(kind) is None and joined.sharing == 1
    s.complete("x0", 4.0)
    assert s.book.mean_duration(kind) == pytest.approx(4.0)


def test_a_joined_call_counts_no_gpus_against_its_tenants_share() -> None:
    from tangram.scheduler.core.shares import TenantShare

    s = batching(gpus=4)
    s.set_tenants({}, TenantShare(max_share=0.5))  # two of the four GPUs
    s.submit("x0", "t", service_call("a"), 0.0)
    s.schedule(0.0)
    s.submit("x1", "t", service_call("a"), 0.5)
    s.submit("x2", "t", service_call("a"), 0.5)
    r = s.schedule(0.5)  # joining beats restoring on a cold GPU
    assert [(a.action_id, a.sharing) for a in r.assignments] == [("x1", 1), ("x2", 2)]
    # Three calls run on one GPU: the tenant holds one of its two.
    assert s.holdings().of("").get(GPU, 0) == 1


def test_a_tenant_at_its_share_of_gpus_still_joins_a_running_instance() -> None:
    from tangram.scheduler.core.shares import TenantShare

    s = batching(gpus=4)
    s.set_tenants({}, TenantShare(max_share=0.25))  # one of the four GPUs
    s.submit("x0", "t", service_call("a"), 0.0)
    s.schedule(0.0)
    assert s.holdings().of("").get(GPU, 0) == 1  # at its share
    s.submit("x1", "t", service_call("a"), 0.5)
    (joined,) = s.schedule(0.5).assignments  # it takes no GPU of its own
    assert (joined.action_id, joined.sharing) == ("x1", 1)
    assert s.holdings().of("").get(GPU, 0) == 1
    # Once the instance has no room (3 calls), the next waits for the tenant's GPU.
    s.submit("x2", "t", service_call("a"), 0.6)
    s.submit("x3", "t", service_call("a"), 0.6)
    r = s.schedule(0.6)
    assert [a.action_id for a in r.assignments] == ["x2"]
    assert dict(r.blocked)["x3"] == "tenant  at its maxShare"


def test_a_call_wider_than_its_tenants_share_only_ever_joins_an_instance() -> None:
    """An instance of ``a`` takes 2 GPUs, the capped tenant may hold 1: its call is
    accepted (it may join), never starts one, and joins the one another tenant starts."""
    from tangram.scheduler.core.shares import TenantShare

    s = batching(gpus=4, dop_choices=[2])
    s.set_tenants({"capped": TenantShare(max_share=0.25)})
    s.open_trajectory("c", tenant="capped")
    s.submit("x0", "c", service_call("a"), 0.0)  # not refused: it may join
    r = s.schedule(0.0)
    assert not r.assignments and dict(r.blocked)["x0"] == "tenant capped at its maxShare"
    s.submit("y0", "t", service_call("a"), 1.0)  # another tenant's call starts one
    assert [a.action_id for a in s.schedule(1.0).assignments] == ["y0"]
    (joined,) = s.schedule(1.0).assignments
    assert (joined.action_id, joined.sharing) == ("x0", 1)
    assert s.holdings().of("capped").get(GPU, 0) == 0


def test_a_tenant_at_its_share_of_a_quota_joins_nothing() -> None:
    from tangram.scheduler.core.shares import TenantShare

    s = batching(gpus=4)
    s.set_quotas([ApiSpec(name="judge", concurrency=4)])
    s.set_tenants({}, TenantShare(max_share=0.25))  # one GPU, one unit of the quota
    call = ActionSpec.model_validate(
        {"kind": "service", "service": "a", "t1_s": 1.0, "quotas": {"judge": 1}}
    )
    s.submit("x0", "t", call, 0.0)
    s.schedule(0.0)
    s.submit("x1", "t", call, 0.5)
    r = s.schedule(0.5)  # the instance has room, but the tenant's quota unit is taken
    assert not r.assignments
    assert dict(r.blocked)["x1"] == "tenant  at its maxShare"


def held_back(b_at: float) -> Scheduler:
    """Two GPUs: ``a0`` (an instance of ``a``, taking joiners) on one until 6 s, ``c0`` on
    the other until 5.7 s; ``b0``, a call of ``b`` taking 1 s on one GPU and 0.5 s on two,
    queued at ``b_at``. At 5.7 s ``b0`` fits on the freed GPU but is better off waiting
    for both at 6 s (it ends at 6.5 s rather than 6.7 s)."""
    s = Scheduler(
        cluster(
            nodes=[{"name": "g", "gpus": 2, "gpu_memory_gb": 80}],
            services=[
                {"name": "a", "gpu_memory_gb": 10, "dop_choices": [1], "max_calls": 8},
                {"name": "b", "gpu_memory_gb": 10, "dop_choices": [1, 2], "restore_s": 0.0},
                {"name": "c", "gpu_memory_gb": 10, "dop_choices": [1]},
            ],
        )
    )
    s.open_trajectory("t")
    s.submit("a0", "t", service_call("a", t1=6.0), 0.0)
    s.submit("c0", "t", service_call("c", t1=5.7), 0.0)
    assert sorted(started(s, 0.0)) == ["a0", "c0"]
    wide = {"kind": "service", "service": "b", "t1_s": 1.0, "efficiency": {"amdahl": 1.0}}
    s.submit("b0", "t", ActionSpec.model_validate(wide), b_at)
    assert not s.schedule(b_at).assignments
    s.complete("c0", 5.7)
    return s


def test_a_call_held_back_long_is_not_delayed_by_a_joiner_behind_it() -> None:
    """``b0`` has waited 5.7 s, over its ageing bound (4 x its 1 s on one GPU), so a later
    call of ``a`` that would keep ``a``'s GPU past 6 s waits; one that ends by then joins."""
    s = held_back(0.0)
    s.submit("long", "t", service_call("a", t1=20.0), 5.7)  # would end at 25.7 s
    s.submit("short", "t", service_call("a", t1=0.2), 5.7)  # ends at 5.9 s
    r = s.schedule(5.7)
    (group,) = r.groups
    assert group.kept == 0  # b0 waits for two GPUs
    assert [a.action_id for a in r.assignments] == ["short"]
    assert dict(r.blocked)["long"] == "gpu (held for an earlier call)"
    s.complete("short", 5.9)
    s.complete("a0", 6.0)
    assert started(s, 6.0)[0] == "b0"  # at 6 s, not when "long" would have ended (25.7 s)


def test_a_call_held_back_briefly_may_be_passed_by_joiners() -> None:
    """Held back after a short wait (3.7 s, under its 4 s bound), ``b0`` is decided again
    next round: joiners pass it."""
    s = held_back(2.0)
    s.submit("long", "t", service_call("a", t1=20.0), 5.7)
    r = s.schedule(5.7)
    (group,) = r.groups
    assert group.kept == 0 and [a.action_id for a in r.assignments] == ["long"]
