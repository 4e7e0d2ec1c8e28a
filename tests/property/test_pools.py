"""Resource managers of seed 000 §5: GPU buddy chunks, CPU cores/NUMA/memory, API quotas."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tangram.scheduler.core.cpu_pool import CpuPool
from tangram.scheduler.core.dp import CHUNK_SIZES, chunk_level, take_chunk
from tangram.scheduler.core.gpu_pool import Chunk, GpuGrant, GpuPool, Instance
from tangram.scheduler.core.quota_pool import Quota

SETTINGS = settings(max_examples=200, deadline=None)
EPS = 1e-6

# ======================================================================================
# GPU pool
# ======================================================================================


@dataclass
class GpuModel:
    """What the test knows independently of the pool: who holds what, the LRU order."""

    busy: dict[Instance, int] = field(default_factory=dict)  # running instance -> its calls
    lru: list[Instance] = field(default_factory=list)  # least recently used first


def free_chunks(pool: GpuPool, node: str) -> list[Chunk]:
    n = pool.nodes[node]
    return [Chunk(node, start, size) for size in CHUNK_SIZES for start in n.free[size]]


def contains(outer: Chunk, inner: Chunk) -> bool:
    return outer.node == inner.node and outer.start <= inner.start < outer.start + outer.size


def overlaps(a: Chunk, b: Chunk) -> bool:
    return a.node == b.node and not set(a.gpus).isdisjoint(b.gpus)


def check_gpu_invariants(pool: GpuPool, model: GpuModel) -> None:
    for name, node in pool.nodes.items():
        free = free_chunks(pool, name)
        busy = [i.chunk for i in model.busy if i.chunk.node == name]
        for c in free + busy:
            assert c.size in CHUNK_SIZES
            assert c.start % c.size == 0, f"unaligned chunk {c}"
            assert c.start >= 0 and c.start + c.size <= node.gpus, f"chunk {c} outside the node"
        chunks = free + busy
        for i, a in enumerate(chunks):
            for b in chunks[i + 1 :]:
                assert not overlaps(a, b), f"{a} overlaps {b}"
        # Every GPU is either in a free chunk or a busy one.
        assert sum(c.size for c in chunks) == node.gpus
        # Buddies are merged: no free chunk has its free buddy next to it.
        for c in free:
            if c.size < node.gpus:
                assert (c.start ^ c.size) not in node.free[c.size], f"unmerged buddies at {c}"
        # GPU memory: exactly the resident instances' shares, never over capacity.
        for g in range(node.gpus):
            expected = sum(
                pool.memory_gb[i.service] / i.chunk.size
                for i in pool.resident
                if i.chunk.node == name and g in i.chunk.gpus
            )
            assert node.used_gb[g] == pytest.approx(expected, abs=EPS)
            assert node.used_gb[g] <= node.memory_gb + EPS
    assert pool.busy == model.busy
    assert set(pool.busy) <= set(pool.resident), "a busy instance is not resident"
    for inst, calls in pool.busy.items():
        assert 1 <= calls <= pool.max_calls.get(inst.service, 1), f"{inst}: {calls} calls"
    assert list(pool.resident) == model.lru
    counts = [0, 0, 0, 0]
    for name in pool.nodes:
        for c in free_chunks(pool, name):
            counts[CHUNK_SIZES.index(c.size)] += 1
    assert pool.chunk_counts() == tuple(counts)


def snapshot(pool: GpuPool) -> tuple[object, ...]:
    return (
        {n: {s: set(v) for s, v in node.free.items()} for n, node in pool.nodes.items()},
        {n: list(node.used_gb) for n, node in pool.nodes.items()},
        list(pool.resident),
        dict(pool.busy),
    )


def check_allocation(
    pool: GpuPool, model: GpuModel, service: str, k: int, before: tuple[object, ...]
) -> None:
    """Allocate and check the grant against the rules, stated from the state before."""
    size = chunk_level(k)
    counts = pool.chunk_counts()
    free_before = [c for n in pool.nodes for c in free_chunks(pool, n)]
    per_gpu = pool.memory_gb[service] / size
    # Only nodes whose GPUs can hold the instance at all are considered.
    usable = [c for c in free_before if pool.nodes[c.node].memory_gb + EPS >= per_gpu]
    levels = [c.size for c in usable if c.size >= size]
    resident_before = list(pool.resident)
    used_before = {n: list(node.used_gb) for n, node in pool.nodes.items()}
    if not levels:
        event("gpu: no free chunk that can hold it")
        if not any(c.size >= size for c in free_before):
            assert take_chunk(counts, k) is None
        assert not pool.can_host(service, k)
        with pytest.raises(ValueError):
            pool.allocate(service, k)
        assert snapshot(pool) == before, "a failed allocation changed the pool"
        return
    level = min(levels)
    smallest_overall = min(c.size for c in free_before if c.size >= size)
    at_level = [c for c in usable if c.size == level]
    hits = [
        i
        for i in resident_before
        if i.service == service
        and i.chunk.size == size
        and i not in model.busy
        and any(contains(c, i.chunk) for c in at_level)
    ]
    assert pool.can_host(service, k)

    grant: GpuGrant = pool.allocate(service, k)
    chunk = grant.chunk
    assert chunk.size == size
    # Best fit: the chunk was carved out of a free chunk of the smallest fitting level.
    assert any(contains(c, chunk) for c in at_level), f"{chunk} not from a level-{level} chunk"
    if level == smallest_overall:  # chunk counts cannot see per-node GPU memory
        assert pool.chunk_counts() == take_chunk(counts, k)
    inst = Instance(service, chunk)
    # Residency: a free chunk of that level holding an idle instance of the service wins.
    assert grant.resident == bool(hits)
    event(f"gpu: resident={grant.resident} evicted={min(len(grant.evicted), 2)}")
    if hits:
        assert inst in hits
        assert grant.evicted == ()
        model.lru.remove(inst)
    else:
        node = pool.nodes[chunk.node]

        def excess(c: Chunk) -> float:
            n = pool.nodes[c.node]
            return sum(max(0.0, used_before[c.node][g] + per_gpu - n.memory_gb) for g in c.gpus)

        # Among the level's aligned positions on nodes that can hold it, the one that
        # needs the least resident memory evicted.
        positions = [
            Chunk(c.node, sub, size)
            for c in at_level
            if pool.nodes[c.node].memory_gb + EPS >= per_gpu
            for sub in range(c.start, c.start + c.size, size)
        ]
        assert node.memory_gb + EPS >= per_gpu
        least = min(excess(c) for c in positions)
        assert excess(chunk) == pytest.approx(least)
        if least > EPS:
            # Among equal evictions, the position whose newest resident is the oldest.
            def newest(c: Chunk) -> int:
                return max(
                    (i for i, r in enumerate(resident_before) if overlaps(r.chunk, c)), default=-1
                )

            tied = [c for c in positions if excess(c) == pytest.approx(least)]
            assert newest(chunk) == min(newest(c) for c in tied)
        victims = list(grant.evicted)

        def short(evicted: list[Instance]) -> set[int]:
            """The chunk's GPUs still lacking room once ``evicted`` are gone."""
            out = set()
            for g in chunk.gpus:
                used = used_before[chunk.node][g] - sum(
                    pool.memory_gb[v.service] / v.chunk.size for v in evicted if g in v.chunk.gpus
                )
                if used + per_gpu > node.memory_gb + EPS:
                    out.add(g)
            return out

        for i, v in enumerate(victims):
            assert v not in model.busy, f"busy instance {v} evicted"
            # Each victim frees a GPU that still lacked room when it was taken.
            assert short(victims[:i]) & set(v.chunk.gpus), f"{v} evicted but not needed"
        # LRU: victims are taken oldest first, and an older idle instance is skipped only
        # when none of its GPUs still lacked room.
        ages = [resident_before.index(v) for v in victims]
        assert ages == sorted(ages)
        if victims:
            for age, older in enumerate(resident_before[: ages[-1]]):
                if older in model.busy or older in victims or older.chunk.node != chunk.node:
                    continue
                earlier = [v for v, a in zip(victims, ages, strict=True) if a < age]
                assert not short(earlier) & set(older.chunk.gpus), f"kept older {older}"
        # ... and eviction stops as soon as the restore fits.
        assert not short(victims)
        for v in victims:
            model.lru.remove(v)
    model.lru.append(inst)
    model.busy[inst] = 1


