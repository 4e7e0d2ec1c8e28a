"""What actions compete for in a round: the cores of a node, the GPU pool, an API quota, or a
place for a trajectory not yet on a node.

A ``Resource`` is an immutable value, equal by kind and name; ``str`` gives the text that
``tangram explain`` and the reasons of waiting actions show (``cpu:n0``, ``gpu``,
``api:search``, ``place``). It is a NamedTuple rather than a frozen dataclass because a
round hashes and compares resources once per queued action: a tuple does both in C, a
dataclass in Python (rounds took up to twice as long).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

ResourceKind = Literal["cpu", "gpu", "api", "place"]


class Resource(NamedTuple):
    kind: ResourceKind
    name: str = ""  # the node (cpu) or the quota (api); empty for the pool-wide kinds

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
