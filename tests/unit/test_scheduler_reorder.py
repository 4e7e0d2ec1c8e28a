"""An ordering or tenant-fairness change while actions are queued applies at once: the
queue is rebuilt under the new settings, its actions re-ordered by the new policy, their
ageing deadlines counted from their own submissions, and nothing else of them changed."""

from __future__ import annotations

from tangram.scheduler import Scheduler, SchedulerConfig

from .helpers import cluster, exec_action, queued_books, started


def _pool(config: SchedulerConfig | None = None, cores: int = 8) -> Scheduler:
    return Scheduler(cluster(nodes=[{"name": "n1", "cpus": cores, "memory_gb": 64}]), config)


def _queue(s: Scheduler, hints: dict[str, int], now: float = 0.0) -> None:
    """One one-core action (1 s alone) for each trajectory, its client's hint of the
    steps it has left given; submitted in the dict's order."""
    for tid, hint in hints.items():
        if tid not in s.trajectories:
            s.open_trajectory(tid, hint_steps=hint)
        s.submit(f"{tid}.a", tid, exec_action(1, t1=1.0), now=now)


def test_a_new_ordering_reorders_the_queued_actions_at_once_and_back() -> None:
    """fcfs -> trajectory-priority (most predicted work first) while queued: the next
    round starts them in the new order; back to fcfs restores submission order."""
    hints = {"little": 1, "most": 10, "some": 5}
    for back in (False, True):
        s = _pool()
        _queue(s, hints)
        before = queued_books(s)
        s.set_config(SchedulerConfig(ordering="trajectory-priority"))
        assert s.config.ordering == "trajectory-priority"
        assert len(s.queue) == 3 and queued_books(s) == before
        if back:
            s.set_config(SchedulerConfig(ordering="fcfs"))
            assert queued_books(s) == before
            assert started(s, 0.0) == ["little.a", "most.a", "some.a"]
        else:
            assert started(s, 0.0) == ["most.a", "some.a", "little.a"]


def test_a_reorder_keeps_each_actions_ageing_from_its_submission() -> None:
    """An action queued at 0 (ageing bound 4 s: 4 x its 1 s) is overdue at 10, when the
    ordering changes: it goes ahead of those with more work left queued at 9.5 (which go
    by the new key: most first), as it would had the policy run all along; its deadline
    is not restarted from the change."""
    s = _pool()
    _queue(s, {"little": 1})
    _queue(s, {"some": 5, "most": 10}, now=9.5)
    s.set_config(SchedulerConfig(ordering="trajectory-priority"))
    assert started(s, 10.0) == ["little.a", "most.a", "some.a"]
    # Not overdue yet: by the policy's key alone.
    s = _pool()
    _queue(s, {"little": 1})
    _queue(s, {"most": 10}, now=2.0)
    s.set_config(SchedulerConfig(ordering="trajectory-priority"))
    assert started(s, 3.0) == ["most.a", "little.a"]


def test_shortest_remaining_reorders_too() -> None:
    s = _pool()
    _queue(s, {"most": 10, "little": 1, "some": 5})
    s.set_config(SchedulerConfig(ordering="shortest-remaining"))
    assert started(s, 0.0) == ["little.a", "some.a", "most.a"]


def _tenants(s: Scheduler) -> None:
    """Tenant a queues three actions, then tenant b one."""
    for i in range(3):
        s.open_trajectory(f"a{i}", tenant="a")
        s.submit(f"a{i}.x", f"a{i}", exec_action(1, t1=1.0), now=0.0)
    s.open_trajectory("b0", tenant="b")
    s.submit("b0.x", "b0", exec_action(1, t1=1.0), now=0.0)


def test_turning_tenant_fairness_on_and_off_reorders_the_queue_at_once() -> None:
    fair_order = ["a0.x", "b0.x", "a1.x", "a2.x"]  # b's first goes with a's first
    plain_order = ["a0.x", "a1.x", "a2.x", "b0.x"]  # submission order
    for fair_first in (False, True):
        for switch in (False, True):
            fair = fair_first != switch
            s = _pool(SchedulerConfig(tenant_fairness=fair_first))
            _tenants(s)
            before = queued_books(s)
            if switch:
                s.set_config(SchedulerConfig(tenant_fairness=not fair_first))
                assert s.config.tenant_fairness is fair
                assert queued_books(s) == before
            assert started(s, 0.0) == (fair_order if fair else plain_order)


def test_a_reorder_keeps_the_tenants_virtual_times() -> None:
    """Under fairness, tenant a held the pool: after an ordering change b still goes
    ahead of a's next action, as it did before."""
    s = _pool(SchedulerConfig(), cores=1)
    _tenants(s)
    assert started(s, 0.0) == ["a0.x"]
    s.complete("a0.x", 1.0)
    s.set_config(SchedulerConfig(ordering="trajectory-priority"))
    assert s.config.ordering == "trajectory-priority"
    assert started(s, 1.0) == ["b0.x"]
    s.set_config(SchedulerConfig(ordering="trajectory-priority", tenant_fairness=False))
    assert not s.config.tenant_fairness
    s.complete("b0.x", 2.0)
    assert started(s, 2.0) == ["a1.x"]
    assert len(s.queue) == 1 and sorted(s.actions) == ["a2.x"]


def test_a_reorder_of_an_empty_queue_or_no_change_does_nothing() -> None:
    s = _pool()
    s.set_config(SchedulerConfig(ordering="trajectory-priority", tenant_fairness=False))
    assert (s.config.ordering, s.config.tenant_fairness) == ("trajectory-priority", False)
    _queue(s, {"little": 1, "most": 10})
    queue = s.queue
    s.set_config(SchedulerConfig(ordering="trajectory-priority", tenant_fairness=False, depth=3))
    assert s.queue is queue and s.config.depth == 3
    assert started(s, 0.0) == ["most.a", "little.a"]
