"""A round's planning: Algorithm 1 of seed 000, as decisions that change nothing.

1. Candidates: walk the queue in policy order and take every action that fits at its
   minimum units, respecting topology (free cores of the trajectory's node, buddy GPU
   chunks, quota windows). A trajectory's first action places it (on a node with cores for
   it and memory for the whole trajectory); the placement is planned, not made. An action
   that does not fit — or that waits behind one that did not — blocks every resource it
   needs for the rest of the round, so nothing behind it on those resources overtakes it
   (FCFS per resource, hence no starvation: by induction on queue position, the first
   waiting action of a resource holds its reservation until running actions release
   enough), while actions on unrelated resources — another node, an API quota — still
   proceed. That blocks calls on a quota with room behind an action that waits for
   another; ``quota_waiting="pass"`` keeps such a quota open instead: the first action
   waiting on what it lacks keeps its units of it, and actions behind it take the rest
   (docs/benchmarks.md, DeepSearch, measures both). The walk stops once every resource
   anyone waits for is closed, or, under "pass", once each action left needs a closed
   quota (or the GPUs), by per-resource counts of queued demand. An elastic exec
   candidate keeps only the sizes worth their cores at its node's load (``core.pricing``;
   ``core_price``). An action the pool as it is now cannot host (``Scheduler.stranded``:
   the node, GPUs or quota limit it needs left) is skipped, reserving nothing, and left
   out of the estimate; so is one whose trajectory this round places on a node smaller
   than its minimum (the commit refuses it). A cordoned node (its agent stops) offers no
   placement, chunk or instance to join, and the actions of its trajectories are stranded.
2. Split candidates by key resource (the cores of one node, the GPU pool, one quota).
3. Groups with no elastic candidate run at minimum units; the others go through greedy
   eviction (``elastic.greedy_evict``) with the ACT approximation.

The result is a ``Plan``; ``Scheduler.schedule`` commits it (places trajectories, then
allocates exact cores, GPU chunks and quota units, and starts the actions).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Collection, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass
from typing import Protocol

from tangram.api.cluster import ServiceSpec
from tangram.scheduler.core.actions import Action, Running, Trajectory, needs
from tangram.scheduler.core.config import SchedulerConfig
from tangram.scheduler.core.cpu_pool import CpuPool, PlannedPlacements
from tangram.scheduler.core.decisions import Assignment, GroupDecision, Plan, Start
from tangram.scheduler.core.dp import ChunkState, chunk_level, take_chunk
from tangram.scheduler.core.elastic import greedy_evict
from tangram.scheduler.core.fair import FairQueue
from tangram.scheduler.core.gpu_pool import Chunk, GpuPool, Instance
from tangram.scheduler.core.objective import Pending
from tangram.scheduler.core.ordering import ActionQueue
from tangram.scheduler.core.pricing import NodePrice, node_price, priced_sizes
from tangram.scheduler.core.quota_pool import Quota
from tangram.scheduler.core.resource import GPU, PLACE, Resource
from tangram.scheduler.core.returns import Returns
from tangram.scheduler.core.shares import RoundCaps
from tangram.scheduler.core.sizing import Sizing


class RoundInputs(Protocol):
    """What a round reads of the scheduler. Planning changes none of it; it only fills the
    per-action caches of sizes and needs."""

    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def sizing(self) -> Sizing: ...
    @property
    def cpu(self) -> CpuPool: ...
    @property
    def gpu(self) -> GpuPool: ...
    @property
    def quotas(self) -> Mapping[str, Quota]: ...
    @property
    def services(self) -> Mapping[str, ServiceSpec]: ...
    @property
    def trajectories(self) -> Mapping[str, Trajectory]: ...
    @property
    def actions(self) -> Mapping[str, Action]: ...
    @property
    def queue(self) -> ActionQueue | FairQueue: ...
    @property
    def running(self) -> Mapping[str, Running]: ...
    @property
    def waiting(self) -> Mapping[Resource, int]: ...  # queued actions needing each resource
    @property
    def queued_calls(self) -> Mapping[str, int]: ...  # queued calls of each service
    @property
    def queued_work(self) -> Mapping[Resource, float]: ...  # their core-seconds, by resource
    @property
    def returns(self) -> Returns: ...  # thinking trajectories per node, mean think time
    @property
    def stranded(self) -> Set[str]: ...  # queued actions the pool cannot host now
    def round_caps(self) -> RoundCaps | None: ...  # capped tenants' room; None: none capped


def plan_round(s: RoundInputs, now: float, *, whole_queue: bool = False) -> Plan:
    """The decisions of one round at ``now``. ``whole_queue``: take none of the shortcuts
    of a round under ``quota_waiting="pass"`` (stopping once none of the rest of the queue
    can start, skipping calls on a closed quota): the same plan, slower; the property
    tests compare the two."""
    return _Planner(s, now, whole_queue=whole_queue).plan()


def price_of(s: RoundInputs, node: str) -> NodePrice:
    """``node``'s core price now under the configured rule, with its terms (``core.pricing``)."""
    cores, cpu = Resource.cpu(node), s.cpu.nodes[node]
    returns = s.returns
    return node_price(
        cpu,
        s.waiting.get(cores, 0),
        queued_work=s.queued_work.get(cores, 0.0),
        # The return term only under its rule: nobody thinking leaves it out.
        thinking=returns.thinking.get(node, 0) if s.config.core_price == "arrivals" else 0,
        think_s=returns.think.mean,
        offered=returns.offered_load(cpu.trajectories, cpu.cores),
    )


