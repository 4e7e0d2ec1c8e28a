"""The reconciler's passes over a stand-in cluster (objects in a dict, as the API server
would hold them) and a stand-in scheduler link: what it writes, pushes and drains."""

from __future__ import annotations

import copy
import datetime as dt
import threading
import time
from typing import Any

import pytest

from tangram.api.wire import PoolFigures
from tangram.operator.kube import ApiServerError, DeniedError, RefusedError
from tangram.operator.reconciler import Reconciler, RetryError
from tangram.operator.scheduler_link import SchedulerError, SchedulerRefusedError

NOW = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)
Key = tuple[str, str, str]  # kind, namespace, name


class Cluster:
    """What the reconciler calls of ``tangram.operator.kube.Cluster``, on a dict."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.status_patches: list[Key] = []
        self.events: list[tuple[str, str]] = []  # (reason, message)
        self.refuse: str | None = None  # a Deployment whose container asks this is refused
        self.down = False  # the API server fails every apply (a 500, say)
        self.reads: list[Key] = []
        self.lists = 0

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        self.objects[obj["kind"], meta["namespace"], meta["name"]] = obj
        return obj

    def get_custom(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append((kind, namespace, name))
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def list_custom(self, kind: str) -> list[dict[str, Any]]:
        self.lists += 1
        return [copy.deepcopy(o) for (k, _, _), o in self.objects.items() if k == kind]

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        if (obj := self.objects.get((kind, namespace, name))) is not None:
            obj["status"] = copy.deepcopy(status)
            self.status_patches.append((kind, namespace, name))

    def apply(self, manifest: dict[str, Any], *, dry_run: bool = False) -> None:
        meta = manifest["metadata"]
        if self.down:
            raise ApiServerError(f"{manifest['kind']} {meta['name']}: HTTP 500: etcd timeout")
        if manifest["kind"] == "Deployment" and self.refuse is not None:
            (container,) = manifest["spec"]["template"]["spec"]["containers"]
            if self.refuse in str(container.get("resources")):
                raise RefusedError(f"Deployment {meta['name']}: {self.refuse} is refused")
        if dry_run:
            return
        key = (manifest["kind"], meta.get("namespace", ""), meta["name"])
        status = (self.objects.get(key) or {}).get("status")
        self.objects[key] = {**copy.deepcopy(manifest), **({"status": status} if status else {})}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        return self.objects.pop((kind, namespace or "", name), None) is not None

    def delete_cluster_children(self, namespace: str, pool: str) -> list[str]:
        return []

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        if self.down:
            raise ApiServerError(f"listing pods {selector}: HTTP 500: etcd timeout")
        wanted = dict(term.split("=") for term in selector.split(","))
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == "Pod" and ns == namespace
                and wanted.items() <= o["metadata"].get("labels", {}).items()]  # fmt: skip

    def delete_pod(self, namespace: str, name: str) -> bool:
        return self.delete("v1", "Pod", namespace, name)

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        secret = self.objects.get(("Secret", namespace, name))
        return None if secret is None else dict(secret.get("stringData") or {})

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str, now: Any) -> None:
        self.events.append((reason, message))


class Link:
    """A scheduler that answers with ``trajectories`` open, or not at all (``down``)."""

    def __init__(self) -> None:
        self.trajectories = 0
        self.nodes = 1
        self.down = False
        self.drained: list[str] = []
        self.pushed: list[str] = []  # the documents of each reload

    def _figures(self) -> PoolFigures:
        if self.down:
            raise SchedulerError("connection refused")
        return PoolFigures(pool="coding", epoch="e1", accepting=True, draining=False,
                           nodes=self.nodes,
                           cores=8, cores_in_use=0, gpus=0, gpus_in_use=0, queue_depth=0,
                           running=0, trajectories=self.trajectories, apis={},
                           environments=1)  # fmt: skip

    def figures(self, base: str, token: str) -> PoolFigures:
        return self._figures()

    def reload(self, base: str, token: str, documents: str) -> list[str]:
        self._figures()
        self.pushed.append(documents)
        return []

    def drain(self, base: str, token: str, *, end: bool = False) -> PoolFigures:
        self.drained.append(f"{base} (end)" if end else base)
        return self._figures()


def _pool(**scheduler: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tangram.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "coding", "namespace": "rl"},
        "spec": {"cpu": {}, "scheduler": {"drainSeconds": 600, **scheduler}},
    }


@pytest.fixture
def world() -> tuple[Cluster, Link, Reconciler]:
    cluster, link = Cluster(), Link()
    return cluster, link, _reconciler(cluster, link)


def _reconciler(cluster: Cluster, link: Link) -> Reconciler:
    return Reconciler(cluster, image="tangram:test", link=link, clock=lambda: NOW)  # type: ignore[arg-type]


def _running(cluster: Cluster, link: Link, r: Reconciler, open_: int) -> dict[str, Any]:
    """A valid pool whose scheduler runs with ``open_`` trajectories, as its status says."""
    cluster.add(_pool())
    r.reconcile_pool("rl", "coding")
    cluster.objects["Deployment", "rl", "tangram-coding-scheduler"]["status"] = {
        "availableReplicas": 1
    }
    link.trajectories = open_
    r.reconcile_pool("rl", "coding")
    status: dict[str, Any] = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert status["trajectories"] == open_ and _ready(status)["reason"] == "Ready"
    return status


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    ready: list[dict[str, Any]] = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert len(ready) == 1
    return ready[0]


def _edit_invalid(cluster: Cluster) -> None:
    body = cluster.objects["ActionPool", "rl", "coding"]
    body["spec"]["scheduler"]["resources"] = {"requests": {"cpu": "lots"}}
    body["metadata"]["generation"] += 1


def test_an_edit_made_invalid_keeps_what_the_status_showed_of_the_running_scheduler(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    cluster, link, r = world
    before = _running(cluster, link, r, open_=7)
    _edit_invalid(cluster)
    r.reconcile_pool("rl", "coding")
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert _ready(status)["reason"] == "InvalidSpec"
    assert "requests.cpu: 'lots' is not a quantity" in _ready(status)["message"]
    assert status["endpoint"] == before["endpoint"] != ""
    assert (status["trajectories"], status["cores"]) == (7, 8)


@pytest.mark.parametrize("operator_restarted", [False, True])
def test_a_pool_edited_invalid_is_drained_before_it_goes(
    world: tuple[Cluster, Link, Reconciler], operator_restarted: bool
) -> None:
    """Its scheduler still runs the spec before the edit: its open trajectories may
    finish (within drainSeconds) before the pool's children are collected."""
    cluster, link, r = world
    _running(cluster, link, r, open_=7)
    _edit_invalid(cluster)
    r.reconcile_pool("rl", "coding")
    if operator_restarted:  # nothing of the valid spec left in memory: the body alone
        r = _reconciler(cluster, link)
    body = cluster.get_custom("ActionPool", "rl", "coding")
    assert body is not None
    body["metadata"]["deletionTimestamp"] = "2026-11-28T11:59:00Z"
    with pytest.raises(RetryError, match="7 trajectories open; 540 s left"):
        r.drain_pool(body)
    assert link.drained == ["http://tangram-coding-scheduler.rl.svc:8080"]
    link.trajectories = 0
    r.drain_pool(body)  # done: the finalizer goes


