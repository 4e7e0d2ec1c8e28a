"""A runtime that runs nothing: every command "exits 0" at once, on as many virtual cores
as asked. Only for measuring the scheduler service itself (``tangram bench service``):
with it, an action's whole time is the system's overhead."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tangram.api.wire import EnvSpec, Problem
from tangram.node_agent.env_files import EnvFiles
from tangram.node_agent.execution import (
    ExecError,
    ExecResult,
    Gone,
    Output,
    check_request,
)

_NOTHING = Output(b"", False, b"", False)


class NoopRuntime:
    kind = "noop"
    fast_path = "the noop runtime"
    no_io = ""  # (it runs nothing, whatever is asked)
    problem: Problem | None = None
    warm_failed: Callable[[str, ExecError], None] | None = None  # (nothing is made warm)

    def __init__(self) -> None:
        self._open: set[str] = set()

    def adopt(self) -> list[str]:
        return []  # nothing outlives the agent

    async def open(self, trajectory: str, spec: EnvSpec | None = None) -> tuple[float, bool]:
        self._open.add(trajectory)
        return 0.0, False

    async def keep_warm(self, specs: Sequence[EnvSpec]) -> None:
        return None

    def held(self) -> list[str]:
        return sorted(self._open)

    def close(self, trajectory: str) -> None:
        self._open.discard(trajectory)

    async def gone(self) -> list[Gone]:
        return []

    async def exec(
        self, trajectory: str, argv: Sequence[str], cores: Sequence[int], **options: Any
    ) -> ExecResult:  # runs nothing, so no option matters
        check_request(trajectory in self._open, trajectory, argv, cores)
        t = time.perf_counter()
        return ExecResult.of(0, _NOTHING, False, cores, (t, t, t, t), path="noop")

    async def session(self, trajectory: str, kind: str, code: str, cores: Sequence[int],
                      **kw: Any) -> ExecResult:  # fmt: skip
        raise ExecError("session: the noop runtime runs nothing")

    def files(self, trajectory: str) -> EnvFiles:
        raise ExecError("files: the noop runtime holds no files")

    async def shutdown(self) -> None:
        return None
