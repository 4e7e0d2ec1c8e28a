"""An action: one atomic external invocation (seed 000 §2.4, §4.1)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tangram.api.demand import (
    ChoicesDemand,
    Demand,
    Efficiency,
    RangeDemand,
    allowed_units,
)

MAX_T1_S = 1e7  # ~4 months: beyond it a duration is a mistake, and sums of them overflow


class ActionKind(StrEnum):
    EXEC = "exec"  # argv in a trajectory's environment container (CPU)
    SERVICE = "service"  # one call of a RewardService (GPU)
    API = "api"  # one request against a named API quota


_API_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")

ResourceName = str
"""``cpu``, ``memory``, ``gpu``, ``gpu_memory`` or ``api:<name>``."""

ElasticKey = Literal["cpu", "gpu"]


class ActionSpec(BaseModel):
    """The resource side of an action, as a trace line or an HTTP request carries it.

    Unknown fields are rejected so that a misspelt resource never silently means "no demand".
    Memory is not per action: a trajectory reserves its memory for its whole life when it
    opens (seed 000 §5.2), and a RewardService declares its GPU memory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: ActionKind
    type: Annotated[
        str | None,
        Field(description="action type for learned profiles; defaults to kind plus target"),
    ] = None
    cpu: Annotated[Demand | None, Field(description="cores, exec actions")] = None
    gpu: Annotated[Demand | None, Field(description="GPUs (DoP), service actions")] = None
    service: Annotated[str | None, Field(description="RewardService name, service actions")] = None
    api: Annotated[str | None, Field(description="API quota name, api actions")] = None
    quotas: Annotated[
        dict[str, int],
        Field(description="extra API quota units held while the action runs, by quota name"),
    ] = Field(default_factory=dict)
    key: Annotated[ElasticKey | None, Field(description="key elastic resource")] = None
    t1_s: Annotated[
        float | None, Field(gt=0, le=MAX_T1_S, description="duration with one key unit")
    ] = None
    efficiency: Efficiency | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.kind is ActionKind.EXEC and self.service is not None:
            raise ValueError("service: only service actions name a service")
        if self.kind is ActionKind.SERVICE and not self.service:
            raise ValueError("service: a service action must name its RewardService")
        if self.kind is ActionKind.API and not self.api:
            raise ValueError("api: an api action must name its quota")
        if self.kind is not ActionKind.API and self.api is not None:
            raise ValueError("api: only api actions name an api; use quotas for extra quota units")
        if self.kind is not ActionKind.SERVICE and self.gpu is not None:
            raise ValueError("gpu: only service actions take GPUs")
        if self.kind is not ActionKind.EXEC and self.cpu is not None:
            raise ValueError("cpu: only exec actions take cores")
        for name, units in {**({self.api: 1} if self.api else {}), **self.quotas}.items():
            if not _API_NAME.match(name):
                raise ValueError(
                    f"api: quota name {name!r} must be lower-case letters, digits, -_."
                )
            if units < 1:
                raise ValueError(f"quotas.{name}: must be at least 1")
        for field in ("cpu", "gpu"):
            demand = getattr(self, field)
            if demand is not None and min(allowed_units(demand)) < 1:
                # The part of the demand that allows none (``cpu.min``), as it was spelled.
                part = (
                    ".min" if isinstance(demand, RangeDemand)
                    else ".choices" if isinstance(demand, ChoicesDemand)
                    else ""
                )  # fmt: skip
                raise ValueError(f"{field}{part}: an action needs at least one unit")
        key = self.elastic_key()
        if self.key is not None and self.key not in self._variable_resources():
            raise ValueError(f"key: {self.key} is not a resource this action demands elastically")
        if self.efficiency is not None and key is None:
            raise ValueError("efficiency: given, but no resource has a range or choices of units")
        return self

    def _variable_resources(self) -> list[ElasticKey]:
        elastic: list[ElasticKey] = []
        if _is_variable(self.cpu):
            elastic.append("cpu")
        if _is_variable(self.gpu) or (self.kind is ActionKind.SERVICE and self.gpu is None):
            elastic.append("gpu")  # without a gpu field the DoP choices come from the service
        return elastic

    def elastic_key(self) -> ElasticKey | None:
        """The key elastic resource: ``key`` if given, else the one demand with several counts."""
        if self.key is not None:
            return self.key
        elastic = self._variable_resources()
        if len(elastic) > 1:
            raise ValueError("key: several resources are elastic; name the key one")
        return elastic[0] if elastic else None

    def action_type(self) -> str:
        """The profile key: ``type`` if given, else kind plus target or core demand.

        The demand shape is part of the default so that one-core shell commands and
        1-32-core test suites are never learned as one type.
        """
        if self.type:
            return self.type
        target = self.service or self.api
        if target:
            return f"{self.kind.value}:{target}"
        units = allowed_units(self.cpu) if self.cpu is not None else (1,)
        shape = f"{units[0]}" if len(units) == 1 else f"{units[0]}-{units[-1]}"
        return f"{self.kind.value}:cpu{shape}"


def _is_variable(demand: Demand | None) -> bool:
    return isinstance(demand, RangeDemand | ChoicesDemand) and len(allowed_units(demand)) > 1
