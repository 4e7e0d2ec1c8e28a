"""Shared wire models: what every component of ARL-Tangram reads and writes.

Actions, demand vectors, efficiency profiles, the cluster file and the trace
format. Pydantic models validate at the boundary; the scheduler core converts
them to plain data once (``Scheduler.submit`` resolves an ``ActionSpec`` into an
``Action``).
"""

from tangram.api.action import ActionKind, ActionSpec, ResourceName
from tangram.api.cluster import ApiSpec, ClusterSpec, NodeSpec, ServiceSpec
from tangram.api.demand import (
    AmdahlEfficiency,
    ChoicesDemand,
    Demand,
    Efficiency,
    RangeDemand,
    TableEfficiency,
    allowed_units,
)
from tangram.api.trace import Step, TrajectoryTrace, load_trace

__all__ = [
    "ActionKind",
    "ActionSpec",
    "AmdahlEfficiency",
    "ApiSpec",
    "ChoicesDemand",
    "ClusterSpec",
    "Demand",
    "Efficiency",
    "NodeSpec",
    "RangeDemand",
    "ResourceName",
    "ServiceSpec",
    "Step",
    "TableEfficiency",
    "TrajectoryTrace",
    "allowed_units",
    "load_trace",
]
