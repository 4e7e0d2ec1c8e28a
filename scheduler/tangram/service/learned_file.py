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
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from tangram.api.field_errors import described
from tangram.api.learned import LearnedState
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


class LearnedFile:
    """A file, replaced whole by each write (a temporary file renamed over it), so a
    scheduler killed mid-write leaves the last whole document."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def where(self) -> str:
        return str(self.path)

    def read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def write(self, document: bytes) -> None:
        # Its owner's alone: it names tenants and holds their idempotency keys.
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(document)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def set_aside(self, document: bytes) -> str:
        bad = self.path.with_name(self.path.name + ".bad")
        os.replace(self.path, bad)
        return str(bad)


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
    # Without the environments to close, the leases held and the rate windows when there
    # are none: a scheduler of an earlier release, which refuses those fields, still reads
    # what was learned.
    empty = {name for name in _NOT_LEARNED if not getattr(state, name)}
    store.write(state.model_dump_json(exclude=empty or None).encode())


_NOT_LEARNED = ("closing", "leases", "windows")  # left out of the document when empty


__all__ = [
    "SAVE_EVERY_S",
    "LearnedFile",
    "LearnedStore",
    "read_state",
    "write_state",
]
