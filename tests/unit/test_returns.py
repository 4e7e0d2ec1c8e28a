"""The core price's return term: thinking trajectories per node, the learned think time,
each node's queued work, and the price they make (core_price="arrivals")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler import Scheduler, SchedulerConfig, SchedulingError
from tangram.scheduler.core.pricing import return_price
from tangram.scheduler.core.resource import PLACE, Resource
from tangram.scheduler.core.returns import Returns, RunningMean

from .helpers import busy_node, cluster, elastic, exec_action, suite_state

ARRIVALS = SchedulerConfig(core_price="arrivals")


def _nodes(*names: str, cpus: int = 8) -> Scheduler:
    nodes = [{"name": n, "cpus": cpus, "numa_nodes": 1, "memory_gb": 64} for n in names]
    return Scheduler(cluster(nodes=nodes), ARRIVALS)


def test_the_return_term_is_nothing_without_thinking_a_queue_or_a_think_time() -> None:
    assert return_price(0, 5.0, 10.0, 8, 8, offered=1.0) == 0.0
    assert return_price(4, 0.0, 10.0, 8, 8, offered=1.0) == 0.0
    assert return_price(4, 5.0, 0.0, 8, 8, offered=1.0) == 0.0  # nothing learned yet: the load rule
    assert return_price(4, 5.0, 10.0, 8, 0, offered=1.0) == 0.0
    assert return_price(4, 5.0, 10.0, 8, 8, offered=0.0) == 0.0  # nobody would want the cores
    # ρ = 6/8, four thinking, each back before the queue drains in 5 s with 1 - e^(-1/2).
    want = (6 / 8) * 4 * (1 - math.exp(-0.5)) / 8
    assert return_price(4, 5.0, 10.0, 6, 8, offered=1.0) == pytest.approx(want)
    # Found wanted at the offered load, which counts as a chance: at most 1.
    assert return_price(4, 5.0, 10.0, 6, 8, offered=0.25) == pytest.approx(want / 4)
    assert return_price(4, 5.0, 10.0, 6, 8, offered=3.0) == pytest.approx(want)
    # A backlog many think times long: every thinking trajectory is back before it drains.
    assert return_price(4, 1e6, 10.0, 8, 8, offered=1.0) == pytest.approx(4 / 8)


def test_the_offered_load_is_the_share_of_cores_the_placed_trajectories_would_hold() -> None:
    r = Returns()
    assert r.offered_load(10, 8) == 0.0  # nothing learned
    r.asks(2, 3.0)  # 6 core-seconds over 3 s
    assert r.offered_load(10, 8) == 0.0  # no think time yet: no cycle to spread them over
    r.think.observe(9.0)
    # Each of 10 asks for 6 core-seconds every 9 + 3 s: 5 cores of 8.
    assert r.offered_load(10, 8) == pytest.approx(5 / 8)
    assert r.offered_load(0, 8) == 0.0
    assert r.offered_load(10, 0) == 0.0


def test_a_running_mean_is_the_plain_mean_then_exponential() -> None:
    m = RunningMean()
    for x in (10.0, 20.0, 30.0):
        m.observe(x)
    assert m.mean == pytest.approx(20.0)
    m.assume(50.0)  # as if learned over 100 samples: one more moves it by 1 %
    m.observe(150.0)
    assert m.mean == pytest.approx(51.0)


def test_a_trajectory_thinks_from_its_actions_end_to_its_next_submission() -> None:
    s = _nodes("n1")
    s.open_trajectory("t")
    s.place_trajectory("t", "n1")
    assert s.returns.thinking == {"n1": 1}  # placed, nothing queued: thinking
    s.submit("a", "t", exec_action(1, 2.0), 0.0)
    assert s.returns.thinking == {}
    s.schedule(0.0)
    assert s.returns.thinking == {}  # running
    s.complete("a", 2.0)
    assert s.returns.thinking == {"n1": 1}
    assert s.returns.think.mean == 0.0  # no gap seen yet
    s.submit("b", "t", exec_action(1, 2.0), 9.0)
    assert s.returns.think.mean == pytest.approx(7.0)  # 2.0 -> 9.0
    s.cancel("b")  # back to thinking, but the time until its next action is no think time
    assert s.returns.thinking == {"n1": 1}
    s.submit("c", "t", exec_action(1, 2.0), 100.0)
    assert s.returns.think.mean == pytest.approx(7.0)
    s.cancel("c")
    s.close_trajectory("t")
    assert s.returns.thinking == {}


def test_an_unplaced_trajectory_is_counted_on_the_node_its_first_action_places_it() -> None:
    s = _nodes("n1")
    s.open_trajectory("t")
    s.submit("a", "t", exec_action(2, 3.0), 0.0)
    assert s.queued_work == {PLACE: pytest.approx(6.0)}  # 2 cores x 3 s, node still open
    s.schedule(0.0)
    assert s.queued_work == {}  # started: nothing queued anywhere
    s.complete("a", 3.0)
    assert s.returns.thinking == {"n1": 1}


def test_a_drained_node_takes_its_thinking_trajectories_with_it() -> None:
    s = _nodes("n1", "n2")
    for t, n in (("t1", "n1"), ("t2", "n2")):
        s.open_trajectory(t)
        s.place_trajectory(t, n)
    s.submit("a", "t1", exec_action(1, 2.0), 0.0)
    s.schedule(0.0)
    s.drain_node("n1")
    assert s.returns.thinking == {"n2": 1}


def test_a_refused_think_time_or_exec_action_names_the_field() -> None:
    s = _nodes("n1")
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(SchedulingError) as e:
            s.assume_think_time(bad)
        assert e.value.field == "think_s"
        with pytest.raises(SchedulingError) as e:
            s.assume_exec_action(bad, 1.0)
        assert e.value.field == "exec_core_s"
        with pytest.raises(SchedulingError) as e:
            s.assume_exec_action(1.0, bad)
        assert e.value.field == "exec_run_s"


def test_a_node_counts_its_placed_trajectories_until_they_close_or_it_drains() -> None:
    s = _nodes("n1", "n2")
    for t, n in (("t1", "n1"), ("t2", "n1"), ("t3", "n2")):
        s.open_trajectory(t)
        s.place_trajectory(t, n)
    assert (s.cpu.nodes["n1"].trajectories, s.cpu.nodes["n2"].trajectories) == (2, 1)
    s.close_trajectory("t1")
    assert s.cpu.nodes["n1"].trajectories == 1
    s.drain_node("n1")
    assert s.cpu.nodes["n2"].trajectories == 1


def _crowded(config: SchedulerConfig, thinking: int) -> Scheduler:
    """``busy_node`` with ``thinking`` trajectories idle there, who think 10 s on average."""
    s = busy_node(config, thinking)
    s.assume_think_time(10.0)
    return s


def test_thinking_trajectories_raise_the_price_and_cap_a_long_action_sooner() -> None:
    load = (48 / 64) * 49 / 64  # utilisation x (1 queued + 48 running) per core
    # The queue: the suite at 1 core for 600 s, i.e. 600/64 s of backlog on 64 cores.
    back = 1 - math.exp(-(600 / 64) / 10.0)
    s = _crowded(ARRIVALS, thinking=32)
    # 81 trajectories, each asking for a 30 or 600 core-second command every 10 s + its
    # run: more than the 64 cores, so every one that comes back counts.
    assert s.returns.offered_load(81, 64) > 1.0
    (group,) = s.plan(0.0).groups
    assert group.core_price == pytest.approx(load + (48 / 64) * 32 * back / 64)
    assert group.price is not None and group.price == s.core_prices()["n1"]
    # The terms the metrics and explain show: the load, and the 32 thinking ones, of whom
    # 1 - exp(-D/θ) are back before the backlog drains, all of it counted (ρ_o > 1).
    assert group.price.load == pytest.approx(load)
    assert group.price.thinking == 32
    assert group.price.backlog_s == pytest.approx(600 / 64)
    assert group.price.back == pytest.approx(back)
    assert group.price.offered == pytest.approx(s.returns.offered_load(81, 64))
    assert group.price.returns == pytest.approx((48 / 64) * 32 * back / 64)
    # μ ≈ 0.574 + 0.233 = 0.807 and p/((1-p)μ) ≈ 11.2: 2 -> 3 (6) pays, 3 -> 4 (12) not.
    assert group.capped == (("suite", 3, 16),)
    # The load rule ignores them (it caps at 4, as without anyone thinking).
    (group,) = _crowded(SchedulerConfig(core_price="load"), thinking=32).plan(0.0).groups
    assert group.core_price == pytest.approx(load)
    assert group.capped == (("suite", 4, 16),)
    # Nobody thinking: the two rules agree.
    (group,) = _crowded(ARRIVALS, thinking=0).plan(0.0).groups
    assert group.core_price == pytest.approx(load)


def test_at_a_low_offered_load_the_returns_count_for_little() -> None:
    load = (48 / 64) * 49 / 64
    back = 1 - math.exp(-(600 / 64) / 10.0)
    s = _crowded(ARRIVALS, thinking=32)
    # Commands of 1.6 core-seconds every 10 s + 1.6 s: 81 of them want 81 x 1.6 / 11.6
    # ≈ 11.2 of the 64 cores, so a returning one most likely finds a free core.
    s.assume_exec_action(1.6, 1.6)
    offered = 81 * 1.6 / (11.6 * 64)
    (group,) = s.plan(0.0).groups
    assert group.core_price == pytest.approx(load + offered * (48 / 64) * 32 * back / 64)
    assert group.price is not None and group.price.offered == pytest.approx(offered)
    assert group.capped == (("suite", 4, 16),)  # as under the load rule


def test_explain_replays_the_learned_think_time_and_exec_action(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tangram.cli.explain import State, _print, as_dict, decide

    state = {**suite_state(), "config": {"core_price": "arrivals"}}
    load = 0.75 * 7 / 8
    (group,) = as_dict(decide(State.model_validate(state))[1])["groups"]
    assert group["core_price"] == pytest.approx(load)  # no think time: the load term alone
    # t6 thinks; the suite's 300 core-seconds drain in 37.5 s on 8 cores.
    extra = 0.75 * 1 * (1 - math.exp(-37.5 / 20.0)) / 8
    learned = State.model_validate({**state, "think_s": 20.0})
    (group,) = as_dict(decide(learned)[1])["groups"]
    # The exec action learned from the state: six 30 s commands and the 300 s suite, so 8
    # trajectories ask for 480/7 core-seconds every 20 + 480/7 s, of 8 cores.
    mean = 480 / 7
    assert group["core_price"] == pytest.approx(load + extra * mean / (20 + mean))
    assert group["core_price_terms"]["think_s"] == 20.0
    assert group["core_price_terms"]["back"] == pytest.approx(1 - math.exp(-37.5 / 20.0))
    assert group["core_price_terms"]["offered"] == pytest.approx(mean / (20 + mean))
    _print(as_dict(decide(learned)[1]))
    out = capsys.readouterr().out
    assert "+ return 0.061: 1 thinking (mean think time 20.0 s)," in out
    assert "85% back before the 37.5 s backlog drains, x offered load 0.77" in out
    given = State.model_validate({**learned.model_dump(), "exec_core_s": 5, "exec_run_s": 5})
    (group,) = as_dict(decide(given)[1])["groups"]
    # As given (the running and queued ones move it by 1 % each, as after 100 seen).
    core_s = 5.0
    for x in (30.0,) * 6 + (300.0,):
        core_s += 0.01 * (x - core_s)
    assert group["core_price"] == pytest.approx(load + extra * core_s / (20 + core_s))


# ---- the bookkeeping against a recount, under any order of events -------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["open", "submit", "schedule", "complete", "cancel", "close"]),
        st.integers(0, 2),
        st.integers(1, 4),
    ),
    max_size=60,
)


def _running(s: Scheduler, tid: str) -> list[str]:
    return sorted(aid for aid, r in s.running.items() if r.action.trajectory == tid)


def _recount(s: Scheduler) -> tuple[dict[str, int], dict[Resource, float]]:
    """Thinking trajectories per node and queued work per resource, from scratch."""
    busy = {r.action.trajectory for r in s.running.values()}
    busy |= {a.trajectory for a in s.actions.values()}
    thinking: dict[str, int] = {}
    for tid in s.trajectories:
        node = s.cpu.placement.get(tid)
        if node is not None and tid not in busy:
            thinking[node] = thinking.get(node, 0) + 1
    work: dict[Resource, float] = {}
    for a in s.actions.values():
        node = s.cpu.placement.get(a.trajectory)
        r = Resource.cpu(node) if node is not None else PLACE
        work[r] = work.get(r, 0.0) + a.work
    return thinking, work


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_thinking_and_queued_work_match_a_recount(ops: list[tuple[str, int, int]]) -> None:
    s = _nodes("n1", "n2", cpus=4)
    now, seq = 0.0, 0
    for op, t, k in ops:
        now += 1.0
        tid = f"t{t}"
        if op == "open" and tid not in s.trajectories:
            s.open_trajectory(tid)
        elif op == "submit" and tid in s.trajectories:
            seq += 1
            s.submit(f"a{seq}", tid, elastic(1, k, 3.0 * k) if k > 1 else exec_action(1, 2.0), now)
        elif op == "schedule":
            s.schedule(now)
        elif op == "complete" and (mine := _running(s, tid)):
            s.complete(mine[0], now)
        elif op == "cancel":
            mine = sorted(aid for aid, a in s.actions.items() if a.trajectory == tid)
            if mine:
                s.cancel(mine[0])
        elif op == "close" and tid in s.trajectories and not _running(s, tid):
            s.close_trajectory(tid)
        thinking, work = _recount(s)
        assert s.returns.thinking == thinking
        for name, node in s.cpu.nodes.items():
            assert node.trajectories == sum(n == name for n in s.cpu.placement.values())
        assert s.queued_work.keys() == {r for r, w in work.items() if w > 0}
        for r, w in work.items():
            assert s.queued_work.get(r, 0.0) == pytest.approx(w)