@dataclass(slots=True)
class _Provisional:
    """Free units as the round's candidates take their minimum, one after the other."""

    cpu_free: dict[str, int]
    chunks: ChunkState
    quota_free: dict[str, int]


@dataclass(slots=True)
class _Candidate:
    action: Action
    resource: Resource  # its key resource
    node: str | None
    durations: dict[int, float]
    capped_from: int | None = None  # its largest allowed size, when the core price cut it
    join: Chunk | None = None  # a service call joins the instance there: not arranged
    extends: bool = False  # a joiner expected to end after the instance's last call
    nth: int = 0  # a service call taking a chunk: its service's calls that took one before


# Why an action the pool cannot host now waits (``Plan.blocked``).
_STRANDED = (
    "the pool cannot host it now (no node, GPUs or quota limit left fit it, within its "
    "tenant's maxShare)"
)
_DONE = object()  # the end of an iterator

# Resources whose name does not depend on where a trajectory is placed: the walk's needs
# and the scheduler's ``waiting`` counts agree on them, so the counts say what is left.
_POOL_WIDE = frozenset(("api", "gpu"))


def _rest_closed(
    left: int, needing: Mapping[Resource, int], among: Iterable[Resource], blocked: set[Resource]
) -> bool:
    """Whether each of the ``left`` queued actions not yet walked needs a resource of
    ``among`` that the round has closed (``blocked``), by the count of those needing it:
    then none of them can start, and the walk may stop. Only quotas and the GPUs are
    counted (``needing``); under ``quota_waiting="pass"`` the quota a waiter keeps open
    is never closed, so the rule that stops once everything waited on is closed would walk
    every waiter behind the last call that can pass (DeepSearch's pdf_parse queue)."""
    if not left:
        return True
    for r in among:  # noqa: SIM110 (no generator per action on the walk's hot path)
        if needing.get(r) == left and r in blocked:
            return True
    return False


