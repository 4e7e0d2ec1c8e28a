"""Where the scheduler keeps what it learned (``tangram.api.learned``): read back when it
starts, written every ``SAVE_EVERY_S`` while it runs (when something new was learned)
and once more when it stops.

A store holds one document: a file (embedded mode, ``tangram serve --learned-file``), or
a key of a ConfigMap that the operator makes for the pool (``service.kube``), which
outlives the scheduler's pod. A document that cannot be read (not JSON, a field out of
range, from a newer version) is set aside (``NAME.bad``) and the scheduler starts from
nothing: the log names the store and the field, and the next save does not overwrite
what someone may want to look at.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from tangram.api.field_errors import described
from tangram.api.learned import LearnedState

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
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
        return LearnedState.model_validate_json(document)
    except ValidationError as e:
        why = described(e, "(document)")
    try:
        aside = f"moved to {store.set_aside(document)}"
    except OSError as e:
        aside = f"not moved aside ({e})"
    log.error(
        "the learned state %s is not valid, %s; %s, starting without it", store.where, why, aside
    )
    return None


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
