"""Closed-loop replay of a trace (docs/architecture.md): think, submit, wait for the result, repeat.

The engine owns trajectories and time; *backends* own resources. Each action kind
is routed to one backend — the real ``Scheduler`` for ARL-Tangram policies, or a
baseline model for one resource class — so a baseline differs from ARL-Tangram
only where the paper's baseline does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from tangram.api.action import ActionKind, ActionSpec
from tangram.api.trace import TrajectoryTrace
from tangram.sim.events import EventLoop
from tangram.sim.records import ActionRecord, SimResult

Done = Callable[[ActionRecord], None]


class Backend(Protocol):
    """Runs the actions of some kinds. Calls ``done(record)`` (via the loop) when one ends."""

    def open(self, traj: TrajectoryTrace, now: float, ready: Callable[[], None]) -> None:
        """The trajectory starts; call ``ready()`` (now or later) once it is admitted."""
        ...

    def close(self, traj: TrajectoryTrace, now: float) -> None: ...

    def submit(self, record: ActionRecord, spec: ActionSpec, done: Done) -> None: ...

    def finish(self, now: float) -> tuple[dict[str, float], list[str]]:
        """At the end: (unit-seconds held per action kind, notes)."""
        ...


@dataclass(slots=True)
class _Traj:
    trace: TrajectoryTrace
    not_ready: int  # backends that have not admitted the trajectory yet
    step: int = 0
    waiting_since: float | None = None  # an action was generated before admission


class Replay:
    def __init__(self, loop: EventLoop, routes: dict[ActionKind, Backend], policy: str) -> None:
        self.loop = loop  # the backends' loop: they schedule their own events on it
        self.routes = routes
        self.backends: list[Backend] = list({id(b): b for b in routes.values()}.values())
        self.result = SimResult(policy)
        self._open = 0
        self._ended_at = 0.0  # when the last trajectory ended

    def run(
        self, trace: Sequence[TrajectoryTrace], progress: Callable[[int, int], None] | None = None
    ) -> SimResult:
        total = sum(len(t.steps) for t in trace)
        for t in trace:
            self.loop.at(t.arrival_s, partial(self._arrive, t))
        last = [0]

        def tick(_: float) -> None:
            n = len(self.result.records)
            if progress is not None and n != last[0]:
                last[0] = n
                progress(n, total)

        self.loop.run(tick)
        if self._open:
            raise RuntimeError(f"{self._open} trajectories never finished: the replay deadlocked")
        # The last trajectory's end: events may outlive it (a timeout never needed, a
        # timer of a rate window) and must not stretch the batch or what it held.
        end = self.result.makespan_s = self._ended_at
        for b in self.backends:
            units, notes = b.finish(end)
            for kind, held in units.items():
                by = self.result.unit_seconds_by
                by[kind] = by.get(kind, 0.0) + held
            self.result.notes.extend(notes)
        return self.result

    def _arrive(self, trace: TrajectoryTrace) -> None:
        self._open += 1
        now = self.loop.now
        state = _Traj(trace, len(self.backends))
        for b in self.backends:
            b.open(trace, now, lambda: self._ready(state))
        if not trace.steps:
            return
        # Generation of the first step runs while the environment starts up.
        self.loop.at(now + trace.steps[0].think_s, lambda: self._submit(state))

    def _ready(self, state: _Traj) -> None:
        state.not_ready -= 1
        if state.not_ready:
            return
        if not state.trace.steps:
            self._close(state)
        elif state.waiting_since is not None:
            self._submit_at(state, state.waiting_since)

    def _submit(self, state: _Traj) -> None:
        if state.not_ready:  # the environment is not up yet: the action waits for it
            state.waiting_since = self.loop.now
            return
        self._submit_at(state, self.loop.now)

    def _submit_at(self, state: _Traj, submitted: float) -> None:
        state.waiting_since = None
        spec = state.trace.steps[state.step].action
        record = ActionRecord(
            state.trace.id, state.step, spec.kind.value, spec.action_type(), submitted
        )
        self.routes[spec.kind].submit(record, spec, lambda r: self._done(state, r))

    def _done(self, state: _Traj, record: ActionRecord) -> None:
        self.result.records.append(record)
        state.step += 1
        if state.step >= len(state.trace.steps):
            self._close(state)
            return
        think = state.trace.steps[state.step].think_s
        self.loop.at(self.loop.now + think, lambda: self._submit(state))

    def _close(self, state: _Traj) -> None:
        for b in self.backends:
            b.close(state.trace, self.loop.now)
        self._open -= 1
        self._ended_at = self.loop.now