class _Planner:
    def __init__(self, s: RoundInputs, now: float, *, whole_queue: bool = False) -> None:
        self.s = s
        self.now = now
        self.whole_queue = whole_queue
        self.view = PlannedPlacements(s.cpu)
        self.prov = _Provisional(
            {n: node.free_cores for n, node in s.cpu.nodes.items()},
            s.gpu.chunk_counts(),
            {q: quota.free(now) for q, quota in s.quotas.items()},
        )
        self.blocked: set[Resource] = set()  # reserved for the rest of the round
        # When the first of the calls walked so far that wait for GPUs is overdue: until
        # then joiners may keep their instance's chunk longer (``gpu_joining``).
        self.gpus_owed_at = math.inf
        self.caps = s.round_caps()
        self.prices: dict[str, NodePrice] = {}  # per node, computed when first needed
        # Calls on each running service instance, as this round's joiners add theirs.
        self.calls: dict[Instance, int] = dict(s.gpu.busy)
        self.chunk_times: dict[Chunk, tuple[float, float]] | None = None  # when first needed
        # The running instances of each (service, chunk size), in start order, and where
        # the allocator would put a call: fixed while a round is planned (the pool does
        # not change), looked up per queued call. Built when first needed.
        self.instances: dict[tuple[str, int], list[Instance]] | None = None
        self.landing: dict[tuple[str, int], tuple[bool, float | None]] = {}
        # A call after the first of its service and DoP finds the warm instances the calls
        # before it took: the allocator's landings for them, as far as asked
        # (``GpuPool.warm_landings``), and the rest of the sequence.
        self.warm: dict[tuple[str, int], tuple[list[float | None], Iterator[float | None]]] = {}
        self.idle: dict[tuple[str, int], int] | None = None  # idle resident instances
        self.taking: dict[str, int] = {}  # candidates of each service taking a chunk, so far
        # The instance a call of (service, chunk size) would join: changes only when a
        # call joins one of them, so most of the queue reads it rather than scanning.
        self.joinable: dict[tuple[str, int], Instance | None] = {}

    def plan(self) -> Plan:
        cands, rest, blocked = self._candidates()
        groups: dict[Resource, list[_Candidate]] = {}
        chosen: dict[str, int] = {}
        for c in cands:
            if c.join is not None:  # its instance and DoP are set: nothing to arrange
                chosen[c.action.id] = next(iter(c.durations))
            else:
                groups.setdefault(c.resource, []).append(c)
        decisions: list[GroupDecision] = []
        for resource, group in groups.items():
            units, decision = self._arrange(resource, group, rest.get(resource, []))
            decisions.append(decision)
            for c, k in zip(group, units, strict=False):
                chosen[c.action.id] = k
            for c in group[decision.kept :]:
                blocked.append((c.action.id, f"{resource} (evicted: waiting beats starting now)"))
            if resource == GPU and decision.kept < len(group):
                self._hold_joiners(group[decision.kept :], cands, chosen, blocked)
        starts = tuple(
            Start(
                action_id=c.action.id,
                resource=c.resource,
                node=c.node,
                units=n,
                expected_s=c.durations.get(n, 0.0),
                join=c.join,
            )
            for c in cands
            if (n := chosen.get(c.action.id)) is not None
        )
        return Plan(
            placements=tuple(self.view.planned.items()),
            starts=starts,
            groups=tuple(decisions),
            blocked=tuple(blocked),
        )

    def _hold_joiners(
        self,
        held: list[_Candidate],
        cands: list[_Candidate],
        chosen: dict[str, int],
        blocked: list[tuple[str, str]],
    ) -> None:
        """Take back the joins that would keep a chunk from a call held back too long.

        A call held back (it fits, but waiting for a bigger chunk beats starting now) is
        decided again each round, and joiners behind it may pass it: under a steady stream
        of joiners the chunk it waits for would never free. Once it is overdue (the
        orderings' ageing bound, ``SchedulerConfig.overdue_after`` of its duration at its
        smallest size), it is owed what a call that does not fit is: joiners behind
        it that would end after their instance's last call wait too, so its wait is bounded.
        (Owing it that from the start cost 3 % of the mean MOPD call ACT over nine seeds,
        docs/benchmarks.md.)"""
        now, overdue_after = self.now, self.s.config.overdue_after
        overdue = next(
            (
                c
                for c in held
                if now - c.action.submitted_at >= overdue_after(c.durations[min(c.durations)])
            ),
            None,
        )
        if overdue is None:
            return
        # What a taken-back join reserved this round (its quota units, its place on the
        # instance) stays reserved until the next round: conservative, and rare.
        behind = False
        for c in cands:
            behind = behind or c is overdue
            if behind and c.extends:
                del chosen[c.action.id]
                blocked.append((c.action.id, f"{GPU} (held for an earlier call)"))

    def _node_of(self, a: Action) -> str | None:
        return self.view.node_of(a.trajectory) if a.cpu else None

    def _candidates(
        self,
    ) -> tuple[list[_Candidate], dict[Resource, list[Pending]], list[tuple[str, str]]]:
        s, view, blocked = self.s, self.view, self.blocked
        waited_on = {r for r, n in s.waiting.items() if n > 0}
        cands: list[_Candidate] = []
        rest: dict[Resource, list[Pending]] = {}
        waits: list[tuple[str, str]] = []
        horizon = s.config.horizon
        limit = s.config.max_candidates
        elastic_resources: set[Resource] = set()  # whose remaining queue the estimate needs
        order = s.queue.order(self.now)
        caps = self.caps
        pricing = s.config.core_price != "none"
        # Queued calls of services with a running instance that has room: the walk goes on
        # past blocked resources until it has seen them all (they may join without a chunk).
        joining = self._joining()
        unseen = {svc: s.queued_calls.get(svc, 0) for svc in joining}
        join_left = sum(unseen.values())
        actions, placement, planned = s.actions, s.cpu.placement, view.planned
        # Under "pass" the rule below that stops once everything waited on is closed never
        # applies: the quota a waiter keeps open for calls behind it is never closed. The
        # walk then counts what is left (queued actions not yet walked, and how many of
        # them need each quota or the GPUs) to stop once none of it can start, and skips
        # calls on a closed quota. The reference walk (whole_queue) does neither.
        # Not with capped tenants: an action at its tenant's share is named as such
        # before anything else is asked of it, and the rest of the walk would be skipped.
        stopping = s.config.quota_waiting == "pass" and not self.whole_queue and caps is None
        left = len(s.queue)
        needing = (
            {r: n for r, n in s.waiting.items() if r.kind in _POOL_WIDE and n > 0}
            if stopping
            else {}
        )
        stranded = s.stranded
        for aid in order:
            a = actions[aid]
            if stranded and aid in stranded:
                # No node (quota) in the pool can host it now: it holds nobody back, and
                # waits for one that can to join. (It is in no count of ``waiting``.)
                left -= 1
                if join_left > 0 and a.service in joining:  # seen: no call left to join
                    join_left -= 1
                    unseen[a.service] -= 1
                waits.append((aid, _STRANDED))
                continue
            if stopping:
                left -= 1
                pool = a.pool_wide
                for r in pool:  # (.get: a count missing from waiting only walks on, never stops)
                    needing[r] = needing.get(r, 0) - 1
                if not a.cpu and not a.gpu and not blocked.isdisjoint(pool):
                    # A call on a closed quota: it cannot start, and it keeps nothing of
                    # the quotas still open (one waiting behind another), so it is neither
                    # sized nor reserved for. Whether all the rest are such calls too, its
                    # own quotas tell (if all need another closed one, the next walked does).
                    if join_left <= 0 and _rest_closed(left, needing, pool, blocked):
                        break
                    continue
            joins = a.service if join_left > 0 and a.service in joining else None
            if joins is not None:  # seen, whether it joins, waits or is capped
                join_left -= 1
                unseen[joins] -= 1
            tenant, room, at_share = "", None, False
            if caps is not None:
                tenant = s.trajectories[a.trajectory].tenant
                room = caps.room(a, tenant)
                if room is not None and room < min(a.cpu or a.gpu or (1,)):
                    # At its tenant's share whatever its size: it waits (before sizing it),
                    # unless it can join a running instance, which takes no GPUs of its own.
                    at_share = joins is not None and caps.quotas_fit(a, tenant)
                    if not at_share:
                        waits.append((aid, f"tenant {tenant} at its maxShare"))
                        continue
            # The trajectory's node, placed or planned (view.node_of, inlined: hot loop).
            node = placement.get(a.trajectory) if a.cpu else None
            if node is None and a.cpu:
                node = planned.get(a.trajectory)
                if node is not None and a.cpu[0] > s.cpu.nodes[node].cores:
                    continue  # the placement refuses it (``Scheduler._place``): no wait
            units, durations, pending = s.sizing.choices(a, node)
            wants = needs(a, node, placement)
            if room is not None and not at_share:
                if room < units[0] and caps is not None:
                    # Its smallest size after sizing (a probe, a fixed DoP) may be over all
                    # its tenant may ever hold, not just what is left now: then it is sized
                    # within that, as over a smaller node, rather than wait forever.
                    most = caps.most(a, tenant)
                    if most is not None and most < units[0]:
                        units, durations = s.sizing.within(a, node, most)
                if room < units[0]:  # its smallest size (after sizing) is over the share
                    waits.append((aid, f"tenant {tenant} at its maxShare"))
                    continue
                if room < units[-1]:
                    units, durations = _first(units, durations, bisect_right(units, room))
            if joins is not None:
                joined = self._join(a, units, durations, wants, alone=not at_share)
                if joined is not None:
                    k, chunk, expected, extends = joined
                    cands.append(
                        _Candidate(a, GPU, None, {k: expected}, join=chunk, extends=extends)
                    )
                    if caps is not None:  # its quotas; no GPUs of its own
                        caps.take(a, tenant, 0)
                    if not self._has_room(joins):
                        # Its instances are full: its calls behind cannot join this round,
                        # and the walk need not go on for them.
                        joining.discard(joins)
                        join_left -= unseen.pop(joins)
                    continue
            if at_share:  # no instance to join: it waits for its tenant's GPUs to free
                waits.append((aid, f"tenant {tenant} at its maxShare"))
                continue
            if blocked.isdisjoint(wants):
                fit = self._fit(a, units[0], node)
                if isinstance(fit, str):
                    if a.cpu and node is None:  # its trajectory's first action places it
                        view.place(a.trajectory, fit, s.trajectories[a.trajectory].memory_gb)
                        node, resource = fit, Resource.cpu(fit)
                    else:
                        resource = wants[0]  # its key resource
                    capped_from = None
                    if pricing and node is not None and len(units) > 1:  # units are cores
                        allowed = units[-1]
                        units, durations = self._priced(units, durations, node)
                        capped_from = allowed if units[-1] < allowed else None
                    cand = _Candidate(a, resource, node, durations, capped_from)
                    if a.service is not None:  # it takes a chunk: warm for the first ones
                        cand.nth = self.taking.get(a.service, 0)
                        self.taking[a.service] = cand.nth + 1
                    cands.append(cand)
                    if caps is not None:
                        caps.take(a, tenant, max(durations))
                    if len(durations) > 1:
                        elastic_resources.add(resource)
                    if limit is not None and len(cands) >= limit:
                        blocked |= waited_on
                        join_left = 0
                    continue
                # It reserves everything it needs, not just what it is short of: an action
                # that needs two quotas must not be overtaken forever on either one.
                blocked.update(self._reserves(a, node, wants, fit))
                waits.append((aid, ",".join(sorted(str(r) for r in fit))))
            else:
                blocked.update(self._reserves(a, node, wants, set()))
            if a.gpu:  # a call waiting for GPUs: owed them once overdue
                owed = a.submitted_at + s.config.overdue_after(durations[units[0]])
                self.gpus_owed_at = min(self.gpus_owed_at, owed)
            key = wants[0]
            if key in elastic_resources and (horizon is None or len(rest.get(key, ())) < horizon):
                rest.setdefault(key, []).append(pending)
            if join_left <= 0 and (
                blocked >= waited_on or (stopping and _rest_closed(left, needing, needing, blocked))
            ):
                break
        # Everything anyone waits for is blocked: no more candidates. Only the estimate's
        # view of the remaining queue on elastic resources is still needed.
        if elastic_resources:
            self._collect_rest(order, elastic_resources, rest)
        return cands, rest, waits

    def _joining(self) -> set[str]:
        """Services with a running instance that can take one more call."""
        has_room = self.s.gpu.has_room
        return {i.service for i, n in self.calls.items() if has_room(i, n)}

    def _has_room(self, service: str) -> bool:
        """Whether a running instance of ``service`` can still take a call this round."""
        has_room, calls = self.s.gpu.has_room, self.calls
        return any(
            has_room(i, calls[i])
            for (svc, _), insts in self._instances().items()
            if svc == service
            for i in insts
        )

    def _instances(self) -> dict[tuple[str, int], list[Instance]]:
        """The running instances of each (service, chunk size), in start order."""
        if self.instances is None:
            self.instances = {}
            for inst in self.calls:  # a round joins running instances only: keys are fixed
                self.instances.setdefault((inst.service, inst.chunk.size), []).append(inst)
        return self.instances

    def _joinable(self, service: str, k: int) -> Instance | None:
        """The running instance a DoP-k call of ``service`` would join now, or None."""
        key = (service, chunk_level(k))
        try:
            return self.joinable[key]
        except KeyError:
            got = self.joinable[key] = self.s.gpu.joinable(
                service, k, self.calls, self._instances().get(key, ())
            )
            return got

    def _lands(self, service: str, k: int) -> tuple[bool, float | None]:
        """Whether a free chunk can host a DoP-k call of ``service`` now, and when the
        instance there is in GPU memory (``GpuPool.warm_at``): one allocator choice per
        (service, DoP) and round, however many queued calls ask."""
        key = (service, k)
        got = self.landing.get(key)
        if got is None:
            got = self.landing[key] = self.s.gpu.landing(service, k)
        return got

    def _join(
        self,
        a: Action,
        units: tuple[int, ...],
        durations: Mapping[int, float],
        wants: tuple[Resource, ...],
        *,
        alone: bool = True,
    ) -> tuple[int, Chunk, float, bool] | None:
        """The DoP at which service call ``a`` joins a running instance, its chunk, its
        expected duration there, and whether it is expected to end after the instance's
        last call (keeping the chunk longer).

        It joins when that is at least as fast for it as a chunk of its own: with a free
        chunk, the fastest size there, restore included; with none (or, ``alone`` false,
        when its tenant is at its share of GPUs), any room is better than waiting. The
        calls already on an instance slow a joiner (``ServiceSpec.slowdown``), and one
        that joins an instance still being restored waits for the restore first.
        Its quotas, and anything else it needs besides GPUs, must be open.

        While an earlier call waits for a chunk (the GPUs are closed), a joiner must end
        before the instance's last call does: then the chunk frees when it would have
        without it, so joining never delays a waiting call and cannot starve it. Under
        ``gpu_joining`` "until-overdue" a joiner may also end later, but no later than the
        first waiting call is overdue (batching beats taking turns): that call is owed the
        chunk by the later of its ageing bound and the end of the calls there before it.
        """
        s, prov, calls = self.s, self.prov, self.calls
        assert a.service is not None
        if any(r != GPU and r in self.blocked for r in wants):
            return None
        if any(prov.quota_free[q] < n for q, n in a.quotas):
            return None
        svc = s.services[a.service]
        closed = GPU in self.blocked
        # How late a joiner may end while a call waits for GPUs: by the instance's last
        # call; under "until-overdue" also by the time the first waiting call is owed them
        # (a bound on the joiner's end, not its start: slowed by the calls it joins, or
        # after a restore, it might otherwise run far past it).
        owed_at = self.gpus_owed_at if s.config.gpu_joining == "until-overdue" else -math.inf
        best: tuple[float, int, Instance, float] | None = None
        for k in units:
            inst = self._joinable(a.service, k)
            if inst is not None:
                ready, end = self._times()[inst.chunk]
                d = max(0.0, ready - self.now) + durations[k] * svc.slowdown(calls[inst])
                if closed and self.now + d > max(end, owed_at) + 1e-9:
                    continue
                if best is None or d < best[0]:
                    best = (d, k, inst, end)
        if best is None:
            return None
        if alone and not closed:
            nth = self.taking.get(a.service, 0)  # the chunk it would take is the next one
            own = min(
                (
                    durations[k] + self._restore_s(svc, k, nth)
                    for k in units
                    if take_chunk(prov.chunks, k) is not None and self._lands(a.service, k)[0]
                ),
                default=None,
            )
            if own is not None and own < best[0]:
                return None
        for q, n in a.quotas:
            prov.quota_free[q] -= n
        d, k, inst, end = best
        calls[inst] += 1
        del self.joinable[(inst.service, inst.chunk.size)]  # fewer places left there
        return k, inst.chunk, d, self.now + d > end + 1e-9

    def _times(self) -> dict[Chunk, tuple[float, float]]:
        """When each running chunk's instance is ready, and its last call is expected to end."""
        if self.chunk_times is None:
            self.chunk_times = _chunk_times(self.s.running.values(), self.s.services)
        return self.chunk_times

    def _priced(
        self, units: tuple[int, ...], durations: dict[int, float], node: str
    ) -> tuple[tuple[int, ...], dict[int, float]]:
        """The sizes worth their cores on ``node`` at its load (``core.pricing``)."""
        price = self.prices.get(node)
        if price is None:
            price = self.prices[node] = price_of(self.s, node)
        return _first(units, durations, priced_sizes(units, durations, price.total))

    def _collect_rest(
        self, order: Iterator[str], resources: set[Resource], rest: dict[Resource, list[Pending]]
    ) -> None:
        s = self.s
        horizon = s.config.horizon
        open_lists = {r: rest.setdefault(r, []) for r in resources}
        actions, placement, node_of = s.actions, s.cpu.placement, self._node_of
        version = s.sizing.book.version
        stranded = s.stranded
        for aid in order:
            if stranded and aid in stranded:
                continue  # it cannot run in the pool as it is: nobody waits for it there
            a = actions[aid]
            wants = a.needs or needs(a, node_of(a), placement)
            target = open_lists.get(wants[0])
            if target is None:
                continue
            if (
                a.cpu
                and a.trajectory not in placement
                and a.cpu[0] > s.cpu.nodes[wants[0].name].cores
            ):
                continue  # too wide for the node planned for its trajectory: refused there
            cache = a.cache  # inlined cache hit of Sizing.choices: this loop sees the whole queue
            if cache is not None and (cache[0] == -1 or cache[0] == version(a.type)):
                target.append(cache[3])
            else:
                target.append(s.sizing.choices(a, node_of(a))[2])
            if horizon is not None and len(target) >= horizon:
                del open_lists[wants[0]]
                if not open_lists:
                    return

    def _reserves(
        self, a: Action, node: str | None, wants: tuple[Resource, ...], short: set[Resource]
    ) -> set[Resource]:
        """What a waiting action closes for the rest of the round.

        Everything it needs; under ``quota_waiting="pass"``, not a quota it is not short of
        and that nobody before it closed: of that, an action short of something keeps its
        own units (taken off the provisional free count), so calls behind it use only the
        rest; one waiting behind another keeps none.

        A trajectory's first action (not yet placed) reserves only placement and the cores
        it is short of: memory is held for a trajectory's whole life, so if it also reserved
        a quota, a placed trajectory needing that quota to finish could never release the
        memory it waits for (hold-and-wait deadlock).
        """
        if a.cpu and node is None:  # not placed, nor planned this round
            return {PLACE} | {r for r in short if r.kind == "cpu"}
        held = set(wants) | short
        # "pass": a quota nobody closed and it is not short of stays open, so calls behind
        # it that need only that quota pass (no head-of-line blocking). Only the first
        # action waiting on what it lacks keeps its units of it (the next to start when
        # that frees); one behind another waiter keeps none until it is first. By induction
        # on the order on what they lack, each first one starts when that frees.
        if not a.quotas or self.s.config.quota_waiting == "hold":
            return held
        free = self.prov.quota_free
        for q, n in a.quotas:
            r = Resource.api(q)
            if r not in short and r not in self.blocked:
                held.discard(r)
                if short:
                    free[q] -= n
        return held

    def _fit(self, a: Action, k: int, node: str | None) -> str | set[Resource]:
        """Provisionally take minimum units: the node (or "") if it fits, else what blocks it."""
        s, prov = self.s, self.prov
        short: set[Resource] = set()
        for q, n in a.quotas:
            if prov.quota_free[q] < n:
                short.add(Resource.api(q))
        chunks = prov.chunks
        if a.gpu:
            nxt = take_chunk(chunks, k)
            if nxt is None or (a.service is not None and not self._lands(a.service, k)[0]):
                short.add(GPU)
            else:
                chunks = nxt
        if a.cpu:
            if node is None:
                mem = s.trajectories[a.trajectory].memory_gb
                used = self.view.used_gb
                # A node whose cores an earlier action waits for is not offered to newcomers.
                free = {
                    n: (0 if Resource.cpu(n) in self.blocked else c)
                    for n, c in prov.cpu_free.items()
                }
                node = s.cpu.choose_node(mem, k, free, used)
                if node is None:
                    short.add(PLACE)
                    short.update(Resource.cpu(n) for n in s.cpu.memory_fits_somewhere(mem, used))
            elif prov.cpu_free[node] < k:
                short.add(Resource.cpu(node))
        if short:
            return short
        for q, n in a.quotas:
            prov.quota_free[q] -= n
        prov.chunks = chunks
        if a.cpu:
            assert node is not None
            prov.cpu_free[node] -= k
            return node
        return ""

    def _arrange(
        self, resource: Resource, group: list[_Candidate], rest: list[Pending]
    ) -> tuple[list[int], GroupDecision]:
        s = self.s
        ids = tuple(c.action.id for c in group)
        durations = [self._with_restore(c) for c in group]
        price = self.prices.get(resource.name) if resource.kind == "cpu" else None
        capped = tuple(
            (c.action.id, max(c.durations), c.capped_from)
            for c in group
            if c.capped_from is not None
        )
        if all(len(d) == 1 for d in durations):
            units = [next(iter(d)) for d in durations]
            return units, GroupDecision(
                resource=resource,
                candidates=ids,
                elastic=False,
                kept=len(group),
                steps=(),
                price=price,
                capped=capped,
            )
        # What runs on a cordoned node's GPUs frees nothing a call may take (its chunks
        # take no new work, ``GpuPool.chunk_counts``): counted, a call would be held back
        # waiting for units it never gets, until the node had left.
        leaving = s.gpu.cordoned if resource == GPU else ()
        running = _running(s.running.values(), resource, self.now, leaving)
        depth, doubling = s.config.depth, s.config.explore == "doubling"
        if resource == GPU:
            arrangement = greedy_evict(
                durations, rest, running, depth, chunks=s.gpu.chunk_counts(), doubling=doubling
            )
        else:
            capacity = s.cpu.nodes[resource.name].free_cores
            arrangement = greedy_evict(
                durations, rest, running, depth, capacity=capacity, doubling=doubling
            )
        return list(arrangement.units), GroupDecision(
            resource=resource,
            candidates=ids,
            elastic=True,
            kept=arrangement.kept,
            steps=arrangement.steps,
            price=price,
            capped=capped,
        )

    def _with_restore(self, c: _Candidate) -> Mapping[int, float]:
        """Durations with the restore a cold instance needs first (the DP sees both)."""
        a = c.action
        if not a.gpu or a.service is None:
            return c.durations
        svc = self.s.services[a.service]
        return {k: d + self._restore_s(svc, k, c.nth) for k, d in c.durations.items()}

    def _restore_s(self, svc: ServiceSpec, k: int, nth: int = 0) -> float:
        """The restore a DoP-k call of ``svc`` needs first where the allocator would put it
        (what is left of it, if it is being restored ahead there), after ``nth`` calls of
        the service took their chunks before it in this round (as if at DoP k too: each
        warm instance counts for one call, the calls after it restore)."""
        ready = self._warm_at(svc.name, k, nth)
        if ready is None:
            return svc.restore_cost(chunk_level(k))
        return max(0.0, ready - self.now)

    def _warm_at(self, service: str, k: int, nth: int) -> float | None:
        """``GpuPool.warm_at`` for the ``nth`` call of ``service`` at DoP k taking a chunk
        this round (0: the first, the allocator's choice now)."""
        if nth == 0:
            return self._lands(service, k)[1]
        key = (service, k)
        got = self.warm.get(key)
        if got is None:
            if self.idle is None:
                self.idle = self.s.gpu.idle_resident()
            warm = self.idle.get((service, chunk_level(k)), 0)
            got = self.warm[key] = ([], self.s.gpu.warm_landings(service, k, warm))
        seen, rest = got
        while len(seen) <= nth:
            nxt = next(rest, _DONE)
            if nxt is _DONE:
                return None  # no warm instance is left for it: it restores
            seen.append(nxt)  # type: ignore[arg-type]
        return seen[nth]


