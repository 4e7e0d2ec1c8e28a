"""What a node agent reports about its node when it registers (shared wire model)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GpuInfo(_Strict):
    index: Annotated[int, Field(ge=0)]
    name: str
    uuid: str
    memory_gb: Annotated[float, Field(ge=0)]
    healthy: bool = True


class NodeInventory(_Strict):
    """Cores by NUMA node, memory, cgroup layout and GPUs of one node."""

    node_id: Annotated[str, Field(min_length=1, description="stable across agent restarts")]
    hostname: str
    numa: Annotated[
        list[list[int]], Field(description="online core ids of each NUMA node, ascending")
    ]
    memory_gb: Annotated[float, Field(ge=0)]
    cgroup_version: Literal[1, 2]
    gpus: list[GpuInfo] = Field(default_factory=list)

    @property
    def cores(self) -> list[int]:
        return sorted(c for node in self.numa for c in node)
