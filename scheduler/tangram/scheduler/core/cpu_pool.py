"""CPU manager bookkeeping (seed 000 §5.2, "Pool in CPU Manager").

Each core is held by at most one action. A trajectory is placed on its first
action's node — one with cores for that action and memory for the whole
trajectory, balancing memory load — and stays there. Core sets are chosen
NUMA-aware: within one NUMA node when possible (best fit), otherwise over the
fewest NUMA nodes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(slots=True)
class CpuNode:
    name: str
    numa: list[list[int]]  # free core ids per NUMA node, ascending
    cores: int
    memory_gb: float
    memory_used_gb: float = 0.0
    holders: int = 0  # actions holding cores here (the core price counts them)
    trajectories: int = 0  # placed here (the core price's offered load counts them)

    @property
    def free_cores(self) -> int:
        return sum(len(s) for s in self.numa)

    @property
    def free_memory_gb(self) -> float:
        return self.memory_gb - self.memory_used_gb


_NONE: Mapping[str, float] = MappingProxyType({})


@dataclass(slots=True)
class CpuPool:
    nodes: dict[str, CpuNode] = field(default_factory=dict)
    placement: dict[str, str] = field(default_factory=dict)  # trajectory -> node
    reserved_gb: dict[str, float] = field(default_factory=dict)  # trajectory -> memory
    # Nodes that take no new work (their agent said it stops): no trajectory is placed
    # there; what runs there goes on (``Scheduler.cordon_node``).
    cordoned: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, nodes: Iterable[tuple[str, int, int, float]]) -> CpuPool:
        """From ``(name, cores, numa_nodes, memory_gb)``; cores are split evenly over NUMA nodes."""
        pool = cls()
        for name, cores, numa_nodes, memory_gb in nodes:
            pool.add(name, cores, numa_nodes, memory_gb)
        return pool

    def add(self, name: str, cores: int, numa_nodes: int, memory_gb: float) -> None:
        if cores <= 0:
            return
        per = cores // numa_nodes
        numa = [list(range(i * per, (i + 1) * per)) for i in range(numa_nodes)]
        self.nodes[name] = CpuNode(name, numa, cores, memory_gb)

    def choose_node(
        self,
        memory_gb: float,
        min_cores: int,
        free: Mapping[str, int],
        used_gb: Mapping[str, float] = _NONE,
    ) -> str | None:
        """A node for a new trajectory: enough free cores now and memory for its whole life.

        ``free`` overrides the free-core counts and ``used_gb`` the memory in use (the
        round's provisional view). Among fitting nodes the one with the largest free memory
        fraction wins (memory load balancing); ties go to the name for determinism. A
        cordoned node is never chosen.
        """
        best: tuple[float, str] | None = None
        cordoned = self.cordoned
        for node in self.nodes.values():
            if free.get(node.name, node.free_cores) < min_cores:
                continue
            if cordoned and node.name in cordoned:
                continue
            free_gb = node.memory_gb - used_gb.get(node.name, node.memory_used_gb)
            if free_gb + 1e-9 < memory_gb:
                continue
            frac = free_gb / node.memory_gb if node.memory_gb else 0.0
            key = (-frac, node.name)
            if best is None or key < (best[0], best[1]):
                best = key
        return None if best is None else best[1]

    def memory_fits_somewhere(
        self, memory_gb: float, used_gb: Mapping[str, float] = _NONE
    ) -> list[str]:
        """The nodes (not cordoned) with ``memory_gb`` free for a new trajectory."""
        return [
            n.name
            for n in self.nodes.values()
            if n.memory_gb - used_gb.get(n.name, n.memory_used_gb) + 1e-9 >= memory_gb
            and n.name not in self.cordoned
        ]

    def place(self, trajectory: str, node: str, memory_gb: float) -> None:
        if trajectory in self.placement:
            raise ValueError(
                f"trajectory {trajectory} is already placed on {self.placement[trajectory]}"
            )
        cpu = self.nodes[node]
        cpu.memory_used_gb += memory_gb
        cpu.trajectories += 1
        self.placement[trajectory] = node
        self.reserved_gb[trajectory] = memory_gb

    def unplace(self, trajectory: str) -> None:
        node = self.placement.pop(trajectory, None)
        if node is not None:
            cpu = self.nodes[node]
            cpu.memory_used_gb -= self.reserved_gb.pop(trajectory)
            cpu.trajectories -= 1

    def take(self, node: str, n: int) -> tuple[int, ...]:
        """Take ``n`` free cores of ``node``: one NUMA node (best fit) if possible, else fewest."""
        cpu = self.nodes[node]
        if n > cpu.free_cores:
            raise ValueError(f"node {node}: {n} cores requested, {cpu.free_cores} free")
        fitting = [i for i, s in enumerate(cpu.numa) if len(s) >= n]
        if fitting:
            order = [min(fitting, key=lambda i: (len(cpu.numa[i]), i))]
        else:
            order = sorted(range(len(cpu.numa)), key=lambda i: (-len(cpu.numa[i]), i))
        taken: list[int] = []
        for i in order:
            want = n - len(taken)
            if want == 0:
                break
            taken.extend(cpu.numa[i][:want])
            del cpu.numa[i][:want]
        cpu.holders += 1
        return tuple(sorted(taken))

    def take_exact(self, node: str, cores: Iterable[int]) -> tuple[int, ...]:
        """Take these very cores (an adopted action already runs on them)."""
        cpu = self.nodes[node]
        per = cpu.cores // len(cpu.numa)
        wanted = sorted(set(cores))
        for c in wanted:
            bucket = cpu.numa[c // per] if 0 <= c < cpu.cores else []
            if c not in bucket:
                raise ValueError(f"node {node}: core {c} is not free")
        for c in wanted:
            cpu.numa[c // per].remove(c)
        cpu.holders += 1
        return tuple(wanted)

    def give_back(self, node: str, cores: Iterable[int]) -> None:
        cpu = self.nodes[node]
        per = cpu.cores // len(cpu.numa)
        for c in cores:
            bucket = cpu.numa[c // per]
            i = bisect.bisect_left(bucket, c)
            if i < len(bucket) and bucket[i] == c:
                raise ValueError(f"node {node}: core {c} returned twice")
            bucket.insert(i, c)
        cpu.holders -= 1


@dataclass(slots=True)
class PlannedPlacements:
    """A round's placements before it commits them: the pool's own plus those it plans.

    Planning reads placement and memory through this view and changes nothing in the pool;
    the commit then places ``planned`` in order, so memory adds up exactly as planned.
    """

    pool: CpuPool
    planned: dict[str, str] = field(default_factory=dict)  # trajectory -> node, in order
    used_gb: dict[str, float] = field(default_factory=dict)  # node -> memory used with them

    def node_of(self, trajectory: str) -> str | None:
        node = self.pool.placement.get(trajectory)
        return node if node is not None else self.planned.get(trajectory)

    def place(self, trajectory: str, node: str, memory_gb: float) -> None:
        before = self.used_gb.get(node, self.pool.nodes[node].memory_used_gb)
        self.used_gb[node] = before + memory_gb
        self.planned[trajectory] = node
