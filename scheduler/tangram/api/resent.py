"""A request sent again after an earlier try of it may have reached the scheduler and lost
its answer (the connection dropped after it went out).

The client says so (``Tangram-Resent: SECONDS``, how long ago that try went out). A proxied
API call is the one action the scheduler makes itself, so no agent's journal remembers it
across a restart. A scheduler started before the try went out is the one it could have
reached (a pool never runs two at once: its Deployment is Recreate), and a key it does not
know never reached it; a scheduler started since cannot know whether the one before made
the call, and for a method that is not idempotent it answers ``outcome_unknown`` rather
than making it a second time (``ApiCalls.unsure``).
"""

from __future__ import annotations

import math

RESENT_HEADER = "Tangram-Resent"
# Methods whose second request has the effect of one (RFC 9110 §9.2.2): made again.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


def resent_header(age_s: float) -> str:
    return f"{max(age_s, 0.0):.3f}"


def resent_age(value: str) -> float:
    """Seconds since the earlier try went out; ValueError saying what is wrong."""
    try:
        age = float(value)
    except ValueError:
        age = math.nan
    if not math.isfinite(age) or age < 0:
        raise ValueError(f"{value[:80]!r} is not the seconds since the earlier try went out")
    return age


__all__ = ["IDEMPOTENT_METHODS", "RESENT_HEADER", "resent_age", "resent_header"]
