"""What actions compete for in a round: the cores of a node, the GPU pool, an API quota, or a
place for a trajectory not yet on a node.

A ``Resource`` is a value (hashable, compared by kind and name); ``str`` gives the text that
``tangram explain`` and the reasons of waiting actions show (``cpu:n0``, ``gpu``,
``api:search``, ``place``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ResourceKind = Literal["cpu", "gpu", "api", "place"]


@dataclass(frozen=True, slots=True)
class Resource:
    kind: ResourceKind
    name: str = ""  # the node (cpu) or the quota (api); empty for the pool-wide kinds
    # Rounds look resources up in sets and dicts once per queued action: hash once.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind, self.name)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" if self.name else self.kind

    @classmethod
    def cpu(cls, node: str) -> Resource:
        """The cores of ``node``."""
        return cls("cpu", node)

    @classmethod
    def api(cls, quota: str) -> Resource:
        """The units of API quota ``quota``."""
        return cls("api", quota)


GPU = Resource("gpu")  # the GPU pool: chunks are taken pool-wide
PLACE = Resource("place")  # a node for a trajectory's first action (cores and memory)
