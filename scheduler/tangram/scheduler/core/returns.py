"""Who will be back soon: each node's thinking trajectories, how long they think, and
how much they ask for when they come back.

A trajectory is *thinking* while it has no action queued or running: its model is
generating the next step, and its next action comes back to the same node. The gap
between an action's end and its trajectory's next submission is its think time; the
scheduler learns their mean here, and the mean exec action at its smallest size (its
core-seconds and its seconds). Together they give a node's offered load (the core price's
return term, ``core.pricing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tangram.api.learned import LearnedMean

# Weight of each sample: the plain mean of the first 100, then an exponential mean over
# about the last 100 (a learned quantity follows the workload as it shifts).
MEAN_WEIGHT = 0.01


@dataclass(slots=True)
class RunningMean:
    """The plain mean of the first ``1/MEAN_WEIGHT`` samples, then an exponential one."""

    mean: float = 0.0
    seen: int = 0

    def observe(self, x: float) -> None:
        self.seen += 1
        self.mean += max(MEAN_WEIGHT, 1.0 / self.seen) * (x - self.mean)

    def assume(self, mean: float) -> None:
        """Start from ``mean`` as if learned: later samples move it as after 100 seen."""
        self.mean = mean
        self.seen = max(self.seen, round(1 / MEAN_WEIGHT))

    def export(self) -> LearnedMean:
        return LearnedMean(mean=self.mean, seen=self.seen)

    def restore(self, learned: LearnedMean) -> None:
        self.mean, self.seen = learned.mean, learned.seen


@dataclass(slots=True)
class Returns:
    """Thinking trajectories per node, their learned mean think time, and the mean exec
    action they ask for."""

    thinking: dict[str, int] = field(default_factory=dict)  # node -> trajectories
    think: RunningMean = field(default_factory=RunningMean)
    work: RunningMean = field(default_factory=RunningMean)  # core-seconds, smallest size
    run: RunningMean = field(default_factory=RunningMean)  # seconds at that size

    def asks(self, cores: int, run_s: float) -> None:
        """An exec action was queued: ``cores`` for ``run_s`` seconds at its smallest size."""
        self.work.observe(cores * run_s)
        self.run.observe(run_s)

    def offered_load(self, trajectories: int, cores: int) -> float:
        """The share of ``cores`` that ``trajectories`` would hold at their actions'
        smallest sizes: each asks for the mean work once per cycle of a think time and a
        run. Zero until a think time is known."""
        if cores <= 0 or self.think.mean <= 0.0:
            return 0.0
        return trajectories * self.work.mean / ((self.think.mean + self.run.mean) * cores)

    def starts_thinking(self, node: str | None) -> None:
        if node is not None:
            self.thinking[node] = self.thinking.get(node, 0) + 1

    def stops_thinking(self, node: str | None) -> None:
        if node is not None:
            left = self.thinking[node] - 1
            if left:
                self.thinking[node] = left
            else:
                del self.thinking[node]