def check_join(pool: GpuPool, model: GpuModel, service: str, k: int) -> None:
    """A call joins the running DoP-k instance of ``service`` with the fewest calls (the
    first started among those), or, with none that has room, is refused unchanged."""
    size, room = chunk_level(k), pool.max_calls.get(service, 1)
    open_ = [
        i
        for i, n in model.busy.items()
        if i.service == service and i.chunk.size == size and n < room
    ]
    before = snapshot(pool)
    if not open_:
        event("join: no room")
        assert pool.joinable(service, k) is None
        for full in [i for i in model.busy if i.service == service and i.chunk.size == size]:
            with pytest.raises(ValueError):
                pool.allocate(service, k, join=full.chunk)
        assert snapshot(pool) == before, "a refused join changed the pool"
        return
    fewest = min(model.busy[i] for i in open_)
    inst = next(i for i in open_ if model.busy[i] == fewest)
    assert pool.joinable(service, k) == inst
    grant = pool.allocate(service, k, join=inst.chunk)
    event(f"join: sharing {min(fewest, 2)}")
    assert (grant.chunk, grant.resident, grant.evicted, grant.sharing) == (
        inst.chunk,
        True,
        (),
        fewest,
    )
    # No chunk and no memory changes hands; the instance is the most recently used.
    assert {n: list(node.used_gb) for n, node in pool.nodes.items()} == before[1]
    model.busy[inst] += 1
    model.lru.remove(inst)
    model.lru.append(inst)