def test_a_drain_waits_for_a_restarted_scheduler_to_hear_from_its_agents(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    """A scheduler restarted mid-drain answered 0 trajectories before its agent's hello
    (a second later) told it of the open one: the drain ended and the pool's objects were
    collected under the trajectory. With no agent connected its 0 is no answer."""
    cluster, link, r = world
    _running(cluster, link, r, open_=1)
    body = cluster.get_custom("ActionPool", "rl", "coding")
    assert body is not None
    body["metadata"]["deletionTimestamp"] = "2026-11-28T11:59:00Z"
    with pytest.raises(RetryError, match="1 trajectories open"):
        r.drain_pool(body)
    body = cluster.get_custom("ActionPool", "rl", "coding")
    assert body is not None
    link.trajectories, link.nodes = 0, 0  # restarted: its agent not back yet
    with pytest.raises(RetryError, match="no node agent connected yet"):
        r.drain_pool(body)
    link.trajectories, link.nodes = 1, 1  # the agent's hello: the trajectory goes on
    with pytest.raises(RetryError, match="1 trajectories open"):
        r.drain_pool(body)
    link.trajectories = 0  # closed by its owner
    r.drain_pool(body)  # done: the finalizer goes


def test_a_drain_whose_time_ran_out_ends_the_schedulers_actions_before_it_goes(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    """Its children were collected with actions still running: they failed as the
    sandboxes vanished (``exec_failed``), saying nothing of the deletion."""
    cluster, link, r = world
    _running(cluster, link, r, open_=2)
    body = cluster.get_custom("ActionPool", "rl", "coding")
    assert body is not None
    body["metadata"]["deletionTimestamp"] = "2026-11-28T11:49:00Z"  # 660 s ago: 600 s drain
    r.drain_pool(body)  # no RetryError: the finalizer goes
    assert link.drained == ["http://tangram-coding-scheduler.rl.svc:8080",
                            "http://tangram-coding-scheduler.rl.svc:8080 (end)"]  # fmt: skip


def test_a_refresh_whose_body_a_pass_made_stale_reads_the_pool_again(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    """kopf's timer hands over the body it read before it waited for the pool's lock; a
    pass that wrote the status meanwhile makes that body stale."""
    cluster, link, r = world
    _running(cluster, link, r, open_=0)
    stale = cluster.get_custom("ActionPool", "rl", "coding")
    assert stale is not None
    link.down = True
    r.reconcile_pool("rl", "coding")  # the pass the timer waited for: now unreachable
    cluster.status_patches.clear()
    cluster.events.clear()
    r.refresh_pool("rl", "coding", stale)
    assert cluster.status_patches == []  # nothing new to write, and no Event again
    assert cluster.events == []


def test_a_spec_whose_child_the_api_server_refuses_is_invalid_and_not_ready(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    """pydantic lets through what only the API server knows to refuse (a child's field):
    the pool says so at that generation, its scheduler runs on with the spec before, and
    the status keeps its figures, not a Ready computed from the refused spec."""
    cluster, link, r = world
    _running(cluster, link, r, open_=3)
    children = copy.deepcopy({k: v for k, v in cluster.objects.items() if k[0] != "ActionPool"})
    cluster.refuse = "example.com/fpga"
    body = cluster.objects["ActionPool", "rl", "coding"]
    body["spec"]["scheduler"]["resources"] = {"limits": {"example.com/fpga": "1"}}
    body["spec"]["scheduler"]["port"] = 9090  # (its Service's port too: nothing applied)
    body["metadata"]["generation"] = 2
    r.reconcile_pool("rl", "coding")
    r.refresh_pool("rl", "coding", cluster.get_custom("ActionPool", "rl", "coding"))
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert (_ready(status)["reason"], status["observedGeneration"]) == ("InvalidSpec", 2)
    assert _ready(status)["message"] == (
        "the API server refused the spec's Deployment tangram-coding-scheduler: "
        "example.com/fpga is refused"
    )
    assert status["trajectories"] == 3
    # Nothing of the refused spec was applied (a restarted scheduler would read its
    # definitions from the ConfigMap), and its scheduler is asked where it runs.
    assert {k: v for k, v in cluster.objects.items() if k[0] != "ActionPool"} == children
    assert status["endpoint"] == "http://tangram-coding-scheduler.rl.svc:8080"
    body_now = cluster.get_custom("ActionPool", "rl", "coding")
    assert body_now is not None
    body_now["metadata"]["deletionTimestamp"] = "2026-11-28T11:59:00Z"
    with pytest.raises(RetryError):
        r.drain_pool(body_now)
    assert link.drained == ["http://tangram-coding-scheduler.rl.svc:8080"]
    cluster.refuse = None  # (the cluster now takes it: a device plugin came)
    body["metadata"]["generation"] = 3
    r.reconcile_pool("rl", "coding")
    assert _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])["reason"] == "Ready"


def test_a_new_pool_whose_child_is_refused_says_so_and_its_refreshes_write_nothing(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    cluster, _, r = world
    cluster.refuse = "example.com/fpga"
    pool = _pool(resources={"limits": {"example.com/fpga": "1"}})
    cluster.add(pool)
    r.reconcile_pool("rl", "coding")
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert _ready(status)["reason"] == "InvalidSpec" and status["endpoint"] == ""
    cluster.status_patches.clear()
    for _ in range(3):
        r.refresh_pool("rl", "coding", cluster.get_custom("ActionPool", "rl", "coding"))
    assert cluster.status_patches == []


def test_member_events_that_came_while_a_pass_waited_share_the_next_pass(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    """An operator's start (or ``kubectl apply -f envs/``) brings an event per member;
    those that came before a pass of their pool began are answered by it."""
    cluster, link, r = world
    _running(cluster, link, r, open_=0)
    names = [f"env-{i}" for i in range(6)]
    for name in names:
        cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                     "metadata": {"name": name, "namespace": "rl"},
                     "spec": {"poolRef": "coding", "image": "img"}})  # fmt: skip
    cluster.reads.clear()
    with r._lock(("rl", "coding")):  # a pass of the pool under way
        threads = [
            threading.Thread(target=r.reconcile_member, args=("TrajectoryEnv", "rl", n))
            for n in names
        ]
        for t in threads:
            t.start()
        while len(cluster.reads) < len(names):  # each has read its member: it waits
            time.sleep(0.01)
        cluster.lists = 0
    for t in threads:
        t.join(30)
    assert cluster.lists == 2  # one pass: a list of each member kind
    for name in names:
        status = cluster.objects["TrajectoryEnv", "rl", name]["status"]
        assert _ready(status)["reason"] == "Accepted"
    r.reconcile_member("TrajectoryEnv", "rl", names[0])  # one that comes later has its own
    assert cluster.lists == 4


def test_a_pool_left_without_node_agents_loses_their_grants_too(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    cluster, link, r = world
    _running(cluster, link, r, open_=0)
    agents = [("DaemonSet", "tangram-coding-cpu-agent"), ("Role", "tangram-coding-agent"),
              ("RoleBinding", "tangram-coding-agent"),
              ("NetworkPolicy", "tangram-coding-sandboxes")]  # fmt: skip
    assert all((kind, "rl", name) in cluster.objects for kind, name in agents)
    body = cluster.objects["ActionPool", "rl", "coding"]
    body["spec"] = {"apis": [{"name": "search", "concurrency": 4}]}
    r.reconcile_pool("rl", "coding")
    assert [k for k in agents if (k[0], "rl", k[1]) in cluster.objects] == []
    assert ("Role", "rl", "tangram-coding-scheduler") in cluster.objects  # the scheduler's stays


def test_a_member_event_is_not_answered_by_a_pass_that_failed_midway(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    cluster, link, r = world
    _running(cluster, link, r, open_=0)
    cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                 "metadata": {"name": "late", "namespace": "rl"},
                 "spec": {"poolRef": "coding", "image": "img"}})  # fmt: skip
    cluster.reads.clear()
    with r._lock(("rl", "coding")):
        member = threading.Thread(target=r.reconcile_member, args=("TrajectoryEnv", "rl", "late"))
        member.start()
        while not cluster.reads:  # it has read its member: it waits
            time.sleep(0.01)
        cluster.down = True
        with pytest.raises(RetryError):
            r.reconcile_pool("rl", "coding")  # began after the event came, and failed
        cluster.down = False
        cluster.objects["TrajectoryEnv", "rl", "late"].pop("status", None)
        cluster.lists = 0
    member.join(30)
    assert cluster.lists == 2  # its own pass
    assert _ready(cluster.objects["TrajectoryEnv", "rl", "late"]["status"])["reason"] == "Accepted"


# ---- what a pass may not claim (a push or an apply that did not get through) ---------------
class ReorderLink(Link):
    """A scheduler that re-orders its queue for an ordering change, as it takes it."""

    def reload(self, base: str, token: str, documents: str) -> list[str]:
        super().reload(base, token, documents)
        if "trajectory-priority" not in documents:
            return []
        return [
            "scheduling (spec.scheduling.ordering fcfs -> "
            "trajectory-priority: 3 queued actions re-ordered)"
        ]


def _edit(cluster: Cluster, **spec: Any) -> dict[str, Any]:
    body = cluster.objects["ActionPool", "rl", "coding"]
    body["spec"].update(spec)
    body["metadata"]["generation"] += 1
    return body


def _refresh(cluster: Cluster, r: Reconciler) -> dict[str, Any]:
    r.refresh_pool("rl", "coding", copy.deepcopy(cluster.objects["ActionPool", "rl", "coding"]))
    return _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])


