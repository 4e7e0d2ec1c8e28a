"""Nodes joining and leaving a running scheduler (agents register and disappear)."""

from __future__ import annotations

import pytest

from tangram.api.action import ActionSpec
from tangram.api.cluster import ServiceSpec
from tangram.scheduler import Scheduler, SchedulerConfig, SchedulingError
from tangram.scheduler.core.decisions import Invalid
from tangram.scheduler.core.shares import TenantShare

from .helpers import api_call, cluster, elastic, exec_action, service_call, started


def test_a_pool_starts_empty_and_schedules_once_a_node_joins() -> None:
    s = Scheduler(cluster(nodes=[], apis=[{"name": "search", "concurrency": 2}]))
    s.open_trajectory("t1", memory_gb=1)
    with pytest.raises(SchedulingError, match="no CPU nodes"):
        s.submit("a1", "t1", exec_action(2, t1=1.0), now=0.0)
    s.add_node("n1", cores=4, memory_gb=8)
    s.submit("a1", "t1", exec_action(2, t1=1.0), now=0.0)
    (asg,) = s.schedule(0.0).assignments
    assert asg.node == "n1" and len(asg.cores) == 2
    with pytest.raises(SchedulingError, match="already part"):
        s.add_node("n1", cores=4)
    with pytest.raises(SchedulingError, match="cores"):
        s.add_node("n2", cores=3, numa_nodes=2)


def test_a_bigger_node_lets_queued_actions_ask_for_more() -> None:
    s = Scheduler(cluster(nodes=[{"name": "small", "cpus": 2, "memory_gb": 8}]))
    s.open_trajectory("t1", memory_gb=1)
    with pytest.raises(SchedulingError, match="largest node"):
        s.submit("a1", "t1", exec_action(4, t1=1.0), now=0.0)
    s.add_node("big", cores=8, memory_gb=8)
    s.submit("a1", "t1", exec_action(4, t1=1.0), now=0.0)
    (asg,) = s.schedule(0.0).assignments
    assert asg.node == "big"


def test_draining_a_node_ends_its_work_and_frees_what_it_held() -> None:
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "n1", "cpus": 2, "memory_gb": 8},
                {"name": "n2", "cpus": 2, "memory_gb": 8},
            ],
            apis=[{"name": "search", "concurrency": 1}],
        )
    )
    for t, node in (("t1", "n1"), ("t2", "n2")):
        s.open_trajectory(t, memory_gb=1)
        s.place_trajectory(t, node)
    s.submit("run", "t1", exec_action(2, t1=5.0), now=0.0)
    s.submit("call", "t1", api_call("search"), now=0.0)
    s.submit("other", "t2", exec_action(1, t1=1.0), now=0.0)
    started = {a.action_id for a in s.schedule(0.0).assignments}
    assert started == {"run", "call", "other"}
    s.submit("queued", "t1", exec_action(1, t1=1.0), now=0.1)
    drained = s.drain_node("n1")
    # The run on its cores ends; t1's API call holds no unit of n1's and goes on.
    assert drained.running == ("run",) and drained.trajectories == ("t1",)
    assert drained.dropped == ("queued",)
    assert "t1" not in s.trajectories and "n1" not in s.cpu.nodes
    with pytest.raises(SchedulingError, match="not running"):
        s.complete("run", now=1.0)
    s.open_trajectory("t3", memory_gb=1)
    s.submit("next", "t3", api_call("search"), now=1.0)
    assert s.schedule(1.0).assignments == ()  # "call" still holds the quota's unit
    s.complete("call", now=1.0)
    assert "t1" not in s.closing  # its last run ended
    assert [a.action_id for a in s.schedule(1.0).assignments] == ["next"]
    s.complete("other", now=1.0)
    with pytest.raises(SchedulingError, match="not part"):
        s.drain_node("n1")


