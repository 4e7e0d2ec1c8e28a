"""Ordering and tenant-fairness changes during a random workload (an ActionPool's
``spec.scheduling`` edited under load): each applies at once, the queue rebuilt under it.

At every change: the queue holds exactly the queued actions, each once, in an order the
new policy gives (fair between tenants iff asked); what the scheduler counts of them
(waiting per resource, stranded, per tenant, per trajectory) is unchanged. Over the run,
the invariants and liveness of ``test_scheduler_invariants.simulate`` hold: no queued
action is lost (each starts or its client cancels it), none starts twice, none is left
waiting with nothing to wake it.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tangram.scheduler import SchedulerConfig
from tangram.scheduler.core.fair import FairQueue

from ..unit.helpers import queued_books
from .test_scheduler_invariants import Sim, Workload, drain_workloads, simulate, workloads

ORDERINGS = ["fcfs", "trajectory-priority", "shortest-remaining"]


def configs() -> st.SearchStrategy[SchedulerConfig]:
    return st.builds(
        SchedulerConfig,
        ordering=st.sampled_from(ORDERINGS),
        tenant_fairness=st.booleans(),
        ageing_factor=st.sampled_from([0.5, 4.0]),
        ageing_wait=st.sampled_from([0.0, 2.0]),
    )


@st.composite
def tenant_workloads(draw: st.DrawFn, drains: bool = False) -> Workload:
    """``workloads`` (or ``drain_workloads``) with the trajectories spread over tenants."""
    w = draw(drain_workloads() if drains else workloads())
    tenants = draw(st.lists(st.sampled_from(["", "a", "b"]), min_size=len(w.trajectories),
                            max_size=len(w.trajectories)))  # fmt: skip
    trajs = tuple(replace(t, tenant=x) for t, x in zip(w.trajectories, tenants, strict=True))
    return replace(w, trajectories=trajs)


@st.composite
def switch_lists(draw: st.DrawFn, w: Workload) -> list[tuple[float, SchedulerConfig]]:
    """New settings at random times, often just after a trajectory's first submission
    (the switch goes after the submissions of its time, before the round): a queue."""
    firsts = sorted({t.arrival_s + t.steps[0].think_s for t in w.trajectories})
    times = st.one_of(st.sampled_from(firsts), st.floats(0.0, 8.0))
    return draw(st.lists(st.tuples(times, configs()), min_size=1, max_size=6))


def switch(sim: Sim, config: SchedulerConfig) -> None:
    s = sim.sched
    queued = set(sim.queued)
    assert set(s.actions) == queued and len(s.queue) == len(queued)
    before = queued_books(s)
    reorder = (s.config.ordering, s.config.tenant_fairness) != (
        config.ordering,
        config.tenant_fairness,
    )
    s.set_config(config)
    assert s.config == config
    assert isinstance(s.queue, FairQueue) == config.tenant_fairness
    assert queued_books(s) == before, "a reorder changed what is counted of the queued actions"
    order = list(s.queue.order(sim.now))
    assert len(order) == len(set(order)), "an action queued twice"
    assert set(order) == queued and all(a in s.queue for a in queued), "an action lost"
    if reorder and queued:
        event("the ordering changed with actions queued")
    if not config.tenant_fairness and config.ordering == "fcfs":
        by_seq = sorted(queued, key=lambda a: s.actions[a].seq)
        assert order == by_seq, "fcfs is not submission order after a change"


@settings(max_examples=150, deadline=None)
@given(st.data(), tenant_workloads(), configs())
def test_ordering_and_fairness_changes_keep_every_queued_action(
    data: st.DataObject, w: Workload, config: SchedulerConfig
) -> None:
    switches = data.draw(switch_lists(w))
    simulate(w, config, fcfs_check=False, switches=switches, on_switch=switch)


@settings(max_examples=75, deadline=None)
@given(st.data(), tenant_workloads(drains=True), configs())
def test_ordering_changes_with_a_node_drained_keep_the_invariants(
    data: st.DataObject, w: Workload, config: SchedulerConfig
) -> None:
    switches = data.draw(switch_lists(w))
    simulate(w, config, fcfs_check=False, switches=switches, on_switch=switch)
