"""The queue orderings a pool may use: one table, by name.

The scheduler's configuration, the ActionPool CRD (``spec.scheduling.ordering``, whose enum
is generated from it) and ``tangram explain`` all read it. Each name's implementation is in
``tangram.scheduler.core.ordering`` (a test checks that every name has one). It lives here,
in the wire models, because the CRD models may not import the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Literal, get_args

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from tangram.api.field_errors import alternatives

ORDERINGS: Mapping[str, str] = MappingProxyType(
    {
        "fcfs": "first come first served: submission order",
        "trajectory-priority": "trajectories with the most work left first, with an ageing bound",
        "shortest-remaining": "trajectories with the least work left first, with an ageing bound"
        " that grows with the recent wait",
    }
)
DEFAULT_ORDERING = "fcfs"

# How an action waiting for one API quota treats the others it needs (docs/scheduler.md).
QuotaWaiting = Literal["hold", "pass"]
QUOTA_WAITING: tuple[str, ...] = get_args(QuotaWaiting)

# Whether calls joining a running service instance may keep its GPUs past the time a
# call waiting for GPUs would get them (docs/scheduler.md, "Joining a running instance").
GpuJoining = Literal["no-delay", "until-overdue"]
GPU_JOINING: tuple[str, ...] = get_args(GpuJoining)

# How far an elastic action may grow on a loaded node (docs/scheduler.md, "The core price").
CorePrice = Literal["none", "load", "arrivals"]
CORE_PRICES: tuple[str, ...] = get_args(CorePrice)


def expected_orderings() -> str:
    """The names as pydantic lists a Literal's: ``'a', 'b' or 'c'``."""
    return alternatives([repr(n) for n in ORDERINGS])


def _check(value: object) -> str:
    if isinstance(value, str) and value in ORDERINGS:
        return value
    # The error a Literal of the names would give, so messages stay as they were.
    raise PydanticCustomError(
        "literal_error", "Input should be {expected}", {"expected": expected_orderings()}
    )


# A model field holding an ordering's name; its JSON schema (hence the CRD) lists the names.
OrderingName = Annotated[
    str, PlainValidator(_check), WithJsonSchema({"enum": list(ORDERINGS), "type": "string"})
]
