"""Fair queuing between tenants: start-time fair queuing over the pool's own order.

Each tenant's queued actions keep the pool's ordering policy among themselves (``fcfs``:
submission order). Between tenants, the next action is the one with the smallest virtual
start tag: a tenant's first waiting action starts at ``max(V, F_t)`` — the system's virtual
time ``V`` (the tag of the latest action started) or the virtual time the tenant has
already used, ``F_t`` — and each action after it ``cost / weight`` later. Starting an
action advances ``F_t`` by its cost over its tenant's weight, so a tenant that has held
the pool gets behind one that has not, in proportion to the weights; a tenant that was
idle does not bank credit (``V`` catches it up). Every start moves some tag forward by a
positive amount, so every waiting action's turn comes: no tenant starves another, and a
tenant alone is served in exactly the pool's order.

The cost at the start is only the action's expected work (a client's declared ``t1_s``,
or what the pool learned): it orders the start. When the action ends (``ended``), its
tenant's virtual time is corrected to what it really held, units times seconds it ran, so
a tenant that declares less work than it does pays the truth all the same, and one that
declares more gets the difference back. Until its runs end a tenant is ahead by at most
what it holds running.

Goyal, Vin & Cheng, "Start-time fair queueing", SIGCOMM 1996 — here with the action's
expected work as its length at the start, corrected to the work it did at its end.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Protocol

MIN_COST = 1e-6  # an action of unknown or zero work still moves its tenant's tag


class PolicyQueue(Protocol):
    """One tenant's queue in the pool's order (``FifoQueue``, ``OrderedQueue``)."""

    def __len__(self) -> int: ...
    def __contains__(self, action_id: str) -> bool: ...
    def push(
        self, action_id: str, key: tuple[float, ...], seq: int, deadline: float | None
    ) -> None: ...
    def remove(self, action_id: str) -> None: ...
    def order(self, now: float) -> Iterator[str]: ...


class FairQueue:
    """Queued action ids, interleaved fairly between tenants (see the module's text)."""

    def __init__(
        self,
        inner: Callable[[], PolicyQueue],
        weight: Callable[[str], float] = lambda tenant: 1.0,
        work: Callable[[str], float] = lambda action_id: 1.0,
    ) -> None:
        """``weight``: a tenant's weight, read at each start (so a change counts from the
        next one on); ``work``: an action's expected work, its length in the tags; both
        asked only while tenants compete."""
        self.inner = inner  # a new queue in the pool's order, for one tenant
        self._weight = weight
        self.work = work
        self._queues: dict[str, PolicyQueue] = {}
        self._entries: dict[str, tuple[str, int]] = {}  # action id -> (tenant, seq)
        self._used: dict[str, float] = {}  # F_t: virtual time each tenant has used
        self.virtual = 0.0  # V: the start tag of the latest action started
        # Started actions not ended yet: (tenant, virtual time charged at the start, the
        # tenant's weight then), for ``ended`` to correct to the work they did.
        self._charged: dict[str, tuple[str, float, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._entries

    def weight(self, tenant: str) -> float:
        return self._weight(tenant)

    def push(
        self,
        action_id: str,
        key: tuple[float, ...],
        seq: int,
        deadline: float | None,
        *,
        tenant: str = "",
    ) -> None:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = self.inner()
        queue.push(action_id, key, seq, deadline)
        self._entries[action_id] = (tenant, seq)

    def resume_tags(self, other: FairQueue) -> None:
        """Go on from ``other``'s virtual times (this queue replaces it: a new ordering):
        the tenants keep what they used, none banks or loses credit, and the actions it
        started are still corrected when they end."""
        self.virtual, self._used = other.virtual, dict(other._used)
        self._charged = dict(other._charged)

    def remove(self, action_id: str) -> None:
        """Out of the queue without being served (cancelled, timed out); see ``started``."""
        tenant, _ = self._entries.pop(action_id)
        queue = self._queues[tenant]
        queue.remove(action_id)
        if not len(queue):
            del self._queues[tenant]

    def started(self, action_id: str) -> None:
        """Out of the queue because it starts: its tenant is charged its cost. A tenant
        alone in the queue is charged the least step instead of its work (which is then
        never worked out): tags only order tenants waiting together, so all that matters
        is that a tenant arriving now goes ahead of its next action. Either way the charge
        is corrected to the work it did when it ends (``ended``)."""
        tenant, _ = self._entries[action_id]
        start = max(self.virtual, self._used.get(tenant, 0.0))
        alone = len(self._queues) == 1
        weight = self.weight(tenant)
        step = MIN_COST if alone else self._cost(action_id) / weight
        self._used[tenant] = start + step
        self._charged[action_id] = (tenant, step, weight)
        self.virtual = start
        self.remove(action_id)

    def ended(self, action_id: str, work: float) -> None:
        """A started action ended, having done ``work`` (the units it held times the
        seconds it held them): its tenant is charged that instead of what it was charged
        at the start, over the weight it started with. (Unknown here, as one started
        before this queue took over from a queue without fairness: nothing to correct.)"""
        charged = self._charged.pop(action_id, None)
        if charged is None:
            return
        tenant, step, weight = charged
        used = self._used.get(tenant, 0.0) - step + max(work, MIN_COST) / weight
        self._used[tenant] = max(0.0, used)

    def forget(self, action_id: str) -> None:
        """A started action is gone without an end to measure (its node drained): it keeps
        the charge of its start."""
        self._charged.pop(action_id, None)

    def _cost(self, action_id: str) -> float:
        return max(self.work(action_id), MIN_COST)

    def tags(self, now: float) -> Iterator[tuple[float, int, str]]:
        """(virtual start tag, seq, action id) of every queued action, smallest first,
        with the tags as they stand at the call."""
        starts = {t: max(self.virtual, self._used.get(t, 0.0)) for t in self._queues}
        return heapq.merge(*(self._tagged(t, q, starts[t], now) for t, q in self._queues.items()))

    def order(self, now: float) -> Iterator[str]:
        if len(self._queues) == 1:  # one tenant waiting: its own order (the tags agree)
            (queue,) = self._queues.values()
            return queue.order(now)
        return (aid for _, _, aid in self.tags(now))

    def _tagged(
        self, tenant: str, queue: PolicyQueue, tag: float, now: float
    ) -> Iterator[tuple[float, int, str]]:
        weight = self.weight(tenant)
        for aid in queue.order(now):
            yield tag, self._entries[aid][1], aid
            tag += self._cost(aid) / weight