gpu_pools = st.tuples(
    # (GPUs, memory per GPU) per node: nodes may differ in both.
    st.lists(
        st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([24.0, 40.0, 80.0])),
        min_size=1,
        max_size=3,
    ),
    # Footprints as fractions of 40 GB: sharing, eviction and refusals all occur.
    st.lists(st.sampled_from([0.1, 0.3, 0.45, 0.6, 0.9, 1.5, 3.0]), min_size=1, max_size=4),
)


@SETTINGS
@given(gpu_pools, st.data())
def test_gpu_pool_random_allocate_release(
    shape: tuple[list[tuple[int, float]], list[float]], data: st.DataObject
) -> None:
    nodes, footprints = shape
    services = {f"s{i}": f * 40.0 for i, f in enumerate(footprints)}
    max_calls = {s: data.draw(st.sampled_from([1, 2, 3]), label=f"{s} max calls") for s in services}
    pool = GpuPool.build(
        ((f"g{i}", n, mem) for i, (n, mem) in enumerate(nodes)), services, max_calls=max_calls
    )
    model = GpuModel()
    check_gpu_invariants(pool, model)
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(
            st.sampled_from(["alloc"] * 4 + ["join"] * 2 + ["release"] * 3 + ["evict_all"])
        )
        if op in ("alloc", "join"):
            service = data.draw(st.sampled_from(sorted(services)), label="service")
            k = data.draw(st.sampled_from([1, 1, 2, 2, 3, 4, 5, 8]), label="k")
            if op == "alloc":
                check_allocation(pool, model, service, k, snapshot(pool))
            else:
                check_join(pool, model, service, k)
        elif op == "release" and model.busy:
            inst = data.draw(st.sampled_from(list(model.busy)), label="release")
            free_before = pool.chunk_counts()
            pool.release(inst.service, inst.chunk)
            model.busy[inst] -= 1
            if model.busy[inst]:  # the chunk stays with the instance's other calls
                assert pool.chunk_counts() == free_before
            else:
                del model.busy[inst]
        elif op == "evict_all":
            service = data.draw(st.sampled_from(sorted(services)), label="evict")
            pool.evict_all(service)
            model.lru = [i for i in model.lru if i.service != service or i in model.busy]
        check_gpu_invariants(pool, model)
    # Releasing everything merges each node back into one chunk.
    for inst, calls in list(model.busy.items()):
        for _ in range(calls):
            pool.release(inst.service, inst.chunk)
            model.busy[inst] -= 1
        del model.busy[inst]
        check_gpu_invariants(pool, model)
    for name, node in pool.nodes.items():
        assert free_chunks(pool, name) == [Chunk(name, 0, node.gpus)]


def test_gpu_allocation_prefers_the_chunk_holding_the_instance() -> None:
    pool = GpuPool.build([("g", 8, 80.0)], {"a": 10.0, "s": 10.0})
    a = pool.allocate("a", 1)
    s = pool.allocate("s", 1)
    assert (a.chunk.start, s.chunk.start) == (0, 1)
    pool.release("a", a.chunk)
    pool.release("s", s.chunk)
    assert pool.chunk_counts() == (0, 0, 0, 1)
    # Cold, `s` would get GPU 0 (the leftmost); resident on GPU 1, it goes back there.
    again = pool.allocate("s", 1)
    assert again.chunk == Chunk("g", 1, 1)
    assert again.resident and again.evicted == ()
    pool.release("s", again.chunk)
    cold = pool.allocate("s", 2)  # a DoP-2 instance is a distinct instance: not resident
    assert cold.chunk == Chunk("g", 0, 2) and not cold.resident


