"""Queue ordering policies: the queues and, per policy, each action's key and deadline.

* ``fcfs`` (default, seed 000 §4.2): submission order. Every action is on a
  trajectory's critical path, so nothing may starve.
* ``trajectory-priority`` (after Heddle, seed 001 §4): actions of trajectories
  predicted to have the most work left go first — the long tail of a rollout
  batch decides when the step ends, so starting it early shortens the step. The
  prediction is progressive: it is re-made every time the trajectory submits,
  from how many steps it has taken, the durations its actions have shown, and an
  optional client hint of remaining steps. Without a hint, the remaining steps
  are the mean over finished trajectories of (length - steps taken) among those
  that got at least as far (a survival estimate that sharpens as the batch
  progresses). An ageing bound keeps it starvation-free: an action that has
  waited ``ageing_factor`` times its expected duration (at least
  ``min_age_s``) goes ahead of all non-overdue ones, oldest deadline first.
* ``shortest-remaining`` (our addition): the same prediction, least work left
  first. In a closed loop behind a bottleneck (DeepSearch's pdf quota) the mean
  ACT is the mean trajectory completion time less constants, so ending the
  trajectories with little left sooner is what lowers it (docs/benchmarks.md).
  Its ageing bound also scales with the load: an action is overdue after
  ``ageing_wait`` times the recent mean queueing time of started actions (or the
  bound above, whichever is later), a deadline fixed when it is submitted.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Protocol

from tangram.api.learned import MAX_LENGTHS, MAX_STEPS
from tangram.scheduler.core.actions import Trajectory
from tangram.scheduler.core.config import SchedulerConfig


@dataclass(slots=True)
class LengthModel:
    """The lengths of the most recently finished trajectories, for E[remaining steps |
    steps taken so far].

    At most ``window`` of them, not every length ever: RL training shifts trajectory
    lengths as the policy learns, and a long run finishes millions of trajectories, which
    would make the model grow and each estimate (one per submission) slow. An estimate
    reads prefix sums of the sorted lengths, rebuilt once after each change: O(log n).
    A trajectory longer than ``MAX_STEPS`` counts as that long, as the saved state does.
    """

    lengths: list[int] = field(default_factory=list)  # sorted
    default_steps: float = 8.0
    window: int = MAX_LENGTHS
    _arrived: deque[int] = field(default_factory=deque)  # oldest first, to drop it
    _sums: list[int] | None = None  # prefix sums of ``lengths``; None after a change

    def __post_init__(self) -> None:
        self.lengths.sort()
        self._arrived = deque(self.lengths)  # their order is not known: as sorted

    def finished(self, steps: int) -> None:
        steps = min(steps, MAX_STEPS)
        bisect.insort(self.lengths, steps)
        self._arrived.append(steps)
        while len(self._arrived) > self.window:
            del self.lengths[bisect.bisect_left(self.lengths, self._arrived.popleft())]
        self._sums = None

    def export(self, limit: int) -> list[int]:
        """At most ``limit`` lengths: all of them, oldest first, or as many evenly spaced
        quantiles (what ``expected_remaining`` reads is the distribution, not the count)."""
        n = len(self.lengths)
        if n <= limit:
            return list(self._arrived)
        return [self.lengths[(2 * i + 1) * n // (2 * limit)] for i in range(limit)]

    def restore(self, lengths: list[int]) -> None:
        """Start from ``export``'s lengths, the newest last."""
        self.lengths = sorted(lengths)
        self._arrived = deque(lengths)
        self._sums = None

    def expected_remaining(self, taken: int) -> float:
        lengths = self.lengths
        i = bisect.bisect_left(lengths, taken + 1)
        n = len(lengths)
        if i == n:
            # Nothing this long has finished yet: guess it is as far from the end as from the start.
            return max(1.0, float(taken)) if lengths else self.default_steps
        sums = self._sums
        if sums is None:
            sums = self._sums = [0, *accumulate(lengths)]
        return (sums[n] - sums[i]) / (n - i) - taken


class FifoQueue:
    """Queued action ids in submission order: a dict keeps insertion order, O(1) removal."""

    def __init__(self) -> None:
        self._ids: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._ids

    def push(
        self, action_id: str, key: tuple[float, ...], seq: int, deadline: float | None
    ) -> None:
        self._ids[action_id] = None

    def remove(self, action_id: str) -> None:
        del self._ids[action_id]

    def order(self, now: float) -> Iterator[str]:
        return iter(self._ids)


