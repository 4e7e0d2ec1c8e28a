"""What a reload changed, said by name: ``RewardService judge changed (spec.weights)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


def named_changes(what: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``env swe added``, ``RewardService judge changed (spec.weights, max_calls)``, ...:
    each name whose definition differs, in name order."""
    said = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None or new is None:
            said.append(f"{what} {name} {'added' if old is None else 'removed'}")
        else:
            said.append(f"{what} {name} changed ({', '.join(_differing(old, new)) or 'its form'})")
    return said


def _differing(old: Any, new: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """The fields in which two definitions of one kind differ, a part's own fields named
    (``spec.entrypoint``) one level down."""
    names = _fields(old) if type(old) is type(new) else []
    found = []
    for name in names:
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            deeper = _differing(a, b, f"{prefix}{name}.", depth + 1) if depth < 1 else []
            found += deeper or [prefix + name]
    return found


def _fields(value: Any) -> list[str]:
    if dataclasses.is_dataclass(value):
        return [f.name for f in dataclasses.fields(value)]
    if isinstance(value, BaseModel):
        return list(type(value).model_fields)
    return []