def test_adopting_an_action_on_its_exact_cores() -> None:
    s = Scheduler(cluster(nodes=[{"name": "n1", "cpus": 4, "memory_gb": 8}]))
    s.open_trajectory("t1", memory_gb=1)
    asg = s.adopt("old", "t1", exec_action(2), units=2, started_at=0.0, node="n1", cores=[1, 3])
    assert asg.cores == (1, 3) and s.cpu.nodes["n1"].free_cores == 2
    s.open_trajectory("t2", memory_gb=1)
    with pytest.raises(SchedulingError, match="not free"):
        s.adopt("clash", "t2", exec_action(1), units=1, started_at=0.0, node="n1", cores=[3])
    with pytest.raises(SchedulingError, match="distinct"):
        s.adopt("bad", "t2", exec_action(2), units=2, started_at=0.0, node="n1", cores=[0, 0])
    s.complete("old", now=1.0)
    assert s.cpu.nodes["n1"].free_cores == 4


def _one_running_one_waiting() -> Scheduler:
    """Quota search of 1: action a holds it, b waits for it."""
    s = Scheduler(
        cluster(nodes=[{"name": "n1", "cpus": 1}], apis=[{"name": "search", "concurrency": 1}])
    )
    s.open_trajectory("t1")
    s.submit("a", "t1", api_call("search"), now=0.0)
    s.submit("b", "t1", api_call("search"), now=0.0)
    assert [x.action_id for x in s.schedule(0.0).assignments] == ["a"]
    return s


def test_quota_definitions_change_in_place_and_waiting_actions_keep_theirs() -> None:
    from tangram.api import ApiSpec

    s = _one_running_one_waiting()
    s.set_quotas([ApiSpec(name="search", concurrency=2), ApiSpec(name="browse", concurrency=1)])
    assert [x.action_id for x in s.schedule(0.1).assignments] == ["b"]  # the raised limit
    assert "browse" in s.quotas
    s.set_quotas([])  # removed, but running actions still hold it
    assert "search" in s.quotas and "browse" not in s.quotas
    s.complete("a", now=1.0)
    assert "search" in s.quotas  # (b still holds it)
    s.complete("b", now=1.0)
    assert s.quotas == {}  # gone with the last that held it, not at the next reload


def test_a_removed_quota_goes_once_no_queued_action_needs_it() -> None:
    from tangram.api import ApiSpec

    s = _one_running_one_waiting()
    s.set_quotas([ApiSpec(name="other", concurrency=1)])
    s.complete("a", now=1.0)
    assert "search" in s.quotas  # b waits for it
    assert s.cancel("b")
    assert set(s.quotas) == {"other"}


def test_the_ordering_changes_at_once_with_actions_queued() -> None:
    """Applied whole while actions are queued, the rest of the settings with it; the
    queued action stays queued and starts (tests/unit/test_scheduler_reorder.py: the
    order)."""
    from tangram.scheduler import SchedulerConfig

    s = Scheduler(cluster(nodes=[{"name": "n1", "cpus": 1, "memory_gb": 1}]))
    s.open_trajectory("t1")
    s.submit("a", "t1", exec_action(1, t1=1.0), now=0.0)
    asked = SchedulerConfig(ordering="trajectory-priority", tenant_fairness=False, depth=3)
    s.set_config(asked)
    assert s.config == asked and len(s.queue) == 1 and "a" in s.queue
    s.set_config(SchedulerConfig(depth=4))
    assert (s.config.ordering, s.config.tenant_fairness, s.config.depth) == ("fcfs", True, 4)
    assert started(s, 0.0) == ["a"]


def _service_action(name: str, t1: float | None = 1.0) -> ActionSpec:
    return ActionSpec(kind="service", service=name, t1_s=t1)


def test_gpu_nodes_join_and_leave_with_what_they_held() -> None:
    s = Scheduler(cluster(nodes=[]))
    s.set_services([ServiceSpec(name="judge", gpu_memory_gb=6, dop_choices=[1], replicated=True)])
    s.open_trajectory("~svc")
    with pytest.raises(SchedulingError, match="fits service judge"):
        s.submit("c1", "~svc", _service_action("judge"), now=0.0)  # no GPUs yet
    with pytest.raises(SchedulingError, match="1, 2, 4 or 8"):
        s.add_gpu_node("g", gpus=3, memory_gb=10)
    s.add_gpu_node("g", gpus=2, memory_gb=10)
    s.submit("c1", "~svc", _service_action("judge"), now=0.0)
    (asg,) = s.schedule(0.0).assignments
    assert asg.node == "g" and asg.chunk is not None and asg.restore
    s.complete("c1", 1.0)
    s.submit("c2", "~svc", _service_action("judge"), now=1.0)
    (again,) = s.schedule(1.0).assignments
    assert again.chunk == asg.chunk and not again.restore  # the warm chunk is preferred
    drained = s.drain_node("g")
    assert drained.running == ("c2",) and "g" not in s.gpu.nodes and not s.gpu.resident


