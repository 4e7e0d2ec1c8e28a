"""Basic resource manager (seed 000 §5.1): API concurrency and quota-per-period limits."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tangram.api.cluster import ApiSpec


@dataclass(slots=True)
class Quota:
    name: str
    concurrency: int | None
    per_period: int | None  # calls allowed in any window of `period_s`
    period_s: float
    in_use: int = 0
    starts: deque[float] = field(default_factory=deque)  # start times inside the window
    # A second, longer window (a burst below the rate): at most ``cap`` calls in any
    # ``cap_s``. ``per_period``/``period_s`` is then the burst's, the most at once.
    cap: int | None = None
    cap_s: float = 0.0

    @classmethod
    def of(cls, spec: ApiSpec) -> Quota:
        """The quota ``spec`` defines (its rate and burst: :meth:`ApiSpec.burst_window`)."""
        q = cls(spec.name, None, None, 1.0)
        q.set_limits(spec)
        return q

    def set_limits(self, spec: ApiSpec) -> None:
        """Take ``spec``'s limits (units in use and the starts counted stay)."""
        rate, burst = spec.window(), spec.burst_window()
        self.concurrency, self.cap, self.cap_s = spec.concurrency, None, 0.0
        self.per_period, self.period_s = burst or rate or (None, 1.0)
        if burst is not None and rate is not None and burst[0] < rate[0]:
            self.cap, self.cap_s = rate

    def _expire(self, now: float) -> None:
        # A call counts until start + period_s. Compare that very sum (not start <= now -
        # period_s, which rounds differently) so the window reopens exactly at the time
        # ``next_expiry_s`` reports.
        span = max(self.period_s, self.cap_s)
        while self.starts and self.starts[0] + span <= now:
            self.starts.popleft()

    def _outside(self, now: float) -> int:
        """How many of the starts kept no longer count in the (shorter) burst window."""
        if self.cap is None:
            return 0
        return bisect_right(self.starts, now, key=lambda s: s + self.period_s)

    def window_room(self, now: float) -> int:
        """Calls the rate window still admits at ``now`` (a large number when unlimited)."""
        self._expire(now)
        if self.per_period is None:
            return 1 << 30
        room = self.per_period - (len(self.starts) - self._outside(now))
        if self.cap is not None:
            room = min(room, self.cap - len(self.starts))
        return max(0, room)

    def free(self, now: float) -> int:
        """Units that may start at ``now``: both the concurrency and the rate window allow."""
        room = self.window_room(now)
        if self.concurrency is not None:
            room = min(room, self.concurrency - self.in_use)
        return max(0, room)

    def next_expiry_s(self, now: float) -> float | None:
        """When the oldest call in the rate window stops counting (None: window empty).
        With a burst below the rate (two windows), when the one that binds lets one more
        call start (None: neither ever binds more than now).

        A round leaving actions that wait on this quota wakes up then; an action needing
        several units may need several such expiries.
        """
        self._expire(now)
        if self.per_period is None or not self.starts:
            return None
        if self.cap is None:
            return self.starts[0] + self.period_s
        out = self._outside(now)
        capped = self.starts[0] + self.cap_s
        burst_room = self.per_period - (len(self.starts) - out)
        cap_room = self.cap - len(self.starts)
        if out == len(self.starts):  # the burst window is empty: only the cap may bind
            return capped if cap_room < burst_room else None
        burst = self.starts[out] + self.period_s
        if burst_room != cap_room:
            return burst if burst_room < cap_room else capped
        return max(burst, capped)  # both bind: the later one frees the next start

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