def test_an_ordering_change_is_pushed_once_and_the_pool_stays_ready() -> None:
    """The scheduler applies an ordering change at once, queue or not: the pool is Ready
    after the push, and the push is not made again (no reason waits on the queue)."""
    cluster, link = Cluster(), ReorderLink()
    r = _reconciler(cluster, link)
    _running(cluster, link, r, open_=0)
    _edit(cluster, scheduling={"ordering": "trajectory-priority"})
    r.reconcile_pool("rl", "coding")
    cond = _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])
    assert (cond["status"], cond["reason"]) == ("True", "Ready")
    assert "trajectory-priority" in link.pushed[-1]
    pushes = len(link.pushed)
    for _ in range(2):
        assert _refresh(cluster, r)["reason"] == "Ready"
    assert len(link.pushed) == pushes  # taken whole: not pushed again


class FailingLink(Link):
    def __init__(self) -> None:
        super().__init__()
        self.failure: str | None = "POST x/v1/admin/reload: HTTP 413 request body over 1024 bytes"

    def reload(self, base: str, token: str, documents: str) -> list[str]:
        if self.failure is not None:
            raise SchedulerError(self.failure)
        return super().reload(base, token, documents)


def test_a_push_that_fails_otherwise_than_a_refusal_is_said_and_retried() -> None:
    cluster, link = Cluster(), FailingLink()
    r = _reconciler(cluster, link)
    cluster.add(_pool())
    cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                 "metadata": {"name": "swe", "namespace": "rl"},
                 "spec": {"poolRef": "coding", "image": "img"}})  # fmt: skip
    r.reconcile_pool("rl", "coding")
    cond = _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])
    assert (cond["status"], cond["reason"]) == ("False", "ConfigPushFailed")
    assert cond["message"].endswith("HTTP 413 request body over 1024 bytes")
    env = _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])
    assert (env["status"], env["reason"]) == ("False", "NotServed")
    assert "HTTP 413" in env["message"]
    link.failure = None
    assert _refresh(cluster, r)["reason"] == "Ready"  # pushed again, and taken
    assert _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])["reason"] == "Accepted"


