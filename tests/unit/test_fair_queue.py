"""Fair queuing between tenants: a tenant alone keeps the pool's order, tenants share by
weight within the start-time fair queuing bound, and none starves another."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler.core.fair import FairQueue
from tangram.scheduler.core.ordering import FifoQueue

costs = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)


class _Queue(FairQueue):
    """A fair queue whose actions' work is given with them."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.costs: dict[str, float] = {}
        weights = weights or {}
        super().__init__(FifoQueue, lambda t: weights.get(t, 1.0), work=self.costs.__getitem__)

    def add(self, aid: str, seq: int, tenant: str, cost: float) -> None:
        self.costs[aid] = cost
        self.push(aid, (), seq, None, tenant=tenant)


def _queue(weights: dict[str, float] | None = None) -> _Queue:
    return _Queue(weights)


def _serve(q: FairQueue, n: int) -> list[str]:
    """Start the head ``n`` times, as rounds with one free unit would."""
    served = []
    for _ in range(n):
        head = next(q.order(0.0))
        q.started(head)
        served.append(head)
    return served


@given(st.lists(costs, min_size=1, max_size=40))
def test_a_tenant_alone_is_served_in_the_pools_order(work: list[float]) -> None:
    q = _queue()
    for i, c in enumerate(work):
        q.add(f"a{i}", i, "t", c)
    assert list(q.order(0.0)) == [f"a{i}" for i in range(len(work))]
    # order() takes a shortcut for one tenant; the tags it skips agree with it.
    assert [aid for *_, aid in q.tags(0.0)] == [f"a{i}" for i in range(len(work))]
    assert _serve(q, len(work)) == [f"a{i}" for i in range(len(work))]


@given(
    st.lists(st.tuples(st.sampled_from("ABC"), costs), min_size=1, max_size=60),
    st.integers(min_value=0, max_value=60),
)
def test_each_tenant_keeps_its_own_order_and_nothing_is_lost(
    pushes: list[tuple[str, float]], starts: int
) -> None:
    q = _queue({"A": 1.0, "B": 2.0, "C": 0.5})
    for i, (t, c) in enumerate(pushes):
        q.add(f"{t}{i}", i, t, c)
    served = _serve(q, min(starts, len(pushes)))
    left = list(q.order(0.0))
    assert sorted(served + left) == sorted(f"{t}{i}" for i, (t, _) in enumerate(pushes))
    for t in "ABC":  # first come first served inside a tenant
        mine = [int(a[1:]) for a in served + left if a[0] == t]
        assert mine == sorted(mine)


@settings(max_examples=200)
@given(
    st.floats(min_value=0.25, max_value=4.0),
    st.lists(costs, min_size=30, max_size=30),
    st.lists(costs, min_size=30, max_size=30),
    st.integers(min_value=1, max_value=40),
)
def test_backlogged_tenants_share_by_weight_within_the_sfq_bound(
    w_b: float, costs_a: list[float], costs_b: list[float], n: int
) -> None:
    """Goyal et al.'s bound: while both wait, the work each got over its weight differs
    by at most one largest action of each over its weight."""
    q = _queue({"A": 1.0, "B": w_b})
    for i, (ca, cb) in enumerate(zip(costs_a, costs_b, strict=True)):
        q.add(f"A{i}", 2 * i, "A", ca)
        q.add(f"B{i}", 2 * i + 1, "B", cb)
    got = {"A": 0.0, "B": 0.0}
    cost = {f"A{i}": c for i, c in enumerate(costs_a)} | {f"B{i}": c for i, c in enumerate(costs_b)}
    for aid in _serve(q, n):
        got[aid[0]] += cost[aid]
    if any(a[0] == "A" for a in q.order(0.0)) and any(a[0] == "B" for a in q.order(0.0)):
        bound = max(costs_a) / 1.0 + max(costs_b) / w_b
        assert abs(got["A"] / 1.0 - got["B"] / w_b) <= bound + 1e-9


def test_a_flooding_tenant_does_not_make_a_newcomer_wait_behind_its_backlog() -> None:
    q = _queue()
    for i in range(100):
        q.add(f"flood{i}", i, "flooder", 1.0)
    _serve(q, 10)  # it has been served for a while
    q.add("mine", 100, "newcomer", 1.0)
    assert next(q.order(0.0)) == "mine"  # no banked credit for the flooder's backlog


def test_an_idle_tenant_does_not_bank_credit() -> None:
    q = _queue()
    for i in range(20):
        q.add(f"a{i}", i, "A", 1.0)
    _serve(q, 20)  # A alone for a long time: B was idle, and earns nothing by it
    for i in range(4):
        q.add(f"a{20 + i}", 20 + i, "A", 1.0)
        q.add(f"b{i}", 30 + i, "B", 1.0)
    assert [a[0] for a in _serve(q, 8)] == ["b", "a", "b", "a", "b", "a", "b", "a"]


def test_removing_an_action_unserved_charges_nobody() -> None:
    q = _queue()
    q.add("a0", 0, "A", 5.0)
    q.add("b0", 1, "B", 1.0)
    q.remove("a0")  # cancelled
    q.add("a1", 2, "A", 1.0)
    assert list(q.order(0.0)) == ["b0", "a1"]  # equal tags: submission order decides
    assert {aid: tag for tag, _, aid in q.tags(0.0)} == {"b0": 0.0, "a1": 0.0}
    assert "a0" not in q and len(q) == 2
