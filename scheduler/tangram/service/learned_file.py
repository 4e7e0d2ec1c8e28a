"""The scheduler's learned state on disk (``tangram.api.learned``): read back when it
starts, written every ``SAVE_EVERY_S`` while it runs and once more when it stops.

A write goes to a temporary file that replaces the old one, so a scheduler killed mid-write
leaves the last whole document. A document that cannot be read (not JSON, a field out of
range, from a newer version) is moved aside as ``NAME.bad`` and the scheduler starts
from nothing: the log names the file and the field, and the next save does not overwrite
what someone may want to look at.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import ValidationError

from tangram.api.learned import LearnedState

SAVE_EVERY_S = 30.0  # what a killed scheduler loses at most

log = logging.getLogger("tangram.service")


class LearnedFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> LearnedState | None:
        """The state saved here, or None: none saved yet, or one that cannot be read
        (then moved aside, and why is logged)."""
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.error("cannot read the learned state %s: %s; starting without it", self.path, e)
            return None
        try:
            return LearnedState.model_validate_json(text)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "(document)"
            why = f"{where}: {first['msg']}"
        bad = self.path.with_name(self.path.name + ".bad")
        try:
            os.replace(self.path, bad)
        except OSError as e:
            why += f" (and it could not be moved aside: {e})"
        log.error(
            "the learned state %s is not valid, %s; moved to %s, starting without it",
            self.path,
            why,
            bad,
        )
        return None

    def save(self, state: LearnedState) -> None:
        """Write ``state`` in place of the last, whole or not at all."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(state.model_dump_json().encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)


__all__ = ["SAVE_EVERY_S", "LearnedFile"]