def test_members_are_accepted_only_once_their_scheduler_took_them() -> None:
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    link.down = True  # the scheduler has not started yet
    cluster.add(_pool())
    cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                 "metadata": {"name": "swe", "namespace": "rl"},
                 "spec": {"poolRef": "coding", "image": "img"}})  # fmt: skip
    r.reconcile_member("TrajectoryEnv", "rl", "swe")
    env = _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])
    assert (env["status"], env["reason"]) == ("False", "NotServed")
    assert "connection refused" in env["message"]
    link.down = False
    _refresh(cluster, r)
    assert _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])["reason"] == "Accepted"


def test_a_member_of_a_name_another_namespace_serves_is_left_out_not_the_whole_pool() -> None:
    """A TrajectoryEnv of an admitted namespace named as one of the pool's own made every
    push refused ("TrajectoryEnvs of one name"), the owner's edits and new envs included,
    until it was deleted. Only the newcomer is left out now, saying why."""
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    pool = _pool()
    pool["spec"]["access"] = {"namespaces": ["eval"]}
    cluster.add(pool)

    def env(ns: str, name: str, created: str) -> None:
        cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                     "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
                     "spec": {"poolRef": "rl/coding", "image": f"{ns}-img"}})  # fmt: skip

    env("eval", "swe", "2026-01-01T00:00:00Z")  # older, but not the pool's namespace
    env("rl", "swe", "2026-02-01T00:00:00Z")
    env("eval", "other", "2026-03-01T00:00:00Z")
    env("rl", "other", "2026-03-02T00:00:00Z")  # (the owner's, made later: it wins)
    env("eval", "mine", "2026-03-03T00:00:00Z")
    env("eval", "mine2", "2026-03-04T00:00:00Z")
    r.reconcile_pool("rl", "coding")
    (pushed,) = link.pushed
    images = sorted(line.split()[-1] for line in pushed.splitlines() if "image:" in line)
    assert images == ["eval-img", "eval-img", "rl-img", "rl-img"]  # mine, mine2, rl's two
    for ns, name, reason in (("rl", "swe", "Accepted"), ("eval", "swe", "NameTaken"),
                             ("rl", "other", "Accepted"), ("eval", "other", "NameTaken"),
                             ("eval", "mine", "Accepted")):  # fmt: skip
        ready = _ready(cluster.objects["TrajectoryEnv", ns, name]["status"])
        assert ready["reason"] == reason, (ns, name, ready)
    taken = _ready(cluster.objects["TrajectoryEnv", "eval", "swe"]["status"])
    assert taken["message"].startswith("TrajectoryEnv rl/swe serves the name 'swe' in ")
    # A namespace admitted later, whose "mine" is older than the one served: the one
    # served keeps the name (its clients would silently open another team's image).
    env("late", "mine", "2025-01-01T00:00:00Z")
    cluster.objects["ActionPool", "rl", "coding"]["spec"]["access"]["namespaces"].append("late")
    r.reconcile_pool("rl", "coding")
    assert _ready(cluster.objects["TrajectoryEnv", "eval", "mine"]["status"])["reason"] == (
        "Accepted"
    )
    late = _ready(cluster.objects["TrajectoryEnv", "late", "mine"]["status"])
    assert late["reason"] == "NameTaken" and "TrajectoryEnv eval/mine serves" in late["message"]