def test_a_replicated_instance_holds_the_whole_model_on_each_gpu() -> None:
    sharded = ServiceSpec(name="s", gpu_memory_gb=12, dop_choices=[2], restore_s=4.0)
    replicas = sharded.model_copy(update={"name": "r", "replicated": True})
    assert (sharded.restore_cost(2), replicas.restore_cost(2)) == (2.0, 4.0)
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=2, memory_gb=10)
    s.set_services([sharded, replicas])
    assert (s.gpu.per_gpu("s", 2), s.gpu.per_gpu("r", 2)) == (6.0, 12.0)
    assert s.gpu.fits("s", 2) and not s.gpu.fits("r", 2)


def test_redefining_services_drops_the_stale_instances_and_the_removed_services() -> None:
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=1, memory_gb=10)
    s.set_services([ServiceSpec(name=n, gpu_memory_gb=4, dop_choices=[1]) for n in "ab"])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("a"), now=0.0)
    s.schedule(0.0)
    s.complete("c1", 1.0)
    assert [i.service for i in s.gpu.resident] == ["a"]
    s.set_services([ServiceSpec(name="a", gpu_memory_gb=5, dop_choices=[1])])
    assert set(s.services) == {"a"} and "b" not in s.gpu.memory_gb  # nothing needed b
    assert not s.gpu.resident  # a's footprint changed: its idle instance is stale


def test_a_removed_service_refuses_its_queued_calls_and_goes_when_its_last_call_ends() -> None:
    """Its workers drop it at once: a queued call of it is refused by the next round (it
    would only be refused by its worker), a running one goes on, and the service, with
    its instance, goes when the last such call has ended."""
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=1, memory_gb=10)
    s.set_services([ServiceSpec(name=n, gpu_memory_gb=4, dop_choices=[1]) for n in "ab"])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("b"), now=0.0)
    assert started(s, 0.0) == ["c1"]
    s.submit("c2", "~svc", _service_action("b"), now=0.5)  # waits for the GPU
    s.submit("c3", "~svc", _service_action("a"), now=0.5)
    s.set_services([ServiceSpec(name="a", gpu_memory_gb=4, dop_choices=[1])])  # b removed
    with pytest.raises(SchedulingError, match="unknown RewardService 'b'"):
        s.submit("c4", "~svc", _service_action("b"), now=1.0)
    rnd = s.schedule(1.0)
    why = "RewardService b was removed from the pool"
    assert rnd.invalid == (Invalid(action_id="c2", field="service", message=why),)
    assert rnd.assignments == () and "c2" not in s.actions and len(s.queue) == 1
    assert set(s.services) == {"a", "b"}  # c1 still runs on it
    s.complete("c1", 2.0)
    assert set(s.services) == {"a"} and "b" not in s.gpu.memory_gb
    assert not s.gpu.resident and s.gpu.nodes["g"].used_gb == [0.0]  # nothing of b counted
    assert started(s, 2.0) == ["c3"]


def test_a_removed_service_is_not_restored_ahead_and_may_come_back() -> None:
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=2, memory_gb=10)
    b = ServiceSpec(name="b", gpu_memory_gb=4, dop_choices=[1])
    s.set_services([b])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("b"), now=0.0)
    rnd = s.schedule(0.0)
    (ahead,) = rnd.ahead  # for the calls to come, on the other GPU
    s.ahead_done("b", ahead.chunk)
    s.set_services([])  # removed while c1 runs
    assert [i.chunk.start for i in s.gpu.resident] == [0]  # the idle copy went
    assert s.schedule(1.0).ahead == ()  # no call of it can come
    s.set_services([b])  # back, as it was: its workers load it again
    s.complete("c1", 2.0)
    assert set(s.services) == {"b"} and s.gpu.memory_gb == {"b": 4}
    assert not s.gpu.resident  # the instance c1 ran on was dropped with the old load
    s.submit("c2", "~svc", _service_action("b"), now=2.0)
    assert started(s, 2.0) == ["c2"]


