"""Basic resource manager (seed 000 §5.1): API concurrency and quota-per-period limits."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Quota:
    name: str
    concurrency: int | None
    per_period: int | None  # calls allowed in any window of `period_s`
    period_s: float
    in_use: int = 0
    starts: deque[float] = field(default_factory=deque)  # start times inside the window

    def _expire(self, now: float) -> None:
        # A call counts until start + period_s. Compare that very sum (not start <= now -
        # period_s, which rounds differently) so the window reopens exactly at the time
        # ``next_expiry_s`` reports.
        while self.starts and self.starts[0] + self.period_s <= now:
            self.starts.popleft()

    def window_room(self, now: float) -> int:
        """Calls the rate window still admits at ``now`` (a large number when unlimited)."""
        self._expire(now)
        if self.per_period is None:
            return 1 << 30
        return max(0, self.per_period - len(self.starts))

    def free(self, now: float) -> int:
        """Units that may start at ``now``: both the concurrency and the rate window allow."""
        room = self.window_room(now)
        if self.concurrency is not None:
            room = min(room, self.concurrency - self.in_use)
        return max(0, room)

    def next_expiry_s(self, now: float) -> float | None:
        """When the oldest call in the rate window stops counting (None: window empty).

        A round leaving actions that wait on this quota wakes up then; an action needing
        several units may need several such expiries.
        """
        self._expire(now)
        if self.per_period is not None and self.starts:
            return self.starts[0] + self.period_s
        return None

    def acquire(self, now: float, n: int) -> None:
        if n > self.free(now):
            raise ValueError(f"quota {self.name}: {n} units requested, {self.free(now)} free")
        self.in_use += n
        if self.per_period is not None:
            self.starts.extend([now] * n)

    def hold(self, n: int) -> None:
        """Hold ``n`` units granted before (by an earlier scheduler) again, whatever room is
        left now: they are in use. Their start is the window's to count (``resume``)."""
        self.in_use += n

    def resume(self, starts: Iterable[float]) -> None:
        """Count earlier starts (an earlier scheduler's, in this clock) in the rate window."""
        if self.per_period is not None:
            self.starts = deque(sorted([*self.starts, *starts]))

    def release(self, n: int) -> None:
        if n > self.in_use:
            raise ValueError(f"quota {self.name}: releasing {n} units, {self.in_use} in use")
        self.in_use -= n
