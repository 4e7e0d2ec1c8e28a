"""Where the scheduler keeps what it learned (``tangram.api.learned``): read back when it
starts, written every ``SAVE_EVERY_S`` while it runs (when something new was learned)
and once more when it stops.

A store holds one document: a file (embedded mode, ``tangram serve --learned-file``), or
a key of a ConfigMap that the operator makes for the pool (``service.kube``), which
outlives the scheduler's pod. A document that cannot be read (not JSON, a field out of
range, from a newer version) is set aside (``NAME.bad``) and the scheduler starts from
nothing: the log names the store and the field, and the next save does not overwrite
what someone may want to look at. A document is read as the core will use it: what the
core derives from each part (the trajectory-length estimates, each type's fit, the offered
load) is computed once here, so one it cannot compute with is set aside the same way,
instead of failing every action of the scheduler that resumed it.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from tangram.api.field_errors import described
from tangram.api.learned import LearnedState
from tangram.private_files import LockHeldError, let_go, take_lock, write_private
from tangram.scheduler.core.ordering import LengthModel
from tangram.scheduler.core.profiles import ProfileBook
from tangram.scheduler.core.returns import Returns

SAVE_EVERY_S = 30.0  # what a killed scheduler loses at most

log = logging.getLogger("tangram.service")


class LearnedStore(Protocol):
    """Raw I/O of one document; OSError when the store cannot be reached."""

    @property
    def where(self) -> str: ...

    def read(self) -> bytes | None:
        """The document, or None when none was saved yet."""
        ...

    def write(self, document: bytes) -> None: ...

    def set_aside(self, document: bytes) -> str:
        """Keep ``document`` apart from where the next one goes; say where it went."""
        ...

    def close(self) -> None:
        """Let the next scheduler have it (the scheduler stops)."""
        ...


class InUseError(OSError):
    """Another scheduler (another process, or another store in this one) holds the file."""


class LearnedFile:
    """A file, replaced whole by each write (a temporary file renamed over it), so a
    scheduler killed mid-write leaves the last whole document.

    One scheduler's at a time: two saving to one file would each overwrite what the other
    learned. The first use (a read or a write) takes a lock on ``NAME.lock`` beside it,
    held until ``close`` (or the store is dropped, or the process ends); a store that
    finds it taken is refused with InUseError, an OSError: the engine then starts
    without the state and saves nothing over it, and tries again at each save."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._held: weakref.finalize[[int], LearnedFile] | None = None  # lets go of the lock

    @property
    def where(self) -> str:
        return str(self.path)

    def read(self) -> bytes | None:
        self._hold()
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def write(self, document: bytes) -> None:
        self._hold()
        # Its owner's alone: it names tenants and holds their idempotency keys. Synced
        # before the rename: a node's crash leaves the last document, never an empty one.
        write_private(self.path, document, sync=True)

    def set_aside(self, document: bytes) -> str:
        self._hold()
        bad = self.path.with_name(self.path.name + ".bad")
        os.replace(self.path, bad)
        return str(bad)

    def close(self) -> None:
        """Let another store (the next scheduler) have the file."""
        if self._held is not None:
            self._held()
            self._held = None

    def _hold(self) -> None:
        if self._held is not None:
            return
        try:
            fd = take_lock(self.lock_path)
        except LockHeldError as e:
            raise InUseError(
                f"{self.path} is in use by another scheduler (pid {e.holder}): give each "
                "scheduler its own --learned-file"
            ) from None
        self._held = weakref.finalize(self, let_go, fd)  # a store dropped unclosed too


def read_state(store: LearnedStore) -> LearnedState | None:
    """The state ``store`` holds, or None: none saved yet, or one that is not valid (then
    set aside, and why is logged). OSError when the store cannot be read at all: then
    nothing may be saved over what it may hold."""
    document = store.read()
    if document is None:
        return None
    try:
        state = LearnedState.model_validate_json(document)
    except ValidationError as e:
        why = described(e, "(document)")
    else:
        unusable = _unusable(state)
        if unusable is None:
            return state
        why = unusable
    try:
        aside = f"moved to {store.set_aside(document)}"
    except OSError as e:
        aside = f"not moved aside ({e})"
    log.error(
        "the learned state %s is not valid, %s; %s, starting without it", store.where, why, aside
    )
    return None


def _unusable(state: LearnedState) -> str | None:
    """Why the core cannot use ``state`` ("FIELD: why"), or None: each figure it derives
    from it, computed as it computes them, must be a finite number."""
    for where, derived in _derived(state):
        try:
            value = derived()
        except (ArithmeticError, ValueError) as e:
            return f"{where}: the scheduler cannot compute with it ({type(e).__name__}: {e})"
        if not math.isfinite(value):
            return f"{where}: the scheduler cannot compute with it (it gives {value})"
    return None


def _derived(state: LearnedState) -> Iterator[tuple[str, Callable[[], float]]]:
    """(the field, a figure the core computes from it), for every figure that can differ."""
    lengths = LengthModel()
    lengths.restore(list(state.lengths))
    # The estimate takes one form between consecutive lengths: one figure for each.
    for taken in sorted({0, *state.lengths}):
        yield "lengths", partial(lengths.expected_remaining, taken)
    # Every fit solved, however few its runs or loose its error (so the check sees each).
    book = ProfileBook(min_samples=0, max_p_stderr=math.inf)
    book.restore(state.profiles)
    for name, fit in state.profiles.items():
        yield f"profiles.{name}", partial(book.mean_duration, name)
        yield f"profiles.{name}", partial(_sizes, book, name, fit.counts)
    returns = Returns()
    returns.think.restore(state.think_s)
    returns.work.restore(state.exec_core_s)
    returns.run.restore(state.exec_run_s)
    yield "think_s, exec_core_s, exec_run_s", lambda: returns.offered_load(1, 1)


def _sizes(book: ProfileBook, name: str, counts: list[int]) -> float:
    """The first duration that is not finite of those the learned profile of ``name``
    gives at ``counts``, else 0."""
    profile = book.learned(name)
    if profile is None or not counts:
        return 0.0
    durations = profile.durations(tuple(sorted(set(counts)))).values()
    return next((d for d in durations if not math.isfinite(d)), 0.0)


def write_state(store: LearnedStore, state: LearnedState) -> None:
    """Write ``state`` in place of the last, whole or not at all (OSError if not)."""
    # Without the environments to close, the leases held, the rate windows and the open
    # trajectories' progress when there are none: a scheduler of an earlier release, which
    # refuses those fields, still reads what was learned.
    empty = {name for name in _NOT_LEARNED if not getattr(state, name)}
    store.write(state.model_dump_json(exclude=empty or None).encode())


_NOT_LEARNED = ("closing", "leases", "windows", "progress")  # left out of the document when empty


__all__ = [
    "SAVE_EVERY_S",
    "InUseError",
    "LearnedFile",
    "LearnedStore",
    "read_state",
    "write_state",
]
