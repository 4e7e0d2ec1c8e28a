"""ARL-Tangram's scheduler: the pure core (``tangram.scheduler.core``) and its entry points."""

from tangram.scheduler.core.dp import dp_arrange, dp_arrange_chunks
from tangram.scheduler.core.scheduler import (
    Assignment,
    Round,
    Scheduler,
    SchedulerConfig,
    SchedulingError,
)

__all__ = [
    "Assignment",
    "Round",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingError",
    "dp_arrange",
    "dp_arrange_chunks",
]
