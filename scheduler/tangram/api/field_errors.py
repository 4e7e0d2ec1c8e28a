"""How a validation error is told to a person: the dotted path of each bad field (as the
YAML, JSON or CLI input spells it) and what is wrong with it, so an error names the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from tangram.api.demand import DEMAND_TAGS, EFFICIENCY_TAGS

# The fields that hold a tagged union (a Demand, an Efficiency), by name wherever they are
# (a request's ``cpu``, a batch item's ``exec.cpu``, a trace step's ``action.gpu``), and the
# tags of its members, which pydantic puts in a location right after the field.
_TAGGED = {"cpu": DEMAND_TAGS, "gpu": DEMAND_TAGS, "efficiency": EFFICIENCY_TAGS}


def field_path(loc: Sequence[int | str], whole: str = "") -> str:
    """``spec.nodes.0.cpus`` for pydantic's location; ``whole`` for the input as a whole.

    The tag of a tagged union's member is left out: it is no key of the input, so
    ``cpu.range`` (a range whose min is over its max) is ``cpu``, ``cpu.choices.choices``
    ``cpu.choices``, ``efficiency.amdahl.amdahl`` ``efficiency.amdahl``."""
    parts = [
        str(p)
        for i, p in enumerate(loc)
        if not (i and isinstance(p, str) and p in _TAGGED.get(str(loc[i - 1]), ()))
    ]
    return ".".join(parts) or whole


def alternatives(names: Sequence[str]) -> str:
    """``a, b or c``: a list of choices as a message says it."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def error_message(err: Any) -> str:
    """A pydantic error's message, without the "Value error, " it puts before the words of
    a check that raised ValueError (they say it all)."""
    return str(err["msg"]).removeprefix("Value error, ")


def described(e: ValidationError, whole: str = "", most: int = 1) -> str:
    """ "path: message" of the first ``most`` problems, then how many more there are."""
    errors = e.errors(include_url=False)
    parts = [f"{field_path(err['loc'], whole)}: {error_message(err)}" for err in errors[:most]]
    more = len(errors) - most
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
