"""How a validation error is told to a person: the dotted path of each bad field (as the
YAML, JSON or CLI input spells it) and what is wrong with it, so an error names the field."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError


def field_path(loc: Sequence[int | str], whole: str = "") -> str:
    """``spec.nodes.0.cpus`` for pydantic's location; ``whole`` for the input as a whole."""
    return ".".join(str(p) for p in loc) or whole


def alternatives(names: Sequence[str]) -> str:
    """``a, b or c``: a list of choices as a message says it."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def described(e: ValidationError, whole: str = "", most: int = 1) -> str:
    """ "path: message" of the first ``most`` problems, then how many more there are."""
    errors = e.errors(include_url=False)
    parts = [f"{field_path(err['loc'], whole)}: {err['msg']}" for err in errors[:most]]
    more = len(errors) - most
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