def test_an_invalid_members_status_names_the_field_a_check_across_fields_found() -> None:
    """It read ``spec: Value error, actions[0].timeoutSeconds: ...``: pydantic's words, and
    the path stopped at the model whose check it was."""
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    cluster.add(_pool())
    cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                 "metadata": {"name": "swe", "namespace": "rl"},
                 "spec": {"poolRef": "coding", "image": "img", "maxCommandSeconds": 10,
                          "actions": [{"name": "t", "timeoutSeconds": 60}]}})  # fmt: skip
    r.reconcile_member("TrajectoryEnv", "rl", "swe")
    ready = _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])
    assert (ready["reason"], ready["message"]) == (
        "InvalidSpec",
        "spec.actions[0].timeoutSeconds: 60 s is over maxCommandSeconds (10 s)",
    )


def test_a_member_of_a_pool_whose_scheduler_refuses_the_push_is_not_accepted() -> None:
    class Refusing(Link):
        def reload(self, base: str, token: str, documents: str) -> list[str]:
            raise SchedulerRefusedError("reload refused: apis[search].secretRef: no Secret keys")

    cluster, link = Cluster(), Refusing()
    r = _reconciler(cluster, link)
    cluster.add(_pool())
    cluster.add({"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
                 "metadata": {"name": "swe", "namespace": "rl"},
                 "spec": {"poolRef": "coding", "image": "img"}})  # fmt: skip
    r.reconcile_member("TrajectoryEnv", "rl", "swe")
    assert _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])["reason"] == (
        "ConfigRefused"
    )
    env = _ready(cluster.objects["TrajectoryEnv", "rl", "swe"]["status"])
    assert (env["status"], env["reason"]) == ("False", "PoolConfigRefused")
    assert env["message"].endswith("no Secret keys")


