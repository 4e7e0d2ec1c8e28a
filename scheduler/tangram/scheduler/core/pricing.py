"""The price of a core: how far an elastic action's size may grow on a loaded node.

The paper's ACT approximation (Algorithm 2) sees only the actions already queued. In a
closed loop a node's other trajectories are thinking, and their next commands arrive
within seconds; cores handed to a long elastic action now are missing then. The price
makes that cost explicit.

Going from k to k' cores saves the action ``d_k - d_k'`` seconds of completion time and
holds ``k'·d_k' - k·d_k`` more core-seconds. A core-second withheld from a node's ``C``
cores delays each of the ``L`` actions in the node's system by ``1/C`` second, if somebody
wanted it; the chance of that is taken as the node's utilisation ``ρ`` (the share of its
cores held now). So it costs the others about

    μ = ρ · L / C     (ACT-seconds per core-second), L = queued + running actions

The queued ones wait behind every core-second withheld now. The running ones stand for the
arrivals to come: in a closed loop each is followed by its trajectory's next action one
think time later, and a long elastic action's run spans many such cycles. Every term is
known exactly each round; there is no constant to fit. An idle node prices cores at
nearly nothing and the paper's rule decides alone; a busy one stops big actions near the
knee of their speed-up curve.

The return term (rule ``arrivals``) adds the trajectories that are thinking now. A
withheld core-second delays the node's backlog, and so everyone who joins it before it
drains: the queued work at its smallest sizes takes ``D = W/C`` seconds, and a thinking
trajectory is back within that time with probability ``1 - exp(-D/θ)`` for a think time
of learned mean θ (``core.returns``). Whether its action then finds the cores wanted is
taken as the node's offered load ``ρ_o``, as for the others it is the utilisation now: the
share of the cores its ``N`` placed trajectories would hold at their smallest sizes, each
asking for the mean work ``w`` once per think time and run ``r``, ``ρ_o = N·w/((θ+r)·C)``.
With ``T`` of them thinking,

    μ = ρ · (L + min(1, ρ_o) · T·(1 - exp(-D/θ))) / C

It matters at saturation, in the lulls when a node's queue fits its free cores: the paper's
rule (and the ``load`` term alone) would then hand a long run most of them just before the
thinking trajectories come back. At moderate load the round's own candidates make a short
backlog all the time, but the trajectories that come back find free cores; ``ρ_o`` is
what tells the two apart. With no queue (D = 0), or no think time learned yet, the term
is zero.

A size is kept while each step up to it gains at least μ per core-second it adds. For an
Amdahl action with parallel fraction p that is ``k(k+1) ≤ p / ((1 - p)·μ)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from tangram.scheduler.core.cpu_pool import CpuNode


def core_price(queued: int, running: int, held: int, cores: int) -> float:
    """μ of a node: ACT-seconds the others lose per core-second an action holds there.

    ``queued``/``running``: the node's actions waiting for its cores and holding some;
    ``held``: its cores held now, of ``cores``.
    """
    if cores <= 0:
        return 0.0
    return (held / cores) * (queued + running) / cores


def return_price(
    thinking: int, backlog_s: float, think_s: float, held: int, cores: int, *, offered: float
) -> float:
    """The return term: ACT-seconds per withheld core-second of the ``thinking``
    trajectories that come back (mean think time ``think_s``) before the node's backlog
    drains in ``backlog_s``, to find its cores wanted at the node's ``offered`` load;
    zero while no think time is known."""
    if cores <= 0 or thinking <= 0 or offered <= 0.0:
        return 0.0
    back = returning(backlog_s, think_s)
    return (held / cores) * min(1.0, offered) * thinking * back / cores


def returning(backlog_s: float, think_s: float) -> float:
    """The chance a thinking trajectory is back before a backlog of ``backlog_s`` drains,
    for a mean think time ``think_s``: ``1 - exp(-D/θ)``; zero with no backlog or no
    think time learned."""
    if backlog_s <= 0.0 or think_s <= 0.0:
        return 0.0
    return -math.expm1(-backlog_s / think_s)  # exact for small D/θ


@dataclass(frozen=True, slots=True)
class NodePrice:
    """A node's core price and what it is made of, for ``tangram explain`` and the
    metrics: ``total`` = ``load`` + ``returns``."""

    utilisation: float  # ρ: the share of its cores held now
    actions: int  # L: its actions queued for cores and running
    load: float  # ρ·L/C
    thinking: int = 0  # T: its trajectories thinking (0 when the return term is off)
    backlog_s: float = 0.0  # D: its queued work at the smallest sizes, over its cores
    think_s: float = 0.0  # θ: the learned mean think time (0: none yet)
    back: float = 0.0  # 1 - exp(-D/θ): the chance a thinking one is back before D
    offered: float = 0.0  # ρ_o: its offered load
    returns: float = 0.0  # the return term

    @property
    def total(self) -> float:
        return self.load + self.returns


def node_price(
    node: CpuNode,
    queued: int,
    *,
    queued_work: float = 0.0,
    thinking: int = 0,
    think_s: float = 0.0,
    offered: float = 0.0,
) -> NodePrice:
    """μ of a node with ``queued`` actions waiting for its cores, and with the return term
    when given: ``queued_work`` core-seconds queued there (at their smallest sizes),
    ``thinking`` trajectories placed there thinking, for ``think_s`` on average, at the
    node's ``offered`` load."""
    held, cores = node.cores - node.free_cores, node.cores
    load = core_price(queued, node.holders, held, cores)
    utilisation = held / cores if cores > 0 else 0.0
    actions = queued + node.holders
    if not thinking:
        return NodePrice(utilisation, actions, load, offered=offered)
    backlog_s = queued_work / cores if cores > 0 else 0.0
    back = returning(backlog_s, think_s)
    returns = return_price(thinking, backlog_s, think_s, held, cores, offered=offered)
    return NodePrice(
        utilisation, actions, load, thinking, backlog_s, think_s, back, offered, returns
    )


def priced_sizes(units: tuple[int, ...], durations: Mapping[int, float], price: float) -> int:
    """How many of ``units`` (ascending) are worth their cores at ``price``: at least one.

    Stops at the first step whose gain in the action's own time is below ``price`` times
    the core-seconds it adds. For a concave speed-up (Amdahl's) no later step pays either;
    for a measured table that is not concave a later step might, but a size is only worth
    having if every step up to it pays.
    """
    if price <= 0.0:
        return len(units)
    kept = 1
    for lo, hi in pairwise(units):
        d_lo, d_hi = durations[lo], durations[hi]
        gain = d_lo - d_hi
        cost = hi * d_hi - lo * d_lo
        if cost > 0.0 and gain < price * cost:
            break
        kept += 1
    return kept