def test_a_call_waits_while_its_service_is_loading_on_every_node() -> None:
    """A worker reloading an edited service (or loading it, having just joined) refuses
    its calls until it has: none is placed there, yet a call is not refused for it."""
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=1, memory_gb=10)
    s.set_services([ServiceSpec(name="a", gpu_memory_gb=4, dop_choices=[1])])
    s.set_unloadable("g", [], loading=["a"])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("a"), now=0.0)
    rnd = s.schedule(0.0)
    assert rnd.assignments == () and rnd.ahead == () and s.stranded == {"c1"}
    s.set_unloadable("g", [])  # its answer: loaded
    assert started(s, 1.0) == ["c1"]
    s.set_unloadable("g", ["a"])  # a load that failed: refused, as before
    with pytest.raises(SchedulingError, match="fits service a"):
        s.submit("c2", "~svc", _service_action("a"), now=1.0)


def test_an_instance_redefined_while_it_ran_is_dropped_when_it_ends() -> None:
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("g", gpus=1, memory_gb=10)
    s.set_services([ServiceSpec(name="a", gpu_memory_gb=4, dop_choices=[1])])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("a"), now=0.0)
    s.schedule(0.0)
    s.set_services([ServiceSpec(name="a", gpu_memory_gb=6, dop_choices=[1])])  # an edit
    assert [i.service for i in s.gpu.resident] == ["a"]  # busy: kept while it runs
    s.complete("c1", 1.0)
    assert not s.gpu.resident and s.gpu.nodes["g"].used_gb == [0.0]


def test_a_call_never_lands_on_a_node_that_could_not_load_its_service() -> None:
    s = Scheduler(cluster(nodes=[]))
    for node in ("a", "b"):
        s.add_gpu_node(node, gpus=1, memory_gb=10)
    s.set_services([ServiceSpec(name=n, gpu_memory_gb=4, dop_choices=[1]) for n in "xy"])
    s.set_unloadable("a", ["x"])  # a's worker failed to load x; y loaded everywhere
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("x"), now=0.0)
    (asg,) = s.schedule(0.0).assignments
    assert (asg.action_id, asg.node) == ("c1", "b")  # b, though a sorts first
    s.submit("c2", "~svc", _service_action("y"), now=0.0)
    assert [(g.action_id, g.node) for g in s.schedule(0.0).assignments] == [("c2", "a")]
    s.submit("c3", "~svc", _service_action("x"), now=0.0)
    s.complete("c2", 1.0)
    assert s.schedule(1.0).assignments == ()  # a is free, but cannot run x: c3 waits
    s.complete("c1", 2.0)
    assert [(g.action_id, g.node) for g in s.schedule(2.0).assignments] == [("c3", "b")]
    s.set_unloadable("b", ["x"])  # now nowhere: it can never fit
    assert not s.gpu.fits("x", 1) and s.gpu.fits("y", 1)
    with pytest.raises(SchedulingError, match="no GPUs"):
        s.set_unloadable("z", [])


# ---- a drain ends the runs on the node's units, and only those ---------------------------


def _cpu_node_and_gpus(max_calls: int = 1) -> Scheduler:
    """t on CPU node c0 (its first command done), its call c1 running on GPU node g."""
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "c0", "cpus": 8, "memory_gb": 16},
                {"name": "c1", "cpus": 8, "memory_gb": 16},
                {"name": "g", "gpus": 1, "gpu_memory_gb": 80},
            ],
            services=[
                {"name": "rm", "gpu_memory_gb": 10, "dop_choices": [1], "max_calls": max_calls}
            ],
        )
    )
    s.open_trajectory("t", memory_gb=1)
    s.place_trajectory("t", "c0")
    s.submit("c1", "t", _service_action("rm", 10.0), now=1.0)
    (asg,) = s.schedule(1.0).assignments
    assert asg.node == "g"
    return s