class OrderedQueue:
    """Queued action ids in policy order, with an optional ageing deadline per entry."""

    def __init__(self) -> None:
        self._by_key: list[tuple[tuple[float, ...], str]] = []
        self._by_deadline: list[tuple[float, int, str]] = []
        self._keys: dict[str, tuple[tuple[float, ...], float | None, int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._keys

    def push(
        self, action_id: str, key: tuple[float, ...], seq: int, deadline: float | None
    ) -> None:
        bisect.insort(self._by_key, (key, action_id))
        if deadline is not None:
            bisect.insort(self._by_deadline, (deadline, seq, action_id))
        self._keys[action_id] = (key, deadline, seq)

    def remove(self, action_id: str) -> None:
        key, deadline, seq = self._keys.pop(action_id)
        i = bisect.bisect_left(self._by_key, (key, action_id))
        del self._by_key[i]
        if deadline is not None:
            j = bisect.bisect_left(self._by_deadline, (deadline, seq, action_id))
            del self._by_deadline[j]

    def order(self, now: float) -> Iterator[str]:
        """Overdue entries by deadline, then the rest by key."""
        if not self._by_deadline or self._by_deadline[0][0] > now:
            for _, aid in self._by_key:
                yield aid
            return
        overdue: set[str] = set()
        for deadline, _, aid in self._by_deadline:
            if deadline > now:
                break
            overdue.add(aid)
            yield aid
        for _, aid in self._by_key:
            if aid not in overdue:
                yield aid


ActionQueue = FifoQueue | OrderedQueue


class OrderingPolicy(Protocol):
    """How one policy orders the queue. ``expected`` gives the action's expected duration at
    its minimum units; it is a function so that a policy that needs none computes none."""

    def new_queue(self) -> ActionQueue: ...

    def key(
        self, seq: int, traj: Trajectory, lengths: LengthModel, expected: Callable[[], float]
    ) -> tuple[float, ...]: ...

    def deadline(
        self,
        now: float,
        expected: Callable[[], float],
        config: SchedulerConfig,
        recent_wait_s: float,
    ) -> float | None: ...


class Fcfs:
    """Submission order: the queue keeps insertion order; no key, no deadline."""

    def new_queue(self) -> ActionQueue:
        return FifoQueue()

    def key(
        self, seq: int, traj: Trajectory, lengths: LengthModel, expected: Callable[[], float]
    ) -> tuple[float, ...]:
        return (float(seq),)

    def deadline(
        self,
        now: float,
        expected: Callable[[], float],
        config: SchedulerConfig,
        recent_wait_s: float,
    ) -> float | None:
        return None


def predicted_work(traj: Trajectory, lengths: LengthModel, expected: Callable[[], float]) -> float:
    """Seconds of actions a trajectory is predicted to have left, this one included: its
    client's remaining-steps hint (else the survival estimate) times its mean step so far.
    A hint the trajectory has outlived (it took more steps than said) no longer says
    anything: the survival estimate takes over rather than calling it done."""
    hinted = (
        traj.hint_steps - (traj.steps_done - traj.hint_at) if traj.hint_steps is not None else 0
    )
    remaining = float(hinted) if hinted > 0 else lengths.expected_remaining(traj.steps_done)
    this = expected()
    per_step = traj.busy_s / traj.steps_done if traj.steps_done else this
    return remaining * per_step + this


class TrajectoryPriority:
    """Most predicted work left first; overdue after ``ageing_factor`` x expected duration."""

    def new_queue(self) -> ActionQueue:
        return OrderedQueue()

    def key(
        self, seq: int, traj: Trajectory, lengths: LengthModel, expected: Callable[[], float]
    ) -> tuple[float, ...]:
        return (-predicted_work(traj, lengths, expected), float(seq))

    def deadline(
        self,
        now: float,
        expected: Callable[[], float],
        config: SchedulerConfig,
        recent_wait_s: float,
    ) -> float | None:
        by_duration = config.overdue_after(expected())
        return now + max(by_duration, self.wait_bound(config, recent_wait_s))

    def wait_bound(self, config: SchedulerConfig, recent_wait_s: float) -> float:
        """The least wait before overdue that the load sets: none here."""
        return 0.0


class ShortestRemaining(TrajectoryPriority):
    """Least predicted work left first; overdue after ``ageing_factor`` x expected duration
    or ``ageing_wait`` x the recent mean wait, whichever is later."""

    def key(
        self, seq: int, traj: Trajectory, lengths: LengthModel, expected: Callable[[], float]
    ) -> tuple[float, ...]:
        return (predicted_work(traj, lengths, expected), float(seq))

    def wait_bound(self, config: SchedulerConfig, recent_wait_s: float) -> float:
        return config.ageing_wait * recent_wait_s


# The implementation of each name of tangram.api.orderings.ORDERINGS, which validation, the
# CRD and explain read (tests/unit/test_orderings.py checks that the two have the same names).
POLICIES: Mapping[str, OrderingPolicy] = MappingProxyType(
    {
        "fcfs": Fcfs(),
        "trajectory-priority": TrajectoryPriority(),
        "shortest-remaining": ShortestRemaining(),
    }
)
