"""Forward passes shared by the calls running on one replica at once.

The scheduler may run several calls on one resident instance (a RewardService's
``batching.maxCalls``), as an inference server batches requests. Each call's inputs are
queued on the replica; passes take up to ``max_batch`` inputs from the queue in arrival
order, whichever calls they belong to, so concurrent calls share forward passes instead
of taking turns. No thread of its own: a waiting call runs the next pass when none is
running, and returns as soon as all of its own outputs are in.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Pass = Callable[[list[Any]], list[Any]]  # inputs -> one output per input

# The most calls the scheduler runs on one instance at once: the bound of a RewardService's
# ``batching.maxCalls``. Agents are not told each service's own figure, so the threads of
# the GPU role and the worker may grow (on demand only) to this many calls per device.
MAX_CALLS = 1024


@dataclass(eq=False)
class _Call:
    inputs: list[Any]
    outputs: list[Any] = field(default_factory=list)
    taken: int = 0  # inputs already in a pass
    filled: int = 0  # outputs back
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.inputs)


class SharedPasses:
    """The forward passes of one replica (thread-safe)."""

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._queue: deque[_Call] = deque()  # calls with inputs not yet in a pass
        self._running = False
        self.passes = 0  # passes run, for tests and stats

    def run(self, inputs: list[Any], forward: Pass) -> list[Any]:
        """The outputs for ``inputs``, in order. ``forward`` scores one pass. A pass that
        raises, or returns a wrong count, fails the calls whose inputs fail it alone (a
        shared pass that fails is scored again call by call)."""
        call = _Call(list(inputs))
        if not call.inputs:
            return []
        with self._cond:
            self._queue.append(call)
            while call.error is None and call.filled < len(call.inputs):
                if self._running:
                    self._cond.wait()
                    continue
                self._pass(forward)
            if call.error is not None:
                raise call.error
            return call.outputs

    def _pass(self, forward: Pass) -> None:
        """Run one pass of up to ``max_batch`` queued inputs (called holding the lock)."""
        pieces: list[tuple[_Call, int, int]] = []  # (call, first input, end)
        room = self.max_batch
        while room and self._queue:
            c = self._queue[0]
            n = min(room, len(c.inputs) - c.taken)
            pieces.append((c, c.taken, c.taken + n))
            c.taken += n
            room -= n
            if c.taken == len(c.inputs):
                self._queue.popleft()
        self._running = True
        self._cond.release()
        try:
            results = _score(forward, pieces)
        finally:
            self._cond.acquire()
            self._running = False
            self.passes += 1
        for (c, lo, hi), outputs, error in results:
            if error is not None:
                c.error = c.error or error
                if c in self._queue:  # none of its later inputs will be scored
                    self._queue.remove(c)
            else:
                assert outputs is not None
                c.outputs[lo:hi] = outputs
                c.filled += hi - lo
        self._cond.notify_all()


_Piece = tuple[_Call, int, int]  # a call's inputs [lo, hi) in a pass (one piece per call)


def _score(
    forward: Pass, pieces: list[_Piece]
) -> list[tuple[_Piece, list[Any] | None, BaseException | None]]:
    """Each piece's outputs, or the error that failed it. A shared pass that fails is
    scored again call by call, so that only the calls whose inputs fail get the error."""
    batch = [x for c, lo, hi in pieces for x in c.inputs[lo:hi]]
    try:
        outputs = forward(batch)
        if len(outputs) != len(batch):
            raise ValueError(f"score returned {len(outputs)} outputs for {len(batch)} inputs")
    except BaseException as e:
        if len(pieces) == 1:
            return [(pieces[0], None, e)]
        return [r for piece in pieces for r in _score(forward, [piece])]
    out: list[tuple[_Piece, list[Any] | None, BaseException | None]] = []
    at = 0
    for piece in pieces:
        n = piece[2] - piece[1]
        out.append((piece, outputs[at : at + n], None))
        at += n
    return out


__all__ = ["MAX_CALLS", "Pass", "SharedPasses"]