def test_gpu_allocation_same_level_resident_chunk_beats_leftmost() -> None:
    pool = GpuPool.build([("g", 4, 80.0)], {"a": 10.0, "s": 10.0})
    grants = [pool.allocate("a", 1), pool.allocate("a", 1), pool.allocate("s", 1)]
    assert [g.chunk.start for g in grants] == [0, 1, 2]
    busy3 = pool.allocate("a", 1)
    pool.release("a", grants[0].chunk)
    pool.release("s", grants[2].chunk)
    # Free singles now: GPU 0 (cold for s) and GPU 2 (s resident): same level, s goes to 2.
    assert pool.chunk_counts() == (2, 0, 0, 0)
    assert pool.allocate("s", 1).chunk == Chunk("g", 2, 1)
    assert busy3.chunk == Chunk("g", 3, 1)


def test_gpu_eviction_is_least_recently_used() -> None:
    pool = GpuPool.build([("g", 1, 80.0)], {"a": 40.0, "b": 40.0, "c": 40.0})
    for svc in ("a", "b"):
        g = pool.allocate(svc, 1)
        assert g.evicted == ()
        pool.release(svc, g.chunk)
    g = pool.allocate("c", 1)  # 80 GB used: one of a, b must go, the older one
    assert [i.service for i in g.evicted] == ["a"]
    pool.release("c", g.chunk)
    g = pool.allocate("b", 1)  # a hit refreshes b
    assert g.resident
    pool.release("b", g.chunk)
    g = pool.allocate("a", 1)  # now c is the least recently used
    assert [i.service for i in g.evicted] == ["c"]


def test_gpu_eviction_leaves_instances_on_gpus_with_room() -> None:
    pool = GpuPool.build([("g", 2, 10.0)], {"a": 4.0, "b": 8.0, "c": 8.0})
    for svc, k in (("a", 1), ("b", 1)):  # a on GPU 0, then b on GPU 1
        pool.release(svc, pool.allocate(svc, k).chunk)
    pool.replicated.add("c")  # 8 GB on each GPU of a DoP-2 chunk: b must go, a too
    assert {i.service for i in pool.allocate("c", 2).evicted} == {"a", "b"}
    pool = GpuPool.build([("g", 2, 10.0)], {"a": 4.0, "b": 8.0, "c": 8.0})
    for svc in ("a", "b"):
        pool.release(svc, pool.allocate(svc, 1).chunk)
    # Sharded c: 4 GB a GPU. GPU 0 holds a (4 GB) and has room; only b (GPU 1) goes,
    # though a is the least recently used.
    assert [i.service for i in pool.allocate("c", 2).evicted] == ["b"]


def test_a_nodes_residency_is_synced_from_its_worker() -> None:
    pool = GpuPool.build([("g", 4, 10.0), ("h", 1, 10.0)], {"a": 4.0, "b": 4.0, "big": 8.0})
    other = pool.allocate("a", 1)  # h's single GPU: the smallest free level
    running = pool.allocate("b", 1)  # g:0, its call still running
    idle = pool.allocate("a", 1)  # g:1
    pool.release("a", idle.chunk)
    assert (other.chunk.node, running.chunk, idle.chunk) == (
        "h",
        Chunk("g", 0, 1),
        Chunk("g", 1, 1),
    )
    pool.sync_node(
        "g",
        [
            ("b", 2, 1),  # reported: resident
            ("nope", 3, 1),  # an unknown service
            ("a", 1, 2),  # not a buddy chunk
            ("a", 2, 4),  # beyond the node's GPUs
            ("big", 2, 1),  # would overfill GPU 2 next to b
            ("a", 3, 1),
        ],
    )
    b2, a3 = Instance("b", Chunk("g", 2, 1)), Instance("a", Chunk("g", 3, 1))
    # Idle instances are the reported ones (a on g:1 is gone); busy ones are their calls'.
    assert set(pool.resident) == {Instance("a", other.chunk), Instance("b", running.chunk), b2, a3}
    assert pool.nodes["g"].used_gb == [4.0, 0.0, 4.0, 4.0]
    # Of unknown recency: older than everything this scheduler saw used, in reported order.
    assert list(pool.resident)[:2] == [b2, a3]
    # A GPU with a call running is left as it is: the report may predate the call.
    pool = GpuPool.build([("g", 1, 10.0)], {"a": 4.0, "b": 4.0, "big": 8.0})
    pool.release("a", pool.allocate("a", 1).chunk)
    pool.allocate("b", 1)
    before = (list(pool.resident), list(pool.nodes["g"].used_gb))
    pool.sync_node("g", [("big", 0, 1)])
    assert (list(pool.resident), pool.nodes["g"].used_gb) == before