def test_a_child_the_api_server_denies_is_said_on_a_new_pool_and_not_retried_each_pass() -> None:
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    applies: list[str] = []
    real = cluster.apply

    def apply(manifest: dict[str, Any], *, dry_run: bool = False) -> None:
        applies.append(manifest["kind"])
        if manifest["kind"] == "DaemonSet" and cluster.refuse == "deny":
            raise DeniedError(f"DaemonSet {manifest['metadata']['name']}: HTTP 403: admission "
                              'webhook "validation.gatekeeper.sh" denied the request')  # fmt: skip
        real(manifest, dry_run=dry_run)

    cluster.apply = apply  # type: ignore[method-assign]
    cluster.refuse = "deny"
    cluster.add(_pool())
    r.reconcile_pool("rl", "coding")
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    cond = _ready(status)
    assert (cond["status"], cond["reason"]) == ("False", "ChildDenied")
    assert (
        'DaemonSet tangram-coding-cpu-agent: HTTP 403: admission webhook "validation'
        in (cond["message"])
    )
    assert status["observedGeneration"] == 0  # nothing of generation 1 applied
    applies.clear()
    for _ in range(3):
        _refresh(cluster, r)
    assert applies == []  # until the spec changes, or the next full pass
    cluster.refuse = None
    _edit(cluster, scheduler={"drainSeconds": 60})
    r.reconcile_pool("rl", "coding")
    assert _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])["reason"] == "Ready"


def test_a_pool_whose_namespace_is_being_deleted_is_not_called_denied() -> None:
    """Seen on a real cluster (kubectl delete namespace): the pass re-applied children into
    the terminating namespace and the pool turned ChildDenied on the way out."""
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    cluster.add(_pool())
    r.reconcile_pool("rl", "coding")
    before = _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])
    real = cluster.apply

    def apply(manifest: dict[str, Any], *, dry_run: bool = False) -> None:
        if manifest["kind"] == "ConfigMap":
            raise DeniedError(f"ConfigMap {manifest['metadata']['name']}: HTTP 403: configmaps "
                              'is forbidden: unable to create new content in namespace rl '
                              "because it is being terminated")  # fmt: skip
        real(manifest, dry_run=dry_run)

    cluster.apply = apply  # type: ignore[method-assign]
    _edit(cluster, scheduler={"drainSeconds": 60})
    r.reconcile_pool("rl", "coding")
    after = _ready(cluster.objects["ActionPool", "rl", "coding"]["status"])
    assert after["reason"] != "ChildDenied" and after == before


def test_an_api_server_failure_is_retried_and_its_generation_not_claimed(
    world: tuple[Cluster, Link, Reconciler],
) -> None:
    cluster, link, r = world
    _running(cluster, link, r, open_=0)
    _edit(cluster, scheduling={"ordering": "trajectory-priority"})
    cluster.down = True
    with pytest.raises(RetryError, match="HTTP 500"):
        r.reconcile_pool("rl", "coding")  # the update handler's pass: retried
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert (_ready(status)["reason"], status["observedGeneration"]) == ("ApplyFailed", 1)
    with pytest.raises(RetryError):  # the timer's pass tries it whole, not the old documents
        r.refresh_pool("rl", "coding", copy.deepcopy(cluster.objects["ActionPool", "rl", "coding"]))
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert (_ready(status)["reason"], status["observedGeneration"]) == ("ApplyFailed", 1)
    cluster.down = False
    assert _refresh(cluster, r)["reason"] == "Ready"
    status = cluster.objects["ActionPool", "rl", "coding"]["status"]
    assert status["observedGeneration"] == 2
    assert "trajectory-priority" in link.pushed[-1]


class GpuLink(Link):
    def __init__(self) -> None:
        super().__init__()
        self.gpus = 0

    def _figures(self) -> PoolFigures:
        return self._figures_base().model_copy(update={"gpus": self.gpus})

    def _figures_base(self) -> PoolFigures:
        return Link._figures(self)


