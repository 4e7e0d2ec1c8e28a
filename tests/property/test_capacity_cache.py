"""The pool's capacity a tenant's share is of (``Scheduler._capacity``) is summed once and
kept until what it sums changes: nodes join (cores, GPUs or both) or are drained, are
cordoned, quotas come, go (a removed one once nothing needs it) or take new limits. Over
random sequences of those changes, with actions submitted, started, cancelled and ended
in between (a removed quota goes when its last action does), both of its answers equal
the sum over the pool as it is, read after every step so a kept one that went stale
shows."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tangram.api import ApiSpec
from tangram.scheduler import Scheduler, SchedulingError
from tangram.scheduler.core.resource import GPU, Resource
from tangram.scheduler.core.shares import POOL_CORES, TenantShare

from ..unit.helpers import api_call, cluster, exec_action

NODES = ["a", "b", "c"]
QUOTAS = ["q1", "q2"]


def summed(s: Scheduler, *, cordoned: bool) -> dict[Resource, int]:
    """What ``_capacity`` should answer, summed over the pool as it is now."""
    cpu_out = set() if cordoned else s.cpu.cordoned
    gpu_out = set() if cordoned else s.gpu.cordoned
    out = {
        POOL_CORES: sum(n.cores for name, n in s.cpu.nodes.items() if name not in cpu_out),
        GPU: sum(n.gpus for name, n in s.gpu.nodes.items() if name not in gpu_out),
    }
    for name, q in s.quotas.items():
        if q.concurrency is not None:
            out[Resource.api(name)] = q.concurrency
    return out


quota_specs = st.dictionaries(
    st.sampled_from(QUOTAS), st.one_of(st.none(), st.integers(1, 4)), max_size=len(QUOTAS)
)
steps = st.one_of(
    st.tuples(st.just("cpu"), st.sampled_from(NODES), st.sampled_from([0, 2, 4, 8])),
    st.tuples(st.just("gpu"), st.sampled_from(NODES), st.sampled_from([1, 2, 4, 8])),
    st.tuples(st.just("cordon"), st.sampled_from(NODES)),
    st.tuples(st.just("drain"), st.sampled_from(NODES)),
    st.tuples(st.just("quotas"), quota_specs),
    st.tuples(st.just("tenants"), st.sampled_from([1.0, 0.5])),
    st.tuples(st.just("call"), st.sampled_from(QUOTAS), st.sampled_from(["", "capped"])),
    st.tuples(st.just("exec"), st.sampled_from(NODES), st.sampled_from(["", "capped"])),
    st.tuples(st.just("round")),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("complete")),
)


# A removed quota an action still needs goes when that action leaves the queue or ends:
# rare in random sequences (it takes a limit, a call of it, the removal, then its end).
RETIRED = [("quotas", {"q2": 2}), ("call", "q2", ""), ("quotas", {})]


@settings(max_examples=300, deadline=None)
@given(st.lists(steps, max_size=40))
@example([*RETIRED, ("cancel",)])
@example([*RETIRED[:2], ("round",), *RETIRED[2:], ("complete",)])
def test_the_kept_capacity_is_the_pools_after_every_change(ops: list[tuple[Any, ...]]) -> None:
    s = Scheduler(cluster(nodes=[{"name": "a", "cpus": 4, "memory_gb": 8}], apis=[{"name": "q1"}]))
    for n, op in enumerate(ops):
        now = float(n)
        kind = op[0]
        try:
            if kind == "cpu":
                s.add_node(op[1], cores=op[2], memory_gb=8)
            elif kind == "gpu":
                s.add_gpu_node(op[1], gpus=op[2], memory_gb=80)
            elif kind == "cordon":
                s.cordon_node(op[1])
            elif kind == "drain":
                s.drain_node(op[1])
            elif kind == "quotas":
                s.set_quotas(
                    [ApiSpec(name=q, concurrency=c, rate_per_s=5.0) for q, c in op[1].items()]
                )
            elif kind == "tenants":
                s.set_tenants({}, default=TenantShare(max_share=op[1]))
            elif kind == "call":
                s.open_trajectory(f"t{n}", tenant=op[2])
                s.submit(f"x{n}", f"t{n}", api_call(op[1]), now=now)
            elif kind == "exec":
                s.open_trajectory(f"t{n}", memory_gb=1, tenant=op[2])
                s.place_trajectory(f"t{n}", op[1])
                s.submit(f"x{n}", f"t{n}", exec_action(1, t1=1.0), now=now)
            elif kind == "round":
                s.schedule(now)
            elif kind == "cancel" and s.actions:
                s.cancel(min(s.actions))
            elif kind == "complete" and s.running:
                s.complete(min(s.running), now=now)
        except SchedulingError:
            pass  # (a step the pool refuses as it is)
        for cordoned in (False, True):
            assert dict(s._capacity(cordoned=cordoned)) == summed(s, cordoned=cordoned), op