def test_gpu_evict_all_keeps_busy_instances() -> None:
    pool = GpuPool.build([("g", 2, 80.0)], {"a": 10.0})
    busy = pool.allocate("a", 1)
    idle = pool.allocate("a", 1)
    pool.release("a", idle.chunk)
    pool.evict_all("a")
    assert list(pool.resident) == [Instance("a", busy.chunk)]
    assert pool.nodes["g"].used_gb == [10.0, 0.0]


def test_gpu_allocation_avoids_a_node_too_small_for_the_service() -> None:
    pool = GpuPool.build([("a", 1, 80.0), ("b", 1, 24.0)], {"warm": 60.0, "x": 40.0})
    g = pool.allocate("warm", 1)
    pool.release("warm", g.chunk)
    assert pool.fits("x", 1)
    # b is empty but its 24 GB can never hold x; a can, by evicting `warm`.
    grant = pool.allocate("x", 1)
    assert grant.chunk == Chunk("a", 0, 1)
    assert grant.evicted == (Instance("warm", Chunk("a", 0, 1)),)


def test_gpu_allocation_prefers_an_empty_gpu_to_evicting() -> None:
    pool = GpuPool.build([("g", 2, 80.0)], {"warm": 60.0, "x": 40.0})
    g = pool.allocate("warm", 1)
    pool.release("warm", g.chunk)
    assert g.chunk == Chunk("g", 0, 1)
    # GPU 0 holds `warm`; GPU 1 is empty: x goes to GPU 1 and nothing is evicted.
    grant = pool.allocate("x", 1)
    assert grant.chunk == Chunk("g", 1, 1) and grant.evicted == ()


def test_gpu_allocation_over_memory_is_refused_without_side_effects() -> None:
    pool = GpuPool.build([("g", 8, 24.0)], {"big": 40.0})
    before = snapshot(pool)
    assert not pool.fits("big", 1)
    assert pool.fits("big", 2)
    with pytest.raises(ValueError):
        pool.allocate("big", 1)
    assert snapshot(pool) == before
    assert pool.allocate("big", 2).chunk == Chunk("g", 0, 2)


# ======================================================================================
# CPU pool
# ======================================================================================


cpu_nodes = st.lists(
    st.tuples(st.sampled_from([1, 2, 4]), st.integers(1, 6), st.sampled_from([0.0, 8.0, 32.0])),
    min_size=1,
    max_size=3,
)


def build_cpu(spec: list[tuple[int, int, float]]) -> CpuPool:
    return CpuPool.build(
        (f"n{i}", numa * per, numa, mem) for i, (numa, per, mem) in enumerate(spec)
    )


def min_numa_nodes(free: list[int], n: int) -> int:
    total, used = 0, 0
    for f in sorted(free, reverse=True):
        if total >= n:
            break
        total += f
        used += 1
    return used