def test_a_call_on_other_gpus_outlives_its_trajectorys_node_and_frees_its_chunk() -> None:
    s = _cpu_node_and_gpus()
    drained = s.drain_node("c0")
    assert drained.running == () and drained.trajectories == ("t",)
    assert "c1" in s.running and "t" not in s.trajectories
    s.open_trajectory("u")
    s.submit("c2", "u", _service_action("rm", 10.0), now=2.0)
    assert s.schedule(2.0).assignments == ()  # the only GPU is still c1's
    done = s.complete("c1", now=11.0)  # it ends as any run does
    assert done.chunk is not None and not s.gpu.busy and s.gpu.chunk_counts() == (1, 0, 0, 0)
    assert not s.closing  # its trajectory's last run ended
    assert [a.action_id for a in s.schedule(11.0).assignments] == ["c2"]


def test_a_batching_instance_outliving_a_drain_takes_joiners_and_frees_at_its_last() -> None:
    s = _cpu_node_and_gpus(max_calls=4)
    s.drain_node("c0")
    s.open_trajectory("u")
    s.submit("c2", "u", _service_action("rm", 10.0), now=2.0)
    (joined,) = s.schedule(2.0).assignments  # the instance runs: a join, no KeyError
    assert joined.sharing == 1
    s.complete("c1", now=11.0)
    s.complete("c2", now=12.0)
    assert not s.gpu.busy and s.gpu.chunk_counts() == (1, 0, 0, 0)


def test_draining_a_gpu_node_settles_the_trajectories_of_its_calls() -> None:
    s = _cpu_node_and_gpus()
    assert s.trajectories["t"].in_flight == 1 and s.returns.thinking == {}
    drained = s.drain_node("g")
    assert drained.running == ("c1",) and drained.trajectories == ()
    assert s.trajectories["t"].in_flight == 0
    assert s.returns.thinking == {"c0": 1}  # thinking again: its next action comes back
    s.submit("e", "t", exec_action(1, 1.0), now=5.0)  # not a think time: its call failed
    assert s.returns.think.seen == 0
    assert started(s, 5.0) == ["e"]
    s.complete("e", now=6.0)
    assert s.trajectories["t"].in_flight == 0 and s.returns.thinking == {"c0": 1}


def test_a_trajectory_opened_again_counts_its_run_that_outlived_the_drain() -> None:
    s = _cpu_node_and_gpus()
    s.drain_node("c0")
    s.open_trajectory("t", memory_gb=1)  # its agent came back elsewhere
    s.place_trajectory("t", "c1")
    assert s.trajectories["t"].in_flight == 1 and s.returns.thinking == {}
    with pytest.raises(SchedulingError, match="running"):
        s.close_trajectory("t")
    s.complete("c1", now=11.0)
    assert s.trajectories["t"].in_flight == 0 and s.returns.thinking == {"c1": 1}
    s.close_trajectory("t")
    assert not s.closing and not s.returns.thinking


# ---- a cordoned node (its agent stops, and lets what runs finish) takes no new work -----


def _exec_with_quota(cores: int, t1: float, quota: str) -> ActionSpec:
    return ActionSpec(kind="exec", cpu=cores, t1_s=t1, quotas={quota: 1})