def _first(
    units: tuple[int, ...], durations: dict[int, float], n: int
) -> tuple[tuple[int, ...], dict[int, float]]:
    """The ``n`` smallest of an action's sizes (ascending ``units``) and their durations."""
    if n >= len(units):
        return units, durations
    units = units[:n]
    return units, {k: durations[k] for k in units}


def _chunk_times(
    runs: Iterable[Running], services: Mapping[str, ServiceSpec]
) -> dict[Chunk, tuple[float, float]]:
    """For each chunk with calls running: when its instance is in GPU memory (the call that
    restores it started it: its start plus the restore), and when its last call is expected
    to end."""
    times: dict[Chunk, tuple[float, float]] = {}
    for r in runs:
        asg = r.assignment
        if asg.chunk is None:
            continue
        ready, end = times.get(asg.chunk, (asg.started_at, r.expected_end))
        svc = services.get(r.action.service or "")
        if asg.restore and svc is not None:
            ready = max(ready, asg.started_at + svc.restore_cost(asg.chunk.size))
        ready = max(ready, asg.started_at + asg.ready_in_s)
        times[asg.chunk] = (ready, max(end, r.expected_end))
    return times


def _running(
    runs: Iterable[Running], resource: Resource, now: float, leaving: Collection[str] = ()
) -> list[tuple[float, int]]:
    """(seconds left, units) of what runs on ``resource``; a GPU chunk shared by several
    calls is one entry, free when its last call ends. Not what runs on a node of
    ``leaving`` (cordoned: what it frees takes no new work)."""
    ends: dict[Chunk | str, tuple[float, int]] = {}
    for r in runs:
        if r.resource == resource and not (leaving and r.assignment.node in leaving):
            left = max(0.0, r.expected_end - now)
            key = r.assignment.chunk or r.assignment.action_id
            held = ends.get(key)
            if held is None or held[0] < left:
                ends[key] = (left, _size(r.assignment))
    return list(ends.values())


def _size(asg: Assignment) -> int:
    if asg.chunk is not None:
        return asg.chunk.size
    return len(asg.cores) or asg.units
