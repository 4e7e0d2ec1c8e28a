"""A minimal discrete-event loop: callbacks ordered by (time, insertion order)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class EventLoop:
    now: float = 0.0
    _heap: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    _seq: int = 0
    _after_instant: list[Callable[[float], None]] = field(default_factory=list)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is in the past (now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def on_instant_end(self, fn: Callable[[float], None]) -> None:
        """Run ``fn(now)`` after all events of one instant (where scheduling rounds happen)."""
        self._after_instant.append(fn)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, on_progress: Callable[[float], None] | None = None) -> None:
        while self._heap:
            t = self._heap[0][0]
            self.now = t
            while self._heap and self._heap[0][0] == t:
                heapq.heappop(self._heap)[2]()
            for fn in self._after_instant:
                fn(t)
            if on_progress is not None:
                on_progress(t)