def test_a_cordoned_node_starts_nothing_new_and_lets_what_runs_end() -> None:
    """An agent that said it stops kept getting new trajectories and the next commands
    of its own, which it never ran: they ended node_lost when it left. A cordoned node
    takes none: new trajectories go to the others; its own trajectories' next actions
    wait (holding nobody back) and are dropped with the node; what runs there ends."""
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "n1", "cpus": 4, "memory_gb": 8},
                {"name": "n2", "cpus": 4, "memory_gb": 8},
            ],
            apis=[{"name": "search", "concurrency": 1}],
        )
    )
    s.open_trajectory("t0", memory_gb=4)  # n2 half full: n1 is the one chosen
    s.place_trajectory("t0", "n2")
    s.open_trajectory("t1", memory_gb=1)
    s.place_trajectory("t1", "n1")
    s.submit("run", "t1", exec_action(1, t1=5.0), now=0.0)
    assert started(s, 0.0) == ["run"]
    s.cordon_node("n1")
    s.cordon_node("n1")  # (said twice: one cordon)
    s.submit("next", "t1", _exec_with_quota(1, 1.0, "search"), now=1.0)
    s.open_trajectory("t2", memory_gb=1)
    s.submit("new", "t2", _exec_with_quota(1, 1.0, "search"), now=1.0)
    rnd = s.schedule(1.0)
    # t1's next command waits for its node, which has free cores but takes no new work,
    # and does not keep the quota from t2's, which goes to n2.
    assert [(a.action_id, a.node) for a in rnd.assignments] == [("new", "n2")]
    assert s.stranded == {"next"} and s.cpu.placement["t2"] == "n2"
    s.open_trajectory("t3", memory_gb=1)
    with pytest.raises(SchedulingError, match="n1 takes no new trajectories"):
        s.place_trajectory("t3", "n1")
    assert s.cpu.choose_node(1.0, 0, {}) == "n2"
    done = s.complete("run", now=5.0)  # what ran when it was cordoned ends as any run
    assert done.node == "n1" and s.cpu.nodes["n1"].free_cores == 4
    assert s.schedule(5.0).assignments == ()
    drained = s.drain_node("n1")  # its agent's link closed
    assert drained.running == () and drained.trajectories == ("t1",)
    assert drained.dropped == ("next",) and not s.stranded
    s.add_node("n1", cores=4, memory_gb=8)  # its next agent: not cordoned
    s.place_trajectory("t3", "n1")
    s.submit("back", "t3", exec_action(1, t1=1.0), now=6.0)
    assert [(a.action_id, a.node) for a in s.schedule(6.0).assignments] == [("back", "n1")]


def test_a_new_trajectory_waits_for_room_as_if_the_cordoned_node_were_gone() -> None:
    """n1 (cordoned, empty) is left out of where a new trajectory may go: its first
    action waits for memory on n2, naming no core of n1; with n1 alone, it waits for a
    node to join (stranded), not refused."""
    s = Scheduler(
        cluster(
            nodes=[
                {"name": "n1", "cpus": 2, "memory_gb": 8},
                {"name": "n2", "cpus": 2, "memory_gb": 2},
            ]
        )
    )
    s.open_trajectory("full", memory_gb=2)
    s.place_trajectory("full", "n2")
    s.cordon_node("n1")
    s.open_trajectory("t", memory_gb=1)
    s.submit("a", "t", exec_action(1, t1=1.0), now=0.0)
    rnd = s.schedule(0.0)
    assert rnd.assignments == () and rnd.blocked == (("a", "place"),) and not s.stranded
    s.close_trajectory("full")
    assert [(a.action_id, a.node) for a in s.schedule(1.0).assignments] == [("a", "n2")]
    s.complete("a", now=2.0)
    s.close_trajectory("t")
    s.drain_node("n2")  # n1, cordoned, is all that is left
    s.open_trajectory("u", memory_gb=1)  # not refused: the node may come back
    s.submit("b", "u", exec_action(1, t1=1.0), now=3.0)
    assert s.schedule(3.0).assignments == () and s.stranded == {"b"}
    s.drain_node("n1")
    s.add_node("n1", cores=2, memory_gb=8)  # its next agent
    assert started(s, 4.0) == ["b"]
    with pytest.raises(SchedulingError, match="not part"):
        s.cordon_node("n9")


