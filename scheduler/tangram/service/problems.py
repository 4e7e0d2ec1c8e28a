"""Failures of sandboxes and nodes, by cause, over a recent window: what the operator
turns into the ActionPool's SandboxesHealthy condition and its Warning Events.

Agents name each failure's cause in one CamelCase word (an image that is not on the
node, an evicted sandbox, a kubelet with the static CPU manager); the engine notes it
here against what it is about (a TrajectoryEnv or a node). A cause with no new failure
for ``window_s`` is forgotten, so the condition clears by itself once the cause is fixed.

Pure: the clock is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from tangram.api.wire import ProblemFigure

__all__ = ["WINDOW_S", "ProblemLog"]

WINDOW_S = 600.0
MAX_KEPT = 256  # causes × subjects: a bound, whatever agents report


@dataclass(slots=True)
class _Seen:
    count: int  # failures since the first of a run with no gap over the window
    message: str  # the latest
    last: float


class ProblemLog:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[tuple[str, str], _Seen] = {}

    def note(self, reason: str, subject: str, message: str, now: float) -> None:
        self._forget_old(now)
        seen = self._seen.get((reason, subject))
        if seen is None:
            if len(self._seen) >= MAX_KEPT:  # make room: the longest quiet goes
                del self._seen[min(self._seen, key=lambda k: self._seen[k].last)]
            seen = self._seen[(reason, subject)] = _Seen(0, message, now)
        seen.count += 1
        seen.message, seen.last = message, now

    def touch(self, reason: str, subject: str, now: float) -> None:
        """The cause still stands (a refused node reconnecting): kept in the window,
        without counting a new failure."""
        seen = self._seen.get((reason, subject))
        if seen is not None:
            seen.last = now

    def recent(self, now: float) -> list[ProblemFigure]:
        """The causes seen within the window, latest first."""
        self._forget_old(now)
        ordered = sorted(self._seen.items(), key=lambda kv: -kv[1].last)
        return [
            ProblemFigure(
                reason=reason,
                subject=subject,
                count=s.count,
                message=s.message,
                last_s=max(0.0, now - s.last),
            )
            for (reason, subject), s in ordered
        ]

    def _forget_old(self, now: float) -> None:
        for key in [k for k, s in self._seen.items() if now - s.last > self.window_s]:
            del self._seen[key]
