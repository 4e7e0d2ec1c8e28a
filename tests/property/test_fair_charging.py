"""Fair queuing charges the work done, not the work declared.

Two tenants of equal weight keep a pool busy (each always has actions waiting); one
declares less work than its actions do (a tiny ``t1_s``, or none), the other the truth or
nothing. The declared work orders the starts only: when an action ends, its tenant pays
the units it held times the seconds it ran (``FairQueue.ended``). So whatever either
declares, the unit-seconds each has been served stay within a bound of each other: what
each may hold running before it is charged (the pool's cores, times the largest action's
work) and one largest action of each (the start-time fair queuing bound). Declared work
alone would let the liar take the pool (it got 399 starts to 1 before).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.scheduler import Scheduler

from ..unit.helpers import cluster, exec_action

Work = list[tuple[int, float]]  # each action's (cores, seconds), cycled


def _serve(cores: int, work: dict[str, Work], declared: dict[str, float | None]) -> float:
    """Run the closed loop (two trajectories per core per tenant, each submitting again as
    its action ends) for 100 completions; the largest gap between the tenants' served
    unit-seconds (at the completions) seen on the way. ``declared``: each action declares
    that factor of its real duration as ``t1_s`` (None: nothing)."""
    s = Scheduler(cluster(nodes=[{"name": "n", "cpus": cores, "memory_gb": 64}]))
    taken = dict.fromkeys(work, 0)
    truth: dict[str, tuple[int, float]] = {}
    served = dict.fromkeys(work, 0.0)
    ends: list[tuple[float, str, str]] = []
    now = 0.0

    def submit(tid: str) -> None:
        tenant = tid.partition("-")[0]
        k, d = work[tenant][taken[tenant] % len(work[tenant])]
        taken[tenant] += 1
        factor = declared[tenant]
        aid = f"a{len(truth)}"
        truth[aid] = (k, d)
        t1 = None if factor is None else factor * d
        s.submit(aid, tid, exec_action(k, t1, type_=tenant), now)

    for tenant in work:
        for i in range(2 * cores):
            s.open_trajectory(f"{tenant}-{i}", tenant=tenant)
            s.place_trajectory(f"{tenant}-{i}", "n")
            submit(f"{tenant}-{i}")
    gap = 0.0
    for _ in range(100):
        for asg in s.schedule(now).assignments:
            ends.append((now + truth[asg.action_id][1], asg.action_id, asg.trajectory))
        ends.sort()
        now, aid, tid = ends.pop(0)
        s.complete(aid, now)
        k, d = truth[aid]
        served[tid.partition("-")[0]] += k * d
        gap = max(gap, abs(served["liar"] - served["honest"]))
        submit(tid)
    return gap


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=1, max_value=4).flatmap(
        lambda cores: st.tuples(
            st.just(cores),
            *(
                st.lists(
                    st.tuples(st.integers(1, cores), st.floats(0.1, 5.0)), min_size=1, max_size=8
                )
                for _ in range(2)
            ),
        )
    ),
    st.sampled_from([1e-6, 1e-3, 0.1, None]),
    st.sampled_from([1.0, None]),
)
def test_a_tenant_declaring_less_work_gets_no_more_than_its_share(
    pool: tuple[int, Work, Work], liar: float | None, honest: float | None
) -> None:
    cores, liar_work, honest_work = pool
    work = {"liar": liar_work, "honest": honest_work}
    largest = max(k * d for w in work.values() for k, d in w)
    gap = _serve(cores, work, {"liar": liar, "honest": honest})
    assert gap <= (cores + 2) * largest + 1e-9