def test_a_cordoned_gpu_node_takes_no_call_and_no_joiner() -> None:
    """A call lands on another node's GPUs, not on the instance running on the cordoned
    one (it batches: it would join it); a free GPU there counts for nothing; a call only
    it could run waits for it (not refused), nothing restored ahead, until it is back."""
    s = Scheduler(cluster(nodes=[]))
    s.add_gpu_node("a", gpus=1, memory_gb=80)
    s.add_gpu_node("b", gpus=1, memory_gb=80)
    rm = ServiceSpec(name="rm", gpu_memory_gb=10, dop_choices=[1], max_calls=4)
    s.set_services([rm])
    s.open_trajectory("~svc")
    s.submit("c1", "~svc", _service_action("rm", 10.0), now=0.0)
    (first,) = s.schedule(0.0).assignments
    assert first.node == "a"
    s.cordon_node("a")
    s.submit("c2", "~svc", _service_action("rm", 10.0), now=1.0)
    rnd = s.schedule(1.0)
    (second,) = rnd.assignments  # not a join of c1's instance on a: a chunk of b
    assert (second.node, second.sharing) == ("b", 0)
    assert s.gpu.chunk_counts() == (0, 0, 0, 0)  # a's GPU is busy, b's taken
    s.complete("c1", now=10.0)
    assert s.gpu.chunk_counts() == (0, 0, 0, 0)  # a's free GPU takes no new work
    s.complete("c2", now=11.0)
    s.drain_node("b")  # now only the cordoned a is left
    s.submit("c3", "~svc", _service_action("rm", 10.0), now=12.0)  # accepted: it waits
    rnd = s.schedule(12.0)
    assert rnd.assignments == () and rnd.ahead == () and s.stranded == {"c3"}
    s.drain_node("a")
    s.add_gpu_node("a", gpus=1, memory_gb=80)  # its agent is back
    assert [(g.action_id, g.node) for g in s.schedule(13.0).assignments] == [("c3", "a")]


def _two_nodes(n1: int, n2: int, config: SchedulerConfig | None = None) -> Scheduler:
    nodes = [{"name": "n1", "cpus": n1, "memory_gb": 8}, {"name": "n2", "cpus": n2, "memory_gb": 8}]
    return Scheduler(cluster(nodes=nodes), config)


def test_a_capped_tenants_share_is_of_the_cores_that_take_new_work() -> None:
    """A tenant capped at half the pool may hold half its cores. With n1 cordoned, half
    of both nodes was all of n2, the only node taking new work: the capped tenant could
    take it whole, leaving the others none. Its share is now of n2's cores alone, and
    what it still runs on n1 counts for none of it (n1's cores are not in the pool it is
    a share of). An action that half the whole pool fits, but not half of n2, waits for
    n1 to come back (stranded: it holds nobody back), rather than being refused."""
    s = _two_nodes(4, 4)
    s.set_tenants({"capped": TenantShare(max_share=0.5)})
    for tid, tenant, node in (("old", "capped", "n1"), ("c", "capped", "n2"),
                              ("f", "free", "n2")):  # fmt: skip
        s.open_trajectory(tid, memory_gb=1, tenant=tenant)
        s.place_trajectory(tid, node)
    s.submit("on-n1", "old", exec_action(2, t1=10.0), now=0.0)
    assert started(s, 0.0) == ["on-n1"]
    s.cordon_node("n1")
    for i in range(4):
        s.submit(f"c{i}", "c", exec_action(1, t1=10.0), now=1.0)
    # 2 of n2's 4 cores (counting n1's: all 4; counting its run on n1 too: none).
    assert started(s, 1.0) == ["c0", "c1"]
    assert dict(s.plan(1.0).blocked)["c2"] == "tenant capped at its maxShare"
    for aid in ("c2", "c3"):
        s.cancel(aid)
    for i in range(2):
        s.submit(f"f{i}", "f", exec_action(1, t1=10.0), now=2.0)
    assert started(s, 2.0) == ["f0", "f1"]  # the cores the cap left free
    s.submit("wide", "c", exec_action(3, t1=1.0), now=3.0)  # 3 <= 4, half of 8 cores
    assert s.stranded == {"wide"}
    for aid in ("on-n1", "c0", "c1", "f0", "f1"):
        s.complete(aid, now=10.0)
    s.drain_node("n1")
    s.add_node("n1", cores=4, memory_gb=8)  # its next agent: half the pool is 4 again
    assert not s.stranded
    rnd = s.schedule(11.0)
    assert [(a.action_id, a.node, a.units) for a in rnd.assignments] == [("wide", "n2", 3)]


def test_a_capped_tenant_with_nothing_on_a_cordoned_node_takes_half_of_the_others() -> None:
    """With n1 cordoned and nothing of the capped tenant there, half of both nodes' cores
    was all of n2's: it took n2 whole. Half of n2 now."""
    s = _two_nodes(4, 4)
    s.set_tenants({"capped": TenantShare(max_share=0.5)})
    s.open_trajectory("c", memory_gb=1, tenant="capped")
    s.place_trajectory("c", "n2")
    s.cordon_node("n1")
    for i in range(4):
        s.submit(f"c{i}", "c", exec_action(1, t1=10.0), now=0.0)
    assert started(s, 0.0) == ["c0", "c1"]


