"""The scheduler's settings and the error it raises for requests it cannot accept."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tangram.api.orderings import (
    CORE_PRICES,
    DEFAULT_ORDERING,
    GPU_JOINING,
    ORDERINGS,
    QUOTA_WAITING,
    CorePrice,
    GpuJoining,
    QuotaWaiting,
)

Ordering = str  # a name of tangram.api.orderings.ORDERINGS


class SchedulingError(ValueError):
    """A request the scheduler cannot accept; ``field`` names the offending input."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    ordering: Ordering = DEFAULT_ORDERING
    depth: int = 2
    explore: Literal["paper", "doubling"] = "paper"  # head counts the estimate tries
    max_candidates: int | None = None  # per round; None = the whole fitting prefix
    elastic: bool = True
    fixed_dop: int | None = None  # baseline: elastic actions always get this many units
    ageing_factor: float = 4.0  # trajectory-priority: overdue after this x expected duration
    min_age_s: float = 1.0
    # shortest-remaining: also not overdue before this x the recent mean queueing time
    ageing_wait: float = 2.0
    horizon: int | None = None  # queued actions per resource the estimate looks at
    learn: bool = True
    tenant_fairness: bool = True  # fair queuing between tenants; False: one order for all
    # An action waiting for one quota: "hold" closes every quota it needs (per-quota first
    # come first served, the paper's rule); "pass" lets calls that need only a quota with
    # room pass it, the first waiter keeping just its own units of it.
    quota_waiting: QuotaWaiting = "hold"
    # How far an elastic action may grow on a loaded node (core.pricing): "none" sizes by
    # the paper's ACT estimate alone; "load" first drops the sizes whose gain per extra
    # core-second is below the node's core price (its actions, queued or running, per core);
    # "arrivals" (the default) adds the thinking trajectories back before its queue drains,
    # as far as the node's offered load says their actions will find the cores wanted.
    core_price: CorePrice = "arrivals"
    # Restore instances ahead of their calls into free GPU memory (core.gpu_pool): for each
    # service with calls queued or running, one at its largest DoP where its next call
    # would land, while that chunk is free.
    restore_ahead: bool = True
    # While a call waits for GPUs, calls joining a running instance: "no-delay" only when
    # they end before the instance's last call (the chunk frees as it would without them);
    # "until-overdue" also when they keep it longer, until the waiting call is overdue
    # (``overdue_after``): calls of a busy instance batch instead of taking turns with it.
    gpu_joining: GpuJoining = "until-overdue"

    def overdue_after(self, expected_s: float) -> float:
        """The ageing bound: how long an action expected to take ``expected_s`` may wait
        before it is overdue (``ageing_factor`` x that, and at least ``min_age_s``)."""
        return max(self.min_age_s, self.ageing_factor * expected_s)

    def __post_init__(self) -> None:
        if self.quota_waiting not in QUOTA_WAITING:
            raise SchedulingError("quota_waiting", f"unknown rule {self.quota_waiting!r}")
        if self.gpu_joining not in GPU_JOINING:
            raise SchedulingError("gpu_joining", f"unknown rule {self.gpu_joining!r}")
        if self.core_price not in CORE_PRICES:
            raise SchedulingError("core_price", f"unknown rule {self.core_price!r}")
        if not 0 <= self.ageing_wait < math.inf:  # NaN or inf would make nothing overdue
            raise SchedulingError("ageing_wait", "must be a finite number >= 0")
        if self.depth < 1:
            raise SchedulingError("depth", "must be at least 1")
        if self.max_candidates is not None and self.max_candidates < 1:
            raise SchedulingError("max_candidates", "must be at least 1")
        if self.fixed_dop is not None and self.fixed_dop < 1:
            raise SchedulingError("fixed_dop", "must be at least 1")
        if self.explore not in ("paper", "doubling"):
            raise SchedulingError("explore", f"unknown rule {self.explore!r}")
        if self.ordering not in ORDERINGS:
            raise SchedulingError("ordering", f"unknown policy {self.ordering!r}")
