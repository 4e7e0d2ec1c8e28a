"""Tenants' shares of the pool: what each tenant's running actions hold, and how much more
a capped tenant (``max_share`` below 1) may take in a round.

A share is counted pool-wide per kind of unit: all the pool's cores (whatever node they
are on), all its GPUs, each API quota's concurrency. A capped tenant may hold at most
``max_share`` of each (at least one unit, so that a small pool does not shut it out).
An action whose smallest size is over that (``over_share``) could never start: it is
refused when submitted, or when a lower share is configured while it waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tangram.scheduler.core.actions import Action
from tangram.scheduler.core.resource import GPU, Resource

POOL_CORES = Resource("cpu")  # every core of the pool (a node's cores are Resource.cpu(node))


@dataclass(frozen=True, slots=True)
class TenantShare:
    """How a tenant shares the pool: its weight in fair queuing, and the fraction of each
    resource's units its running actions may hold at once."""

    weight: float = 1.0
    max_share: float = 1.0


EQUAL = TenantShare()


def cap_units(share: float, capacity: int) -> int:
    """The most units of a kind with ``capacity`` units that a tenant of ``share`` may hold."""
    return max(1, math.floor(share * capacity + 1e-9))


def over_share(
    a: Action, share: float, capacity: Mapping[Resource, int], *, gpus: bool = True
) -> tuple[Resource, int, int, int] | None:
    """The first kind of unit that ``a`` at its smallest size needs more of than a tenant
    of ``share`` may ever hold: (the kind, the units it needs, the pool's units of that
    kind, the tenant's cap); None when every kind fits. ``gpus`` False: its GPUs are not
    counted (a call of a service that batches may join an instance, holding none)."""
    if share >= 1.0:
        return None
    for r, n in units_held(a, (a.cpu or a.gpu or (1,))[0]):
        if r == GPU and not gpus:
            continue
        capacity_r = capacity.get(r)
        if capacity_r is not None and n > (cap := cap_units(share, capacity_r)):
            return r, n, capacity_r, cap
    return None


def units_held(a: Action, units: int) -> list[tuple[Resource, int]]:
    """What an action started with ``units`` (cores or GPUs) holds, pool-wide."""
    out: list[tuple[Resource, int]] = []
    if a.cpu:
        out.append((POOL_CORES, units))
    if a.gpu:
        out.append((GPU, units))
    out.extend((Resource.api(q), n) for q, n in a.quotas)
    return out


class Holdings:
    """Units held by each tenant's running actions."""

    def __init__(self) -> None:
        self._held: dict[str, dict[Resource, int]] = {}

    def add(self, tenant: str, held: Iterable[tuple[Resource, int]]) -> None:
        mine = self._held.setdefault(tenant, {})
        for r, n in held:
            mine[r] = mine.get(r, 0) + n

    def of(self, tenant: str) -> Mapping[Resource, int]:
        return self._held.get(tenant, {})


class RoundCaps:
    """The room capped tenants have left in one round, as candidates are taken."""

    def __init__(
        self,
        share: Callable[[str], TenantShare],
        holdings: Holdings,
        capacity: Mapping[Resource, int],
    ) -> None:
        """``capacity``: the pool's units of each capped kind (POOL_CORES, GPU, a quota's
        concurrency); a kind not in it is not capped."""
        self._share = share
        self._holdings = holdings
        self._capacity = capacity
        self._planned: dict[tuple[str, Resource], int] = {}
        # A flooding tenant's queue is walked every round: one answer per tenant and kind
        # of action until the tenant takes more.
        self._rooms: dict[str, dict[tuple[bool, bool, tuple[tuple[str, int], ...]], int | None]]
        self._rooms = {}

    def room(self, a: Action, tenant: str) -> int | None:
        """The most cores or GPUs ``a`` may take now (0: it may not start this round); None
        when its tenant is not capped. Its quota units either fit its tenant's share or
        make the room 0."""
        rooms = self._rooms.get(tenant)
        if rooms is None:  # (no dict made per call: this is asked of every candidate)
            rooms = self._rooms[tenant] = {}
        key = (bool(a.cpu), bool(a.gpu), a.quotas)
        if key not in rooms:
            rooms[key] = self._room(a, tenant)
        return rooms[key]

    def _room(self, a: Action, tenant: str) -> int | None:
        share = self._share(tenant).max_share
        if share >= 1.0:
            return None
        if not self._quotas_fit(a, tenant, share):
            return 0
        room: int | None = None
        for r, _ in units_held(a, 1):
            left = None if r.kind == "api" else self._left(tenant, r, share)
            if left is not None:
                room = left if room is None else min(room, left)
        return room  # None: its quota units fit, and no cores or GPUs of it are capped

    def most(self, a: Action, tenant: str) -> int | None:
        """The most cores or GPUs ``a``'s tenant may ever hold (its cap of the kinds ``a``
        takes), whatever its other actions hold; None when not capped."""
        share = self._share(tenant).max_share
        if share >= 1.0:
            return None
        caps = [
            cap_units(share, self._capacity[r])
            for r, _ in units_held(a, 1)
            if r.kind != "api" and r in self._capacity
        ]
        return min(caps, default=None)

    def quotas_fit(self, a: Action, tenant: str) -> bool:
        """Whether ``a``'s quota units fit its tenant's share (what a call that joins a
        running instance takes: no cores or GPUs of its own)."""
        share = self._share(tenant).max_share
        return share >= 1.0 or self._quotas_fit(a, tenant, share)

    def _quotas_fit(self, a: Action, tenant: str, share: float) -> bool:
        for q, n in a.quotas:
            left = self._left(tenant, Resource.api(q), share)
            if left is not None and left < n:
                return False
        return True

    def take(self, a: Action, tenant: str, units: int) -> None:
        if self._share(tenant).max_share >= 1.0:
            return
        self._rooms.pop(tenant, None)
        for r, n in units_held(a, units):
            self._planned[(tenant, r)] = self._planned.get((tenant, r), 0) + n

    def _left(self, tenant: str, r: Resource, share: float) -> int | None:
        capacity = self._capacity.get(r)
        if capacity is None:
            return None
        cap = cap_units(share, capacity)
        held = self._holdings.of(tenant).get(r, 0) + self._planned.get((tenant, r), 0)
        return max(0, cap - held)
