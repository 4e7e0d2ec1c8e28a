"""Demand of one resource type and the elasticity profile of an action (seed 000 §4.1).

A demand is a fixed amount, a range ``{min, max}`` or a discrete set
``{choices: [...]}``. Elasticity E(m) in (0, 1] turns the single-unit duration
t1 into duration(m) = t1 / (E(m) * m).
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Protocol, Self, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

MAX_UNITS = 4096  # more cores or GPUs than any node has; bounds what validation expands


class _Strict(BaseModel):
    # Strict: ``true`` is no unit count and ``"2"`` no number, in an HTTP request as in a
    # custom resource (a JSON integer is still a number).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class _Bounds(Protocol):
    @property
    def min(self) -> int: ...
    @property
    def max(self) -> int: ...


_B = TypeVar("_B", bound=_Bounds)


def ordered(bounds: _B) -> _B:
    """A range's check: ``min`` ≤ ``max``."""
    if bounds.min > bounds.max:
        raise ValueError(f"min ({bounds.min}) is greater than max ({bounds.max})")
    return bounds


class RangeDemand(_Strict):
    """Any whole number of units from ``min`` to ``max`` inclusive; ``min`` ≤ ``max``, a rule
    between two fields that JSON Schema cannot state (the service answers 400 naming it)."""

    min: Annotated[int, Field(ge=0, le=MAX_UNITS, description="fewest units it can run with")]
    max: Annotated[int, Field(ge=0, le=MAX_UNITS, description="most units it can use")]

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        return ordered(self)


class ChoicesDemand(_Strict):
    """One of a discrete set of unit counts, e.g. GPU DoP ``[1, 2, 4, 8]``."""

    choices: Annotated[
        list[int],
        Field(
            min_length=1,
            description="allowed unit counts",
            json_schema_extra={"uniqueItems": True},
        ),
    ]

    @field_validator("choices")
    @classmethod
    def _valid_choices(cls, v: list[int]) -> list[int]:
        if any(c < 0 or c > MAX_UNITS for c in v):
            raise ValueError(f"choices must be between 0 and {MAX_UNITS}")
        if len(set(v)) != len(v):
            raise ValueError("choices must not repeat")
        return sorted(v)


def _demand_tag(v: Any) -> str:
    if isinstance(v, dict):
        return "choices" if "choices" in v else "range"
    if isinstance(v, ChoicesDemand):
        return "choices"
    if isinstance(v, RangeDemand):
        return "range"
    return "fixed"


# Tagged so that a bad range reports one error, not one per union member. The tag is a part
# of pydantic's error locations ("cpu.range.min"), which is no field a caller sent:
# ``field_errors.field_path`` leaves it out ("cpu.min"), as ``documents.yaml_path`` does.
DEMAND_TAGS = frozenset({"fixed", "range", "choices"})
Demand = Annotated[
    Annotated[int, Tag("fixed")]
    | Annotated[RangeDemand, Tag("range")]
    | Annotated[ChoicesDemand, Tag("choices")],
    Discriminator(_demand_tag),
]


def allowed_units(demand: Demand) -> tuple[int, ...]:
    """All unit counts a demand allows, ascending."""
    if isinstance(demand, int):
        return (demand,)
    if isinstance(demand, RangeDemand):
        return tuple(range(demand.min, demand.max + 1))
    return tuple(demand.choices)


class AmdahlEfficiency(_Strict):
    """Amdahl's law with parallel fraction ``amdahl``: speed-up(m) = 1 / ((1-p) + p/m)."""

    amdahl: Annotated[float, Field(ge=0.0, le=1.0, description="parallel fraction p")]

    def efficiency(self, m: int) -> float:
        p = self.amdahl
        return 1.0 / (m * ((1.0 - p) + p / m))


_WHOLE = re.compile(r"-?(0|[1-9][0-9]*)")


def _unit_count_key(key: object) -> object:
    """A table's key as JSON (and YAML, quoted) writes it, ``"4"``, as the count it names;
    anything else is left to the strict check (``true``, ``"4.0"``, ``" 4"``: refused)."""
    return int(key) if isinstance(key, str) and _WHOLE.fullmatch(key) else key


class TableEfficiency(_Strict):
    """Measured efficiency per unit count; counts between entries are interpolated linearly."""

    table: Annotated[
        dict[Annotated[int, BeforeValidator(_unit_count_key)], float],
        Field(
            min_length=1,
            json_schema_extra={
                "propertyNames": {"pattern": "^[1-9][0-9]*$"},
                "additionalProperties": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 1,
                },
            },
        ),
    ]

    @field_validator("table")
    @classmethod
    def _in_unit_interval(cls, v: dict[int, float]) -> dict[int, float]:
        for m, e in v.items():
            if m < 1:
                raise ValueError(f"unit count {m} must be >= 1")
            if not 0.0 < e <= 1.0:
                raise ValueError(f"efficiency at {m} units is {e}; it must be in (0, 1]")
        return dict(sorted(v.items()))

    def efficiency(self, m: int) -> float:
        keys = list(self.table)
        if m in self.table:
            return self.table[m]
        if m <= keys[0]:
            return self.table[keys[0]]
        if m >= keys[-1]:
            # Beyond the measured range the speed-up stays flat, so efficiency falls as 1/m.
            return self.table[keys[-1]] * keys[-1] / m
        for lo, hi in itertools.pairwise(keys):
            if lo < m < hi:
                w = (m - lo) / (hi - lo)
                return self.table[lo] * (1 - w) + self.table[hi] * w
        raise AssertionError("unreachable")


def _efficiency_tag(v: Any) -> str:
    if isinstance(v, dict):
        return "table" if "table" in v else "amdahl"
    return "table" if isinstance(v, TableEfficiency) else "amdahl"


EFFICIENCY_TAGS = frozenset({"amdahl", "table"})
Efficiency = Annotated[
    Annotated[AmdahlEfficiency, Tag("amdahl")] | Annotated[TableEfficiency, Tag("table")],
    Discriminator(_efficiency_tag),
]


def duration(t1_s: float, efficiency: Efficiency | None, m: int) -> float:
    """Eq. 1 of seed 000: duration(m) = t1 / (E(m)·m); no efficiency curve means not elastic."""
    if m <= 0:
        raise ValueError(f"unit count must be positive, got {m}")
    if efficiency is None:
        return t1_s
    return t1_s / (efficiency.efficiency(m) * m)