@pytest.mark.parametrize(
    ("ds_status", "says"),
    [
        ({"desiredNumberScheduled": 0}, "no node matches spec.gpu.nodeSelector"),
        (
            {"desiredNumberScheduled": 2, "currentNumberScheduled": 0},
            "agent pods created on 0 of 2 nodes",
        ),
        (
            {"desiredNumberScheduled": 1, "currentNumberScheduled": 1, "numberReady": 1},
            "found no GPU devices",
        ),
    ],
)
def test_a_pool_with_a_gpu_section_and_no_gpu_is_not_ready(
    ds_status: dict[str, int], says: str
) -> None:
    cluster, link = Cluster(), GpuLink()
    r = _reconciler(cluster, link)
    pool = _pool()
    pool["spec"]["gpu"] = {"nodeSelector": {"gpu": "yes"}}
    cluster.add(pool)
    r.reconcile_pool("rl", "coding")
    cluster.objects["DaemonSet", "rl", "tangram-coding-gpu-agent"]["status"] = ds_status
    cond = _refresh(cluster, r)
    assert (cond["status"], cond["reason"]) == ("False", "NoGpus")
    assert cond["message"].startswith("spec.gpu is set but the scheduler has no GPU (")
    assert says in cond["message"]
    link.gpus = 4
    assert _refresh(cluster, r)["reason"] == "Ready"


def test_no_nodes_says_when_the_agent_pods_could_not_be_created() -> None:
    """Pod Security admission refusing the privileged agents, not a nodeSelector."""
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    cluster.add(_pool())
    r.reconcile_pool("rl", "coding")
    cluster.objects["DaemonSet", "rl", "tangram-coding-cpu-agent"]["status"] = {
        "desiredNumberScheduled": 3, "currentNumberScheduled": 0, "numberReady": 0,
    }  # fmt: skip
    link_nodes = Link._figures

    def no_nodes(self: Link) -> PoolFigures:
        return link_nodes(self).model_copy(update={"nodes": 0})

    link._figures = no_nodes.__get__(link)  # type: ignore[method-assign]
    cond = _refresh(cluster, r)
    assert cond["reason"] == "NoNodes"
    assert "agent pods created on 0 of 3 nodes" in cond["message"]
    assert "Pod Security admission" in cond["message"]


@pytest.mark.parametrize("deployment", ["gone", "being deleted", "gone with its tokens"])
def test_a_foreground_deletion_ends_the_drain_at_once(
    world: tuple[Cluster, Link, Reconciler], deployment: str
) -> None:
    """The garbage collector deletes the children (blockOwnerDeletion) while the finalizer
    waits: no scheduler is left to drain, so the drain does not wait drainSeconds. Said
    also when the tokens Secret went first (on a real cluster it did, and nothing was)."""
    cluster, link, r = world
    _running(cluster, link, r, open_=7)
    key = ("Deployment", "rl", "tangram-coding-scheduler")
    if deployment.startswith("gone"):
        del cluster.objects[key]
    else:
        cluster.objects[key]["metadata"]["deletionTimestamp"] = "2026-11-28T11:59:30Z"
    if deployment == "gone with its tokens":
        del cluster.objects[("Secret", "rl", "tangram-coding-tokens")]
    link.down = True
    body = cluster.get_custom("ActionPool", "rl", "coding")
    assert body is not None
    body["metadata"]["deletionTimestamp"] = "2026-11-28T11:59:00Z"
    body["metadata"]["finalizers"] = ["foregroundDeletion", "tangram.dev/drain"]
    r.drain_pool(body)  # no RetryError: done
    assert any(reason == "DrainSkipped" and "foreground deletion" in message
               for reason, message in cluster.events)  # fmt: skip
    if deployment == "gone with its tokens":
        return  # (no token: no background drain either)
    body["metadata"]["finalizers"] = ["tangram.dev/drain"]  # background: waited for
    with pytest.raises(RetryError):
        r.drain_pool(body)


def _pod(name: str, node: str, labels: dict[str, str], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "rl", "labels": labels, **meta},
            "spec": {"nodeName": node}, "status": {"phase": "Running"}}  # fmt: skip


def _sandbox(name: str, node: str, owner: str = "uid-coding") -> dict[str, Any]:
    labels = {"tangram.dev/sandbox": "true", "tangram.dev/pool": "coding"}
    return _pod(name, node, labels, ownerReferences=[{"kind": "ActionPool", "uid": owner}])


def _agent(node: str, role: str = "cpu") -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "arl-tangram", "app.kubernetes.io/instance": "coding",
              "app.kubernetes.io/component": "node-agent",
              "tangram.dev/agent-role": role}  # fmt: skip
    return _pod(f"{role}-agent-{node}", node, labels)


