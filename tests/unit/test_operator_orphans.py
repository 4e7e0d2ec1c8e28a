"""Which sandbox pods no agent of their pool will take back: the pure decision."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tangram.operator.orphans import agent_nodes, sandbox_nodes, sweep

T0 = dt.datetime(2026, 11, 29, 9, 0, tzinfo=dt.UTC)


def _pod(node: str | None = None, phase: str = "Running", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", **meta}, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase}}  # fmt: skip


def _pinned(node: str) -> dict[str, Any]:
    """A DaemonSet's pod the scheduler has not bound yet: its affinity names its node."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}  # fmt: skip
    return {"metadata": {"name": "p"}, "spec": {"affinity": affinity},
            "status": {"phase": "Pending"}}  # fmt: skip


def test_an_agent_pod_attends_its_node_until_it_ended_or_is_gone() -> None:
    """One being deleted still runs, connected, until it is gone (a rollout's old pod)."""
    pods = [_pod("running"), _pod("pending", phase="Pending"), _pinned("unbound"),
            _pod("failed", phase="Failed"), _pod("done", phase="Succeeded"),
            _pod("going", deletionTimestamp="2026-11-29T09:00:00Z"), _pod(None)]  # fmt: skip
    assert agent_nodes(pods) == {"running", "pending", "unbound", "going"}


def test_sandboxes_are_the_pools_own_and_not_already_going() -> None:
    def sandbox(name: str, uid: str, **meta: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "ownerReferences": [{"uid": uid}], **meta},
                "spec": {"nodeName": "n"}}  # fmt: skip

    pods = [sandbox("mine", "u1"), sandbox("earlier-pool", "u0"),
            sandbox("going", "u1", deletionTimestamp="2026-11-29T09:00:00Z"),
            {"metadata": {"name": "no-owner"}, "spec": {"nodeName": "n"}}]  # fmt: skip
    assert sandbox_nodes(pods, "u1") == {"mine": "n"}


def test_a_node_waits_out_its_grace_from_when_it_was_first_seen_without_an_agent() -> None:
    sandboxes = {"a1": "a", "b1": "b", "b2": "b"}
    first = sweep(sandboxes, {"a"}, {}, T0, 60)
    assert first.delete == {} and first.waiting == {"b": T0}
    early = sweep(sandboxes, {"a"}, first.waiting, T0 + dt.timedelta(seconds=59), 60)
    assert early.delete == {} and early.waiting == {"b": T0}
    due = sweep(sandboxes, {"a"}, early.waiting, T0 + dt.timedelta(seconds=60), 60)
    assert due.delete == {"b": ["b1", "b2"]}
    # Still listed at the next sweep (the delete failed): deleted again, no new grace.
    assert due.waiting == {"b": T0}


def test_an_agent_back_or_no_sandbox_left_ends_the_wait() -> None:
    waiting = {"b": T0, "c": T0}
    later = T0 + dt.timedelta(seconds=600)
    found = sweep({"b1": "b"}, {"b"}, waiting, later, 60)
    assert found.delete == {} and found.waiting == {}


def test_grace_zero_deletes_at_the_first_sweep() -> None:
    assert sweep({"b1": "b"}, set(), {}, T0, 0).delete == {"b": ["b1"]}


_STEPS = st.tuples(st.integers(0, 50), st.frozensets(st.sampled_from("abc")))


@given(st.lists(_STEPS, min_size=1, max_size=30), st.integers(0, 120))
def test_a_sandbox_goes_only_after_its_node_had_no_agent_for_the_whole_grace(
    steps: list[tuple[int, frozenset[str]]], grace: int
) -> None:
    """Against the definition, sweep by sweep: a node's pods are deleted exactly when every
    sweep since its agent was last seen (or since the first) found it without one, and the
    first of those was ``grace`` seconds ago or more."""
    sandboxes = {f"{n}1": n for n in "abc"}
    now, waiting = T0, dict[str, dt.datetime]()
    history: list[tuple[dt.datetime, frozenset[str]]] = []
    for gap, attended in steps:
        now += dt.timedelta(seconds=gap)
        history.append((now, attended))
        found = sweep(sandboxes, set(attended), waiting, now, grace)
        waiting = found.waiting
        for node in "abc":
            away_since = None
            for at, seen in history:
                away_since = None if node in seen else (away_since or at)
            expected = away_since is not None and (now - away_since).total_seconds() >= grace
            assert found.delete.get(node, []) == ([f"{node}1"] if expected else [])
