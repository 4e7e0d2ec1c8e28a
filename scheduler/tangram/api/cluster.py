"""The cluster file of ``tangram bench`` (docs/architecture.md): nodes, reward services and
API quotas."""

from __future__ import annotations

import math
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tangram.api.demand import Efficiency

_POW2 = (1, 2, 4, 8)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class NodeSpec(_Strict):
    name: Annotated[str, Field(min_length=1)]
    cpus: Annotated[int, Field(ge=0, description="cores available to actions")] = 0
    numa_nodes: Annotated[int, Field(ge=1)] = 1
    memory_gb: Annotated[float, Field(ge=0)] = 0.0
    gpus: Annotated[int, Field(ge=0, le=8)] = 0
    gpu_memory_gb: Annotated[float, Field(gt=0, description="memory of each GPU")] = 80.0

    @model_validator(mode="after")
    def _numa_divides(self) -> Self:
        if self.cpus and self.cpus % self.numa_nodes:
            raise ValueError(
                f"cpus ({self.cpus}) must split evenly over numa_nodes ({self.numa_nodes})"
            )
        if self.gpus and self.gpus not in _POW2:
            raise ValueError(f"gpus ({self.gpus}) must be 1, 2, 4 or 8 for buddy chunks")
        return self


class ServiceSpec(_Strict):
    """A reward/teacher model service pooled on the GPUs."""

    name: Annotated[str, Field(min_length=1)]
    gpu_memory_gb: Annotated[float, Field(gt=0, description="total weights + working memory")]
    dop_choices: Annotated[list[int], Field(min_length=1)] = Field(
        default_factory=lambda: [1, 2, 4, 8]
    )
    restore_s: Annotated[
        float, Field(ge=0, description="host-to-GPU copy time of the whole model on one GPU")
    ] = 0.0
    restore_fixed_s: Annotated[
        float, Field(ge=0, description="per-restore set-up time, whatever the DoP")
    ] = 0.0
    efficiency: Efficiency | None = None
    revision: Annotated[
        str,
        Field(
            description="changes whenever what the workers load changes (weights, entry "
            "point): instances of an earlier revision are no longer resident"
        ),
    ] = ""
    replicated: Annotated[
        bool,
        Field(
            description="a DoP-k instance is k full replicas, each taking 1/k of a batch "
            "(the built-in PyTorch worker); otherwise the model is sharded over the k GPUs "
            "(tensor parallelism, as in seed 000)"
        ),
    ] = False
    max_calls: Annotated[
        int,
        Field(
            ge=1,
            description="calls one resident instance serves at once, as an inference server "
            "batches them (1: a call has its chunk to itself, as in seed 000)",
        ),
    ] = 1
    batch_slowdown: Annotated[
        float,
        Field(
            ge=0,
            description="a call that joins an instance running n calls takes "
            "(1 + batchSlowdown·n) times as long",
        ),
    ] = 0.0

    def slowdown(self, sharing: int) -> float:
        """How much longer a call takes on an instance already running ``sharing`` calls."""
        return 1.0 + self.batch_slowdown * sharing

    def restore_cost(self, gpus: int) -> float:
        """Seconds to restore a DoP-``gpus`` instance: the k GPUs copy in parallel, a shard
        each, or the whole model each when replicated."""
        return self.restore_fixed_s + (self.restore_s if self.replicated else self.restore_s / gpus)

    @field_validator("dop_choices")
    @classmethod
    def _powers_of_two(cls, v: list[int]) -> list[int]:
        bad = [c for c in v if c not in _POW2]
        if bad:
            raise ValueError(f"DoP choices {bad} are not powers of two up to 8")
        return sorted(set(v))


class ApiSpec(_Strict):
    """A named API quota: concurrency and/or a number of calls per period."""

    name: Annotated[str, Field(min_length=1)]
    concurrency: Annotated[int | None, Field(ge=1)] = None
    rate_per_s: Annotated[float | None, Field(gt=0)] = None
    period_s: Annotated[float, Field(gt=0, description="window the rate is counted over")] = 1.0
    burst: Annotated[
        int | None,
        Field(
            ge=1,
            description="calls that may start at once: at most burst starts in any window of "
            "burst / rate_per_s seconds (unset: the rate's own window)",
        ),
    ] = None
    timeout_s: Annotated[
        float, Field(gt=0, description="unmanaged baseline: how long an over-limit call hangs")
    ] = 600.0

    def window(self) -> tuple[int, float] | None:
        """The rate as (calls, seconds): at most ``calls`` starts in any ``seconds`` window.

        ``floor(rate·period)`` calls over exactly the time they take at ``rate``, so the
        long-run rate is never exceeded (0.5/s over 1 s is 1 call per 2 s, not 1 per 1 s).
        """
        if self.rate_per_s is None:
            return None
        calls = max(1, math.floor(self.rate_per_s * self.period_s + 1e-9))
        return calls, calls / self.rate_per_s

    def burst_window(self) -> tuple[int, float] | None:
        """The burst as (calls, seconds): at most ``burst`` starts in any window of the time
        ``burst`` calls take at the rate, so the long-run rate stays ``rate_per_s``. None
        when unset or the same as :meth:`window`.

        A burst below the rate window's calls is a second limit beside it (both hold: never
        more than the rate in its window either); a burst above them replaces it (more
        than the rate's calls may start at once, and none again until the time they take
        at the rate has passed).
        """
        rate = self.window()
        if self.burst is None or self.rate_per_s is None or rate is None or self.burst == rate[0]:
            return None
        return self.burst, self.burst / self.rate_per_s

    @model_validator(mode="after")
    def _burst_of_a_rate(self) -> Self:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst: only a rate has a burst")
        return self


class ClusterSpec(_Strict):
    # Empty for a running service: nodes join as their agents register.
    nodes: list[NodeSpec] = Field(default_factory=list)
    services: list[ServiceSpec] = Field(default_factory=list)
    apis: list[ApiSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        for label, names in (
            ("nodes", [n.name for n in self.nodes]),
            ("services", [s.name for s in self.services]),
            ("apis", [a.name for a in self.apis]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{label}: duplicate names {sorted(dup)}")
        return self
