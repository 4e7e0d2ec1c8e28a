"""How many units of its key resource a queued action may get this round, and how long it
is expected to take with each: from its demand, its profile (given or learned) and the
configuration (fixed DoP, elasticity off, probes of unlearned types)."""

from __future__ import annotations

from dataclasses import dataclass

from tangram.scheduler.core.actions import Action
from tangram.scheduler.core.config import SchedulerConfig
from tangram.scheduler.core.cpu_pool import CpuPool
from tangram.scheduler.core.objective import Pending
from tangram.scheduler.core.profiles import ProfileBook

Choices = tuple[tuple[int, ...], dict[int, float], Pending]


@dataclass(frozen=True, slots=True)
class Sizing:
    """Sizes under one configuration and set of nodes: the scheduler makes a new one when
    either changes (cached sizes are dropped then too)."""

    cpu: CpuPool
    book: ProfileBook
    config: SchedulerConfig
    # Cores of the largest node taking new work: the cap of an action not yet on a node.
    # A cordoned node (its agent stops) is left out: no trajectory is placed there, so
    # sizes only it could give (a probe, a fixed DoP) are ones the action never gets.
    biggest_node: int
    # Cores of the largest node, cordoned or not: an action not yet on a node whose
    # minimum is over this is refused at submit (admission). A cordoned node's agent may
    # come back (a roll): an action only it could host waits (stranded) meanwhile.
    biggest_any_node: int

    def choices(self, a: Action, node: str | None) -> Choices:
        """Allowed key units, their expected durations (no restore), as Pending too.

        ``node``: the node of an exec action's trajectory, placed or planned this round.
        Cached per action until the profile book changes its mind about the action's type.
        """
        static = a.profile is not None and a.profile.efficiency is not None
        stamp = -1 if static else self.book.version(a.type)
        if a.cpu and a.trajectory not in self.cpu.placement:
            stamp = -2  # not placed yet: its node, hence its core cap, is still open
        cache = a.cache
        if cache is not None and cache[0] == stamp and stamp != -2:
            return cache[1], cache[2], cache[3]
        units, durations = self._compute(a, node)
        pending = Pending(units, tuple(map(durations.__getitem__, units)))
        a.cache = (stamp, units, durations, pending)
        return units, durations, pending

    def within(
        self, a: Action, node: str | None, most: int
    ) -> tuple[tuple[int, ...], dict[int, float]]:
        """Allowed key units and their durations as ``choices``, of at most ``most`` units
        (a capped tenant's share; at least the minimum): a probe or a fixed DoP over it
        falls back as it would over a node's cores. Not cached: asked only of an action
        whose sizes ``choices`` gave are all over its tenant's share."""
        return self._compute(a, node, most)

    def smallest(self, a: Action, node: str | None) -> tuple[int, float]:
        """The minimum units and the expected duration with them."""
        units, durations, _ = self.choices(a, node)
        return units[0], durations[units[0]]

    def expected(self, a: Action, node: str | None) -> float:
        """Expected duration at the minimum units."""
        return self.smallest(a, node)[1]

    def _compute(
        self, a: Action, node: str | None, most: int | None = None
    ) -> tuple[tuple[int, ...], dict[int, float]]:
        units = a.cpu or a.gpu or (1,)
        if most is not None and units[-1] > most:
            units = tuple(k for k in units if k <= most) or units[:1]
        if a.cpu:
            # Never more cores than the trajectory's node has (unplaced: the largest node
            # taking new work), so fixed DoP and probe sizes stay runnable. A minimum over
            # the cap never reaches a round: it is refused at submit or at placement, or,
            # the largest node gone or cordoned, the action is stranded
            # (``Scheduler.stranded``); kept here only for the figures (fair queuing's
            # work) read before then.
            cap = self.cpu.nodes[node].cores if node is not None else self.biggest_node
            if units[-1] > cap:
                units = tuple(k for k in units if k <= cap) or units[:1]
        profile = a.profile
        learned = None
        if profile is None or profile.efficiency is None:
            learned = self.book.learned(a.type) if a.elastic_capable else None
        elastic_profile = (
            profile if profile is not None and profile.efficiency is not None else learned
        )
        cfg = self.config
        if len(units) > 1:
            if cfg.fixed_dop is not None:
                fitting = [k for k in units if k <= cfg.fixed_dop]
                units = (fitting[-1] if fitting else units[0],)
            elif not cfg.elastic or elastic_profile is None:
                probe = [k for k in units if k >= 2 * units[0]]
                units = (probe[0],) if a.probe and probe else (units[0],)
        if elastic_profile is not None:
            return units, elastic_profile.durations(units)
        base = profile.t1_s if profile is not None else self.book.mean_duration(a.type)
        return units, dict.fromkeys(units, base)
