"""GPU manager bookkeeping (seed 000 §5.3, "Pool in GPU Manager").

GPUs of a node form buddy chunks ``(start, size)`` with ``size`` in 1/2/4/8 and
``start`` a multiple of ``size``. A service at DoP k is a distinct instance occupying
one chunk of size k; instances stay resident after their call and are evicted
least-recently-used when another restore needs the memory. Among free chunks of the
smallest fitting level, one that already holds the requested instance is preferred.

A chunk runs one instance at a time. That instance may serve up to its service's
``max_calls`` calls at once (our addition, as an inference server batches): a call
*joins* a running instance instead of taking a chunk of its own, and the chunk is free
again when the instance's last call ends.

Instances may also be *restored ahead* (our addition): into GPU memory that is free,
evicting nothing, on the chunk the allocator would give the service's next call, while
that chunk is free for any call. Until its restore ends such an instance is pinned like a
running one; a call that lands on it waits for the rest of the restore instead of a whole
one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from tangram.scheduler.core.dp import CHUNK_SIZES, ChunkState, chunk_level


@dataclass(frozen=True, slots=True)
class Chunk:
    node: str
    start: int
    size: int

    @property
    def gpus(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True, slots=True)
class Instance:
    service: str
    chunk: Chunk


@dataclass(frozen=True, slots=True)
class GpuGrant:
    chunk: Chunk
    resident: bool  # the instance was already in GPU memory: no restore
    evicted: tuple[Instance, ...]
    sharing: int = 0  # calls already running on the instance when this one joined it


@dataclass(slots=True)
class GpuNode:
    name: str
    gpus: int
    memory_gb: float  # per GPU
    free: dict[int, set[int]] = field(default_factory=dict)  # size -> starts of free chunks
    used_gb: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = {s: set() for s in CHUNK_SIZES}
        self.free[self.gpus].add(0)
        self.used_gb = [0.0] * self.gpus

    @property
    def free_gpus(self) -> int:
        return sum(size * len(starts) for size, starts in self.free.items())


@dataclass(slots=True)
class _Choosing:
    """What the allocator's choice reads of the pool besides the free chunks: the GB the
    restores ahead pin per (node, GPU), and the recency of what is resident there."""

    pinned: dict[tuple[str, int], float]
    newest_on: dict[tuple[str, int], int] | None = None


@dataclass(slots=True)
class GpuPool:
    nodes: dict[str, GpuNode] = field(default_factory=dict)
    memory_gb: dict[str, float] = field(default_factory=dict)  # service -> total footprint
    # Services whose DoP-k instance is k full replicas (each GPU holds the whole footprint);
    # the others are sharded over their k GPUs.
    replicated: set[str] = field(default_factory=set)
    # Resident instances, least recently used first, with the GB each holds per GPU.
    resident: OrderedDict[Instance, float] = field(default_factory=OrderedDict)
    busy: dict[Instance, int] = field(default_factory=dict)  # running instance -> its calls
    max_calls: dict[str, int] = field(default_factory=dict)  # service -> calls an instance
    # serves at once (absent: 1)
    # Busy instances whose service was redefined while they ran: dropped when they end.
    stale: set[Instance] = field(default_factory=set)
    # Running instances whose restore may have failed (a call on them failed): no more
    # joiners; whether they stay resident is what their last call says.
    doubtful: set[Instance] = field(default_factory=set)
    revision: dict[str, str] = field(default_factory=dict)  # service -> what workers load
    # Services a node cannot host (its worker could not load them): never placed there.
    unloadable: dict[str, frozenset[str]] = field(default_factory=dict)
    # Services a node's worker is loading (it joined, or they were edited) and has not
    # answered for yet: not placed there until it has, but calls of them are not refused
    # for it (``fits(..., soon=True)``): they wait for the load.
    loading: dict[str, frozenset[str]] = field(default_factory=dict)
    # Instances being restored ahead -> when their restore is expected to end. Resident
    # (their memory is charged) and never evicted until it ended (``ahead_done``).
    ahead: dict[Instance, float] = field(default_factory=dict)
    # Nodes that take no new work (their agent said it stops): no call lands on their
    # chunks or joins their instances, and nothing is restored ahead there; the calls
    # running there go on (``Scheduler.cordon_node``). Calls are not refused for them
    # (``fits(..., soon=True)``): they wait for GPUs elsewhere, or for the node's return.
    cordoned: set[str] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        nodes: Iterable[tuple[str, int, float]],
        services: dict[str, float],
        replicated: Iterable[str] = (),
        max_calls: Mapping[str, int] | None = None,
    ) -> GpuPool:
        """From ``(name, gpus, memory_gb_per_gpu)`` and service -> GPU memory footprint."""
        pool = cls(
            memory_gb=dict(services), replicated=set(replicated), max_calls=dict(max_calls or {})
        )
        for name, gpus, mem in nodes:
            if gpus > 0:
                pool.add_node(name, gpus, mem)
        return pool

    # ---- membership (agents come and go; RewardServices are edited) ---------------------
    def add_node(self, name: str, gpus: int, memory_gb: float) -> None:
        if gpus not in CHUNK_SIZES:
            raise ValueError(f"node {name}: {gpus} GPUs; buddy chunks need 1, 2, 4 or 8")
        self.nodes[name] = GpuNode(name, gpus, memory_gb)

    def remove_node(self, name: str) -> None:
        """Forget a node with whatever it held (its agent is gone)."""
        self.nodes.pop(name, None)
        self.unloadable.pop(name, None)
        self.loading.pop(name, None)
        self.cordoned.discard(name)
        for inst in [i for i in self.resident if i.chunk.node == name]:
            del self.resident[inst]
        self.busy = {i: n for i, n in self.busy.items() if i.chunk.node != name}
        self.stale = {i for i in self.stale if i.chunk.node != name}
        self.doubtful = {i for i in self.doubtful if i.chunk.node != name}
        self.ahead = {i: t for i, t in self.ahead.items() if i.chunk.node != name}

    def set_service(
        self,
        service: str,
        memory_gb: float,
        replicated: bool,
        revision: str = "",
        max_calls: int = 1,
    ) -> None:
        """Define or redefine a service. A change of footprint, layout or revision makes
        its instances stale, as the workers reload it: idle ones go now, busy ones when
        their calls end. A new ``max_calls`` only changes who may join from now on."""
        self.max_calls[service] = max_calls
        if (
            self.memory_gb.get(service) == memory_gb
            and (service in self.replicated) == replicated
            and self.revision.get(service) == revision
        ):
            return
        self.forget(service)
        self.memory_gb[service] = memory_gb
        self.revision[service] = revision
        (self.replicated.add if replicated else self.replicated.discard)(service)

    def remove_service(self, service: str) -> None:
        self.forget(service)
        self.memory_gb.pop(service, None)
        self.revision.pop(service, None)
        self.max_calls.pop(service, None)
        self.replicated.discard(service)

    def per_gpu(self, service: str, size: int) -> float:
        """GB a chunk-``size`` instance of ``service`` holds on each of its GPUs."""
        return gb_per_gpu(self.memory_gb[service], service in self.replicated, size)

    def fits(self, service: str, k: int, *, soon: bool = False) -> bool:
        """Whether a DoP-k instance of ``service`` can ever fit in GPU memory, on a node
        whose worker holds the service; ``soon``: or is loading it (``loading``)."""
        if service not in self.memory_gb:
            return False
        size = chunk_level(k)
        per_gpu = self.per_gpu(service, size)
        return any(
            holds(n.gpus, n.memory_gb, size, per_gpu) and self.hosts(n.name, service, soon=soon)
            for n in self.nodes.values()
        )

    def hosts(self, node: str, service: str, *, soon: bool = False) -> bool:
        """Whether ``node``'s worker holds ``service`` (it could load it, and is not
        loading it again) and the node takes new work; ``soon``: or is loading it, or the
        node is cordoned (its agent stops, and may come back)."""
        if service in self.unloadable.get(node, ()):
            return False
        if self.cordoned and node in self.cordoned and not soon:
            return False
        return soon or not (self.loading and service in self.loading.get(node, ()))

    def can_host(self, service: str, k: int) -> bool:
        """Whether a free chunk on a node with large enough GPUs can take a DoP-k call now."""
        return self.landing(service, k)[0]

    def chunk_counts(self) -> ChunkState:
        """The free chunks of each size, over the nodes that take new work."""
        c = [0, 0, 0, 0]
        for node in self.nodes.values():
            if self.cordoned and node.name in self.cordoned:
                continue
            for i, size in enumerate(CHUNK_SIZES):
                c[i] += len(node.free[size])
        return (c[0], c[1], c[2], c[3])

    def warm_at(self, service: str, k: int) -> float | None:
        """When the instance a DoP-k call would land on now is in GPU memory: 0.0 if it is,
        the expected end of its restore ahead if that is under way, None if the call would
        restore it."""
        return self.landing(service, k)[1]

    def landing(self, service: str, k: int) -> tuple[bool, float | None]:
        """``can_host`` and ``warm_at`` of a DoP-k call of ``service``, from one choice."""
        chunk = self._choose(service, chunk_level(k))
        if chunk is None:
            return False, None
        inst = Instance(service, chunk)
        return True, (self.ahead.get(inst, 0.0) if inst in self.resident else None)

    def idle_resident(self) -> dict[tuple[str, int], int]:
        """How many resident instances of each (service, chunk size) a call could land on
        now: on a free chunk, of a node that can load the service."""
        idle: dict[tuple[str, int], int] = {}
        for inst in self.resident:
            chunk = inst.chunk
            if self.hosts(chunk.node, inst.service) and self.is_free(chunk):
                key = (inst.service, chunk.size)
                idle[key] = idle.get(key, 0) + 1
        return idle

    def warm_landings(self, service: str, k: int, warm: int) -> Iterator[float | None]:
        """``warm_at`` of successive DoP-k calls of ``service``, each on the chunk the
        allocator would give it once the calls before it took theirs (so a warm instance
        counts for one of them), ``warm`` of its instances being idle (``idle_resident``).
        It ends once none is left for the calls after (each of them restores), or no free
        chunk can host one more. The allocator runs on a copy of the free chunks, only for
        as many calls as are asked for, and only while warm instances are left."""
        size = chunk_level(k)
        free: dict[str, dict[int, set[int]]] | None = None
        shared = _Choosing(self._pinned())  # what the choices read and do not change
        while warm:
            chunk = self._choose(service, size, free, shared)
            if chunk is None:
                return
            inst = Instance(service, chunk)
            if inst in self.resident:
                warm -= 1
                yield self.ahead.get(inst, 0.0)
            else:
                yield None
            if free is None:  # (a copy once a second call asks)
                free = {
                    n: {lvl: set(st) for lvl, st in g.free.items()} for n, g in self.nodes.items()
                }
            _carve(free[chunk.node], self.nodes[chunk.node].gpus, chunk)

    def joinable(
        self,
        service: str,
        k: int,
        calls: Mapping[Instance, int] | None = None,
        among: Iterable[Instance] | None = None,
    ) -> Instance | None:
        """A running DoP-k instance of ``service`` with room for one more call: the first
        started of those with the fewest calls, or None. ``calls``: the calls on each
        running instance, if not those running now (a round's plan); ``among``: the
        instances to look at, in start order, if not all of them."""
        size = chunk_level(k)
        if self.max_calls.get(service, 1) <= 1:
            return None
        calls = self.busy if calls is None else calls
        best: Instance | None = None
        for inst in calls if among is None else among:
            n = calls[inst]
            if (
                inst.service == service
                and inst.chunk.size == size
                and self.has_room(inst, n)
                and (best is None or n < calls[best])
            ):
                best = inst
        return best

    def has_room(self, inst: Instance, calls: int) -> bool:
        """Whether running ``inst``, with ``calls`` calls on it, may take one more (none
        on a cordoned node)."""
        return (
            0 < calls < self.max_calls.get(inst.service, 1)
            and not (self.stale and inst in self.stale)  # (most often empty: no hashing)
            and not (self.doubtful and inst in self.doubtful)
            and not (self.cordoned and inst.chunk.node in self.cordoned)
        )

    def allocate(
        self, service: str, k: int, *, join: Chunk | None = None, at: Chunk | None = None
    ) -> GpuGrant:
        """Take a chunk for a DoP-k call of ``service``; restore bookkeeping and LRU eviction.
        ``join``: run it instead on the running instance of ``service`` on that chunk;
        ``at``: take that free chunk (a call already running there, adopted)."""
        if join is not None:
            inst = Instance(service, join)
            sharing = self.busy.get(inst, 0)
            if not self.has_room(inst, sharing):
                raise ValueError(f"{service} on {join} is not running with room for a call")
            self.busy[inst] = sharing + 1
            self.resident.move_to_end(inst)
            return GpuGrant(join, True, (), sharing)
        size = chunk_level(k)
        target = self._choose(service, size) if at is None else at
        if target is None:
            raise ValueError(f"no free GPU chunk of size {size} for service {service}")
        node = self.nodes[target.node]
        self._carve(node, target)  # (a ValueError if ``at`` is not free)
        inst = Instance(service, target)
        evicted: list[Instance] = []
        hit = inst in self.resident
        if hit:
            self.resident.move_to_end(inst)
        else:
            per_gpu = self.per_gpu(service, size)
            if per_gpu > node.memory_gb + 1e-9:
                self._release_chunk(node, target)
                raise ValueError(
                    f"service {service} needs {per_gpu:.1f} GB per GPU at DoP {size}; "
                    f"GPUs of {node.name} have {node.memory_gb:.1f} GB"
                )
            # Least recently used first, and only instances on a GPU still short of memory
            # (the node agent's residency plan does the same, so both evict alike).
            for victim in list(self.resident):
                short = {
                    g for g in target.gpus if node.used_gb[g] + per_gpu > node.memory_gb + 1e-9
                }
                if not short:
                    break
                if victim.chunk.node != node.name or victim in self.busy or victim in self.ahead:
                    continue
                if short.isdisjoint(victim.chunk.gpus):
                    continue
                self._evict(victim)
                evicted.append(victim)
            self._charge(inst, per_gpu)
        self.busy[inst] = 1
        return GpuGrant(target, hit, tuple(evicted))

    def release(self, service: str, chunk: Chunk, *, resident: bool = True) -> None:
        """A call on ``chunk`` ended; ``resident=False``: its instance may not be in GPU
        memory after all (a restore that failed). The chunk is free once its last call
        ended, and the instance stays resident if that call says so (a joiner waiting for a
        failed restore has its worker restore it again)."""
        inst = Instance(service, chunk)
        calls = self.busy.get(inst, 0) - 1
        if calls > 0:
            self.busy[inst] = calls  # in place: joinable's ties go to the first started
            if not resident:
                self.doubtful.add(inst)
            return
        self.busy.pop(inst, None)
        self.doubtful.discard(inst)
        node = self.nodes.get(chunk.node)
        if node is not None:  # else the node left while the call ran
            self._release_chunk(node, chunk)
        if inst in self.ahead:  # its restore ahead has not ended: that decides (ahead_done)
            return
        if node is not None and inst in self.resident and (not resident or inst in self.stale):
            self._evict(inst)  # not restored after all, or redefined while it ran
        self.stale.discard(inst)

    def restore_ahead(
        self, service: str, k: int, now: float, restore_s: float
    ) -> tuple[Instance, float] | None:
        """Restore ``service`` ahead for its next DoP-``k`` call, if that is free to do: the
        allocator's choice for such a call now is a free chunk that does not hold the
        instance, and whose GPUs have room for it without evicting anything. Returns the
        instance, now resident and pinned until its restore ends (``ahead_done``), and when
        that is expected: ``restore_s`` after the restores ahead already under way on any
        of its GPUs (they share the host links). None if there is nothing to do."""
        if service not in self.memory_gb:
            return None
        size = chunk_level(k)
        chunk = self._choose(service, size)
        if chunk is None:
            return None
        inst = Instance(service, chunk)
        if inst in self.resident:
            return None  # warm already: the call will not restore
        node = self.nodes[chunk.node]
        per_gpu = self.per_gpu(service, size)
        if any(node.used_gb[g] + per_gpu > node.memory_gb + 1e-9 for g in chunk.gpus):
            return None  # it would evict: what is resident may be wanted more
        start = max(
            (
                t
                for i, t in self.ahead.items()
                if i.chunk.node == chunk.node and not set(i.chunk.gpus).isdisjoint(chunk.gpus)
            ),
            default=now,
        )
        ready = max(now, start) + restore_s
        self._charge(inst, per_gpu)
        self.ahead[inst] = ready
        return inst, ready

    def ahead_done(self, inst: Instance, *, resident: bool = True) -> None:
        """A restore ahead ended; ``resident=False``: it failed, and the memory is free
        again. One redefined while it was restored is dropped, as its worker drops it. If a
        call has landed on it meanwhile, that call's end decides instead (``release``)."""
        if self.ahead.pop(inst, None) is None:
            return
        if inst in self.busy:
            if not resident:
                self.doubtful.add(inst)
            return
        if inst in self.resident and (not resident or inst in self.stale):
            self._evict(inst)
        self.stale.discard(inst)

    def evict_all(self, service: str) -> None:
        for inst in [
            i
            for i in self.resident
            if i.service == service and i not in self.busy and i not in self.ahead
        ]:
            self._evict(inst)

    def sync_node(self, node: str, instances: Iterable[tuple[str, int, int]]) -> None:
        """Make the idle instances on ``node`` those its worker reports: ``(service, start,
        size)``, least recently used first. Instances of unknown services, chunks that are
        not buddy chunks of the node, or that would overfill a GPU are left out. GPUs with a
        call running are left as this scheduler has them: the report may predate the call,
        whose worker evicts and restores as the call's own plan says."""
        n = self.nodes.get(node)
        if n is None:
            return
        running = {
            g for i in [*self.busy, *self.ahead] if i.chunk.node == node for g in i.chunk.gpus
        }
        reported: dict[Instance, None] = {}  # in the reported order
        for service, start, size in instances:
            buddy = size in CHUNK_SIZES and start % size == 0 and start + size <= n.gpus
            if service in self.memory_gb and buddy:
                inst = Instance(service, Chunk(node, start, size))
                if running.isdisjoint(inst.chunk.gpus):
                    reported[inst] = None
        # Busy instances are on running GPUs, so this leaves them too.
        for inst in [i for i in self.resident if i.chunk.node == node]:
            if inst not in reported and running.isdisjoint(inst.chunk.gpus):
                self._evict(inst)
        added: list[Instance] = []
        for inst in reported:  # those already resident keep this scheduler's own recency
            per_gpu = self.per_gpu(inst.service, inst.chunk.size)
            if inst not in self.resident and all(
                n.used_gb[g] + per_gpu <= n.memory_gb + 1e-9 for g in inst.chunk.gpus
            ):
                self._charge(inst, per_gpu)
                added.append(inst)
        for inst in reversed(added):  # unknown recency: older than anything seen used here
            self.resident.move_to_end(inst, last=False)

    def forget(self, service: str) -> None:
        """``service``'s instances are no longer what the workers hold: idle ones go now,
        busy ones when their calls end, as the workers do."""
        self.evict_all(service)
        self.stale.update(i for i in [*self.busy, *self.ahead] if i.service == service)

    def _charge(self, inst: Instance, per_gpu: float) -> None:
        """``inst`` is resident now, holding ``per_gpu`` GB on each of its GPUs."""
        node = self.nodes[inst.chunk.node]
        for g in inst.chunk.gpus:
            node.used_gb[g] += per_gpu
        self.resident[inst] = per_gpu

    def _evict(self, inst: Instance) -> None:
        node = self.nodes[inst.chunk.node]
        per_gpu = self.resident.pop(inst)
        for g in inst.chunk.gpus:
            node.used_gb[g] = max(0.0, node.used_gb[g] - per_gpu)

    def _choose(
        self,
        service: str,
        size: int,
        free: Mapping[str, dict[int, set[int]]] | None = None,
        shared: _Choosing | None = None,
    ) -> Chunk | None:
        """Smallest free level >= size; within it, the aligned position that evicts least.
        ``free``: each node's free chunks, if not the pool's own, and ``shared`` what
        successive choices on them read (``warm_landings``).

        A position already holding the requested instance wins (seed 000 §5.3); after
        that, the one whose GPUs need the least resident memory evicted (our addition:
        otherwise a free, empty GPU could be passed over for one holding a warm model).
        Nodes whose GPUs are too small for the instance even when empty, whose worker
        could not load the service, or that are cordoned, are skipped; if a level has no
        other position, a larger level is tried.
        """
        need = self.per_gpu(service, size)
        if shared is None:
            shared = _Choosing(self._pinned())
        pinned = shared.pinned
        for level in (s for s in CHUNK_SIZES if s >= size):
            best: tuple[tuple[int, float, int, str, int], Chunk] | None = None
            for node in self.nodes.values():
                if need > node.memory_gb + 1e-9 or not self.hosts(node.name, service):
                    continue
                for start in (node.free if free is None else free[node.name])[level]:
                    for sub in range(start, start + level, size):
                        chunk = Chunk(node.name, sub, size)
                        hit = Instance(service, chunk) in self.resident
                        if not hit and any(  # restores ahead leave too little room
                            pinned.get((node.name, g), 0.0) + need > node.memory_gb + 1e-9
                            for g in chunk.gpus
                        ):
                            continue
                        excess = sum(
                            max(0.0, node.used_gb[g] + need - node.memory_gb) for g in chunk.gpus
                        )
                        # Among equal evictions, disturb the least recently used instances (LRU).
                        newest = -1
                        if excess > 0:
                            if shared.newest_on is None:  # when an eviction asks for it
                                shared.newest_on = self._newest_on()
                            newest = max(
                                shared.newest_on.get((node.name, g), -1) for g in chunk.gpus
                            )
                        key = (0 if hit else 1, excess, newest, node.name, sub)
                        if best is None or key < best[0]:
                            best = (key, chunk)
            if best is not None:
                return best[1]
        return None

    def _newest_on(self) -> dict[tuple[str, int], int]:
        """Per (node, GPU): the recency of the most recently used instance resident there
        (0 = the least recently used instance of all)."""
        newest: dict[tuple[str, int], int] = {}
        for rank, inst in enumerate(self.resident):  # least recently used first
            for g in inst.chunk.gpus:
                newest[inst.chunk.node, g] = rank
        return newest

    def _pinned(self) -> dict[tuple[str, int], float]:
        """GB per (node, GPU) of the instances being restored ahead, which no restore may
        evict."""
        pinned: dict[tuple[str, int], float] = {}
        for inst in self.ahead:
            gb = self.resident.get(inst, 0.0)
            for g in inst.chunk.gpus:
                pinned[inst.chunk.node, g] = pinned.get((inst.chunk.node, g), 0.0) + gb
        return pinned

    def is_free(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` (an aligned one of its node) lies within a free chunk."""
        node = self.nodes.get(chunk.node)
        return node is not None and _free_level(node.free, node.gpus, chunk) is not None

    def _carve(self, node: GpuNode, target: Chunk) -> None:
        """Split the free chunk containing ``target`` down to it, freeing the other buddies."""
        _carve(node.free, node.gpus, target)

    def _release_chunk(self, node: GpuNode, chunk: Chunk) -> None:
        start, size = chunk.start, chunk.size
        while size < node.gpus:
            buddy = start ^ size
            if buddy not in node.free[size]:
                break
            node.free[size].remove(buddy)
            start = min(start, buddy)
            size *= 2
        if start in node.free[size]:
            raise ValueError(f"chunk ({node.name}, {start}, {size}) freed twice")
        node.free[size].add(start)


def gb_per_gpu(total_gb: float, replicated: bool, size: int) -> float:
    """GB an instance of ``total_gb`` holds on each GPU of a chunk of ``size``: all of it
    when each GPU holds a replica, else its share."""
    return total_gb if replicated else total_gb / size


def holds(gpus: int, memory_gb: float, size: int, per_gpu: float) -> bool:
    """Whether a node of ``gpus`` GPUs of ``memory_gb`` each can ever hold a chunk-``size``
    instance taking ``per_gpu`` GB on each."""
    return gpus >= size and memory_gb + 1e-9 >= per_gpu


def _free_level(free: Mapping[int, set[int]], gpus: int, chunk: Chunk) -> int | None:
    """The size of the free chunk (of a node of ``gpus`` GPUs whose free chunks are
    ``free``) that contains ``chunk``, or None."""
    level = chunk.size
    while level <= gpus:
        if chunk.start - chunk.start % level in free[level]:
            return level
        level *= 2
    return None


def _carve(free: dict[int, set[int]], gpus: int, target: Chunk) -> None:
    """Split the free chunk containing ``target`` down to it, freeing the other buddies."""
    level = _free_level(free, gpus, target)
    if level is None:
        raise ValueError(f"chunk {target} is not free")
    start = target.start - target.start % level
    free[level].remove(start)
    while level > target.size:
        level //= 2
        left, right = start, start + level
        keep = left if target.start < right else right
        free[level].add(right if keep == left else left)
        start = keep