@SETTINGS
@given(cpu_nodes, st.data())
def test_cpu_take_give_back(spec: list[tuple[int, int, float]], data: st.DataObject) -> None:
    pool = build_cpu(spec)
    held: dict[int, tuple[str, tuple[int, ...]]] = {}
    for step in range(data.draw(st.integers(1, 30), label="ops")):
        name = data.draw(st.sampled_from(sorted(pool.nodes)), label="node")
        node = pool.nodes[name]
        per = node.cores // len(node.numa)
        give_back = bool(held) and data.draw(st.booleans(), label="give back")
        if give_back:
            key = data.draw(st.sampled_from(sorted(held)), label="holder")
            hname, cores = held.pop(key)
            pool.give_back(hname, cores)
            with pytest.raises(ValueError):
                pool.give_back(hname, cores[:1])
        else:
            n = data.draw(st.integers(1, node.cores + 1), label="n")
            free_before = [set(s) for s in node.numa]
            if n > node.free_cores:
                with pytest.raises(ValueError):
                    pool.take(name, n)
                assert [set(s) for s in node.numa] == free_before
            else:
                cores = pool.take(name, n)
                assert len(cores) == n == len(set(cores))
                assert all(c in free_before[c // per] for c in cores), (
                    "took a core that was not free"
                )
                used = sorted({c // per for c in cores})
                counts = [len(s) for s in free_before]
                fitting = [i for i, f in enumerate(counts) if f >= n]
                if fitting:
                    # One NUMA node, the best fit: fewest free cores among those that fit.
                    assert used == [min(fitting, key=lambda i: (counts[i], i))]
                else:
                    assert len(used) == min_numa_nodes(counts, n)
                held[step] = (name, cores)
        # No core is free and held, none is held twice, none is lost.
        for nm, nd in pool.nodes.items():
            holders = [c for h, cs in held.values() if h == nm for c in cs]
            free = [c for s in nd.numa for c in s]
            assert len(holders) == len(set(holders))
            assert sorted(holders + free) == list(range(nd.cores))


def test_cpu_take_numa_rules() -> None:
    pool = CpuPool.build([("n", 8, 2, 16.0)])  # NUMA 0: cores 0-3, NUMA 1: cores 4-7
    first = pool.take("n", 3)
    assert first == (0, 1, 2)
    # NUMA 0 has 1 free, NUMA 1 has 4: a 1-core task goes to the fuller NUMA node 0.
    assert pool.take("n", 1) == (3,)
    # Two cores fit in NUMA 1 only.
    assert pool.take("n", 2) == (4, 5)
    pool.give_back("n", (0, 1, 2, 3))
    # NUMA 0 has 4 free, NUMA 1 has 2: 5 cores span both, the larger first.
    assert pool.take("n", 5) == (0, 1, 2, 3, 6)
    with pytest.raises(ValueError):
        pool.take("n", 2)


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 16), st.sampled_from([0.0, 4.0, 10.0, 16.0])),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_cpu_choose_node_balances_memory(
    spec: list[tuple[int, float]], data: st.DataObject
) -> None:
    pool = CpuPool.build((f"n{i}", max(c, 1), 1, m) for i, (c, m) in enumerate(spec))
    for t in range(data.draw(st.integers(1, 12), label="trajectories")):
        mem = data.draw(st.sampled_from([0.0, 1.0, 2.5, 4.0, 8.0]), label="mem")
        min_cores = data.draw(st.integers(1, 4), label="cores")
        free = {
            n: data.draw(st.integers(0, node.cores), label=f"free {n}")
            for n, node in pool.nodes.items()
        }
        expected = [
            n
            for n, node in pool.nodes.items()
            if free[n] >= min_cores and node.free_memory_gb + 1e-9 >= mem
        ]

        def frac(n: str) -> float:
            node = pool.nodes[n]
            return node.free_memory_gb / node.memory_gb if node.memory_gb else 0.0

        got = pool.choose_node(mem, min_cores, free)
        if not expected:
            assert got is None
        else:
            assert got == min(expected, key=lambda n: (-frac(n), n))
            assert got in pool.memory_fits_somewhere(mem)
            pool.place(f"t{t}", got, mem)
            with pytest.raises(ValueError):
                pool.place(f"t{t}", got, mem)
        for node in pool.nodes.values():
            assert node.memory_used_gb <= node.memory_gb + 1e-6
            placed = sum(
                pool.reserved_gb[tid] for tid, n in pool.placement.items() if n == node.name
            )
            assert node.memory_used_gb == pytest.approx(placed)
    for tid in list(pool.placement):
        pool.unplace(tid)
    pool.unplace("never-placed")
    for node in pool.nodes.values():
        assert node.memory_used_gb == pytest.approx(0.0, abs=1e-9)


def test_cpu_choose_node_prefers_free_memory_fraction_then_name() -> None:
    pool = CpuPool.build([("a", 8, 1, 10.0), ("b", 8, 1, 20.0), ("c", 2, 1, 100.0)])
    free = {"a": 8, "b": 8, "c": 2}
    assert pool.choose_node(1.0, 4, free) == "a"  # c lacks the cores; a, b tie on fraction
    pool.place("t1", "a", 5.0)
    assert pool.choose_node(1.0, 4, free) == "b"
    assert pool.choose_node(1.0, 2, free) == "b"  # b and c tie on fraction 1.0: by name
    pool.place("t2", "b", 1.0)
    assert pool.choose_node(1.0, 2, free) == "c"
    assert pool.choose_node(50.0, 1, free) == "c"
    assert pool.choose_node(50.0, 1, {"c": 0}) is None
    assert pool.choose_node(200.0, 1, free) is None


# ======================================================================================
# Quotas
# ======================================================================================


def in_window(starts: list[float], now: float, period: float) -> int:
    """Calls counted at ``now``: those that started within the last ``period`` seconds."""
    return sum(1 for s in starts if s + period > now)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.none(), st.integers(1, 4)),
    st.one_of(st.none(), st.integers(1, 4)),
    st.floats(min_value=0.01, max_value=10.0, allow_nan=False),
    st.data(),
)
def test_quota_limits_and_next_window(
    concurrency: int | None, per_period: int | None, period: float, data: st.DataObject
) -> None:
    q = Quota("q", concurrency, per_period, period)
    now = data.draw(st.floats(min_value=0.0, max_value=100.0), label="t0")
    starts: list[float] = []
    in_use = 0
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        now += data.draw(
            st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=2 * period)), label="dt"
        )
        rate_room = (per_period - in_window(starts, now, period)) if per_period else 1 << 30
        conc_room = (concurrency - in_use) if concurrency else 1 << 30
        assert q.free(now) == max(0, min(rate_room, conc_room, 1 << 30))
        assert rate_room >= 0 and conc_room >= 0
        wake = q.next_expiry_s(now)
        inside = in_window(starts, now, period)
        if per_period is not None and inside > 0:
            assert wake is not None and wake > now
            # Exactly when the oldest call stops counting: at `wake`, not a moment earlier.
            earlier = math.nextafter(wake, -math.inf)
            assert in_window(starts, wake, period) < inside
            assert in_window(starts, earlier, period) == inside
            if rate_room <= 0:
                probe = Quota("q", None, per_period, period, starts=q.starts.copy())
                assert probe.free(earlier) == 0
                assert probe.free(wake) >= 1
        else:
            assert wake is None
        op = data.draw(st.sampled_from(["acquire", "acquire", "release"]), label="op")
        if op == "acquire":
            n = data.draw(st.integers(1, 3), label="n")
            if n > q.free(now):
                with pytest.raises(ValueError):
                    q.acquire(now, n)
            else:
                q.acquire(now, n)
                in_use += n
                starts.extend([now] * n)
        else:
            n = data.draw(st.integers(1, 3), label="release")
            if n > in_use:
                with pytest.raises(ValueError):
                    q.release(n)
            else:
                q.release(n)
                in_use -= n
        assert q.in_use == in_use
        if concurrency is not None:
            assert in_use <= concurrency
        if per_period is not None:
            assert in_window(starts, now, period) <= per_period