def test_a_capped_tenants_gpu_share_is_of_the_gpus_that_take_new_work() -> None:
    """The same for GPUs: half of a's and b's is all of b's with a cordoned."""
    gpus = [{"name": n, "gpus": 2, "gpu_memory_gb": 80} for n in ("a", "b")]
    rm = {"name": "rm", "gpu_memory_gb": 10, "dop_choices": [1]}
    s = Scheduler(cluster(nodes=gpus, services=[rm]), SchedulerConfig(restore_ahead=False))
    s.set_tenants({"capped": TenantShare(max_share=0.5)})
    s.cordon_node("a")
    s.open_trajectory("w", tenant="capped")
    for i in range(2):
        s.submit(f"c{i}", "w", service_call("rm", 1.0, gpu=1), now=0.0)
    assert [(g.action_id, g.node) for g in s.schedule(0.0).assignments] == [("c0", "b")]


def test_an_unplaced_action_is_sized_for_the_nodes_that_take_new_work() -> None:
    """n1 (8 cores) is cordoned; n2 has 2. A trajectory not placed yet can only go to n2,
    so its action is sized for n2's 2 cores, not at the fixed DoP of 4 that only n1 has
    (its figures read so: fair queuing's work). One whose minimum only n1 can hold is not
    refused: it waits for n1 (stranded), and runs there once its next agent joins."""
    s = _two_nodes(8, 2, SchedulerConfig(fixed_dop=4))
    s.cordon_node("n1")
    s.open_trajectory("t", memory_gb=1)
    s.submit("e", "t", elastic(1, 8, 40.0, 0.5), now=0.0)
    units, durations, _ = s.sizing.choices(s.actions["e"], None)
    assert units == (2,) and s.actions["e"].work == pytest.approx(2 * durations[2])
    s.open_trajectory("w", memory_gb=1)
    s.submit("wide", "w", exec_action(4, t1=1.0), now=0.0)
    assert s.stranded == {"wide"}
    assert [(a.action_id, a.node, a.units) for a in s.schedule(0.0).assignments] == [("e", "n2", 2)]
    s.drain_node("n1")
    s.add_node("n1", cores=8, memory_gb=8)
    assert [(a.action_id, a.node) for a in s.schedule(1.0).assignments] == [("wide", "n1")]


def test_a_call_is_not_held_for_the_gpus_a_cordoned_node_frees() -> None:
    """Node a runs a short call on both its GPUs and is cordoned; b has one GPU free and
    one busy for long. An elastic call (DoP 1 or 2, perfectly parallel) planned as if
    a's GPUs came back waited for them (1 s, then 50 s at DoP 2, beating 100 s now at
    DoP 1) and got nothing when they did: a's chunks take no new work. It starts now on
    b's free GPU."""
    rm = {"name": "rm", "gpu_memory_gb": 10, "dop_choices": [1, 2], "restore_s": 0.0,
          "efficiency": {"amdahl": 1.0}}  # fmt: skip
    gpus = [{"name": n, "gpus": 2, "gpu_memory_gb": 80} for n in ("a", "b")]
    s = Scheduler(cluster(nodes=gpus, services=[rm]), SchedulerConfig(restore_ahead=False))
    s.open_trajectory("w")
    s.submit("short", "w", service_call("rm", 2.0, gpu=2), now=0.0)
    s.submit("long", "w", service_call("rm", 100.0, gpu=1), now=0.0)
    assert {a.action_id: a.node for a in s.schedule(0.0).assignments} == {
        "short": "a",
        "long": "b",
    }
    s.cordon_node("a")
    s.open_trajectory("t")
    s.submit("c", "t", service_call("rm", 100.0, gpu={"choices": [1, 2]}), now=0.5)
    rnd = s.schedule(0.5)
    assert rnd.blocked == ()
    assert [(g.action_id, g.node, g.units) for g in rnd.assignments] == [("c", "b", 1)]