def test_sandboxes_on_a_node_without_an_agent_go_after_the_agents_grace() -> None:
    """A node that left the pool (its agent pod gone for good): its sandbox pods are
    deleted once agentGraceSeconds passed, with a Warning Event naming the node; those of
    a node with an agent, of another pool of the same name, and a node whose agent came
    back in time are left alone. A GPU agent takes no sandbox back: b's does not count."""
    cluster, link = Cluster(), Link()
    now = [NOW]
    r = Reconciler(cluster, image="tangram:test", link=link,  # type: ignore[arg-type]
                   clock=lambda: now[0])  # fmt: skip
    cluster.add(_pool(agentGraceSeconds=60))
    for pod in (_agent("a"), _agent("b", role="gpu"), _sandbox("sb-a", "a"), _sandbox("sb-b1", "b"),
                _sandbox("sb-b2", "b"), _sandbox("sb-c", "c"),
                _sandbox("old-b", "b", owner="uid-of-an-earlier-pool")):  # fmt: skip
        cluster.add(pod)

    def left() -> set[str]:
        return {name for kind, _, name in cluster.objects if kind == "Pod"}

    r.refresh_pool("rl", "coding")  # b and c seen without an agent: their grace starts
    now[0] += dt.timedelta(seconds=30)
    cluster.add(_agent("c"))  # c's agent is back within the grace
    r.refresh_pool("rl", "coding")
    now[0] += dt.timedelta(seconds=29)
    r.refresh_pool("rl", "coding")
    assert left() == {
        "cpu-agent-a",
        "cpu-agent-c",
        "gpu-agent-b",
        "sb-a",
        "sb-b1",
        "sb-b2",
        "sb-c",
        "old-b",
    }
    assert not any(reason == "OrphanedSandboxesDeleted" for reason, _ in cluster.events)
    now[0] += dt.timedelta(seconds=1)
    r.refresh_pool("rl", "coding")
    assert left() == {"cpu-agent-a", "cpu-agent-c", "gpu-agent-b", "sb-a", "sb-c", "old-b"}
    (message,) = [m for reason, m in cluster.events if reason == "OrphanedSandboxesDeleted"]
    assert "2 sandbox pod(s) on node b (sb-b1, sb-b2)" in message and "60 s" in message
    # c's agent goes for good: its grace starts anew, not from when it was first away.
    del cluster.objects["Pod", "rl", "cpu-agent-c"]
    r.refresh_pool("rl", "coding")
    assert "sb-c" in left()
    now[0] += dt.timedelta(seconds=60)
    r.refresh_pool("rl", "coding")
    assert left() == {"cpu-agent-a", "gpu-agent-b", "sb-a", "old-b"}


def test_an_api_server_that_fails_the_sandbox_sweep_leaves_the_pods_for_the_next_one() -> None:
    cluster, link = Cluster(), Link()
    now = [NOW]
    r = Reconciler(cluster, image="tangram:test", link=link,  # type: ignore[arg-type]
                   clock=lambda: now[0])  # fmt: skip
    cluster.add(_pool(agentGraceSeconds=0))
    cluster.add(_sandbox("sb-b", "b"))
    r.reconcile_pool("rl", "coding")
    cluster.down = True
    r.refresh_pool("rl", "coding")  # the full pass's apply fails, and so does the list
    assert ("Pod", "rl", "sb-b") in cluster.objects
    cluster.down = False
    r.refresh_pool("rl", "coding")
    assert ("Pod", "rl", "sb-b") not in cluster.objects


def test_a_sandbox_whose_delete_fails_does_not_hide_those_deleted_beside_it() -> None:
    cluster, link = Cluster(), Link()
    r = _reconciler(cluster, link)
    cluster.add(_pool(agentGraceSeconds=0))
    for name in ("sb-1", "sb-2", "sb-3"):
        cluster.add(_sandbox(name, "b"))
    deleting = cluster.delete_pod

    def delete_pod(namespace: str, name: str) -> bool:
        if name == "sb-2":
            raise ApiServerError("deleting pod sb-2: HTTP 500: etcd timeout")
        return deleting(namespace, name)

    cluster.delete_pod = delete_pod  # type: ignore[method-assign]
    r.refresh_pool("rl", "coding")
    assert {name for kind, _, name in cluster.objects if kind == "Pod"} == {"sb-2"}
    (message,) = [m for reason, m in cluster.events if reason == "OrphanedSandboxesDeleted"]
    assert "2 sandbox pod(s) on node b (sb-1, sb-3)" in message
    cluster.delete_pod = deleting  # type: ignore[method-assign]
    r.refresh_pool("rl", "coding")  # tried again at the next sweep
    assert not any(kind == "Pod" for kind, _, _ in cluster.objects)