def test_quota_rate_window_reopens_exactly_at_the_expiry() -> None:
    # 62.3503056144171 + 2.5 - 2.5 < 62.3503056144171 in floating point: a window check
    # written as `start <= now - period` would still count the call at the reported time.
    q = Quota("q", None, 1, 2.5)
    q.acquire(62.3503056144171, 1)
    q.release(1)
    wake = q.next_expiry_s(63.0)
    assert wake == 62.3503056144171 + 2.5
    assert q.free(math.nextafter(wake, -math.inf)) == 0
    assert q.free(wake) == 1
    assert q.next_expiry_s(wake) is None


def test_quota_concurrency_blocks_without_a_window() -> None:
    q = Quota("q", 2, None, 1.0)
    q.acquire(0.0, 2)
    assert q.free(5.0) == 0
    assert q.next_expiry_s(5.0) is None  # waiting on a release, not on time
    q.release(1)
    assert q.free(5.0) == 1
    with pytest.raises(ValueError):
        q.release(2)


def test_a_multi_unit_wait_gets_a_wake_up_until_it_fits() -> None:
    # 2 calls per second, one already started: an action needing both waits for the window
    # to drain, and the scheduler must be told when (review finding: it was told nothing).
    from tangram.api import ActionSpec, ClusterSpec
    from tangram.scheduler import Scheduler

    s = Scheduler(
        ClusterSpec.model_validate(
            {"nodes": [{"name": "n"}], "apis": [{"name": "search", "rate_per_s": 2}]}
        )
    )
    s.open_trajectory("t")
    s.submit("one", "t", ActionSpec.model_validate({"kind": "api", "api": "search"}), 0.0)
    s.schedule(0.0)
    s.complete("one", 0.1)
    two = ActionSpec.model_validate({"kind": "api", "api": "search", "quotas": {"search": 1}})
    s.submit("two", "t", two, 0.2)
    r = s.schedule(0.2)
    assert r.assignments == () and r.wake_at == 1.0
    assert [a.action_id for a in s.schedule(1.0).assignments] == ["two"]


def test_fractional_rates_are_never_exceeded() -> None:
    from tangram.api import ApiSpec

    assert ApiSpec(name="a", rate_per_s=0.5).window() == (1, 2.0)  # one call per 2 s
    assert ApiSpec(name="a", rate_per_s=1.5, period_s=1.0).window() == (1, 1 / 1.5)
    assert ApiSpec(name="a", rate_per_s=100, period_s=1.0).window() == (100, 1.0)
    assert ApiSpec(name="a", concurrency=3).window() is None


def _ahead(pool: GpuPool, service: str) -> Instance:
    """Restore ``service`` ahead for a DoP-1 call at 0 s (2 s): the instance, which must be."""
    got = pool.restore_ahead(service, 1, now=0.0, restore_s=2.0)
    assert got is not None
    return got[0]


def test_a_restore_ahead_takes_only_free_memory() -> None:
    pool = GpuPool.build([("g", 1, 80.0)], {"a": 40.0, "b": 60.0, "c": 30.0})
    pool.release("a", pool.allocate("a", 1).chunk)  # a idle, resident: 40 of 80 GB
    assert pool.restore_ahead("b", 1, now=0.0, restore_s=2.0) is None  # would evict a
    assert pool.restore_ahead("c", 1, now=0.0, restore_s=2.0) == (
        Instance("c", Chunk("g", 0, 1)),
        2.0,
    )
    inst = Instance("c", Chunk("g", 0, 1))
    assert pool.nodes["g"].used_gb == [70.0] and list(pool.resident)[-1] == inst
    assert pool.restore_ahead("c", 1, now=0.0, restore_s=2.0) is None  # resident already


def test_restores_ahead_on_the_same_gpus_queue_for_their_host_links() -> None:
    pool = GpuPool.build([("g", 2, 80.0)], {"a": 10.0, "b": 10.0, "c": 10.0})
    assert pool.restore_ahead("a", 2, now=1.0, restore_s=2.0) == (
        Instance("a", Chunk("g", 0, 2)),
        3.0,
    )
    # b's chunk shares GPU 0 with a's: it starts when a's copy ends.
    assert pool.restore_ahead("b", 1, now=1.5, restore_s=1.0) == (
        Instance("b", Chunk("g", 0, 1)),
        4.0,
    )


def test_an_instance_restored_ahead_is_never_evicted_until_done() -> None:
    pool = GpuPool.build([("g", 1, 80.0)], {"a": 40.0, "big": 50.0})
    inst = _ahead(pool, "a")
    # big would need a evicted, which is still being copied: no chunk for big yet, and
    # nothing changes (no over-committed GPU).
    assert not pool.can_host("big", 1)
    with pytest.raises(ValueError):
        pool.allocate("big", 1)
    pool.evict_all("a")
    assert inst in pool.resident and pool.nodes["g"].used_gb == [40.0]
    pool.ahead_done(inst)
    grant = pool.allocate("big", 1)
    assert grant.evicted == (inst,) and pool.nodes["g"].used_gb == [50.0]


def test_a_call_on_an_instance_restored_ahead_keeps_it() -> None:
    pool = GpuPool.build([("g", 1, 80.0)], {"a": 40.0}, max_calls={"a": 2})
    inst = _ahead(pool, "a")
    grant = pool.allocate("a", 1)  # lands on it: a hit, waiting for the rest of the copy
    assert grant.resident and grant.chunk == inst.chunk
    pool.release("a", inst.chunk)  # it ended first (its restore ahead decides)
    assert inst in pool.resident and inst in pool.ahead
    pool.ahead_done(inst)
    assert inst in pool.resident and not pool.ahead and pool.chunk_counts() == (1, 0, 0, 0)


def test_a_restore_ahead_that_failed_or_went_stale_is_dropped() -> None:
    pool = GpuPool.build([("g", 2, 80.0)], {"a": 40.0})
    failed = _ahead(pool, "a")
    pool.ahead_done(failed, resident=False)
    assert failed not in pool.resident and pool.nodes["g"].used_gb == [0.0, 0.0]
    stale = _ahead(pool, "a")
    pool.set_service("a", 40.0, replicated=False, revision="v2")  # redefined meanwhile
    assert stale in pool.resident  # its memory is still being written
    pool.ahead_done(stale)
    assert not pool.resident and pool.nodes["g"].used_gb == [0.0, 0.0] and not pool.stale
