"""An environment served by a real exec server running as a host process, reached by the
fast path as a sandbox's is; cgroup writes are recorded, not made."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tangram.node_agent.exec_server import Channel
from tangram.node_agent.execution import ExecIO, ExecResult
from tangram.node_agent.fast_path import Command, FastPath, Reachable, start_time


class RecordedCgroups:
    """Cgroup writes recorded, not made: the exec server here is a host process."""

    version = 2

    def __init__(self) -> None:
        self.limits: list[tuple[list[int], float | None]] = []

    def limit(self, group: str, cores: Sequence[int], quota_cores: float | None) -> None:
        self.limits.append((list(cores), quota_cores))

    def oom_kills(self, group: str) -> int | None:
        return None


def fast_path() -> FastPath:
    return FastPath(RecordedCgroups(), [0])  # type: ignore[arg-type]


def reach(sock: Path, pid: int, workdir: Path) -> Reachable:
    """The exec server ``pid`` serving ``sock``, as an environment working in ``workdir``."""
    return Reachable("t", sock, pid, "g", str(workdir), start_time(pid))


class HostServer:
    """A runtime whose one environment ("t") is such an exec server."""

    kind = "host"
    fast_path = ""
    no_io = ""
    problem = None

    def __init__(self, sock: Path, pid: int, workdir: Path) -> None:
        self.fast = fast_path()
        self.reach = reach(sock, pid, workdir)

    def held(self) -> list[str]:
        return ["t"]

    async def exec(self, trajectory: str, argv: Sequence[str], cores: Sequence[int], *,
                   timeout_s: float | None, env: Mapping[str, str], output_cap: int,
                   io: ExecIO | None = None) -> ExecResult:  # fmt: skip
        cmd = Command(list(argv), cores, timeout_s, dict(env), output_cap, io)
        return await self.fast.exec(self.reach, cmd)

    async def shutdown(self) -> None:
        return None


async def file_answer(chan: Channel, op: str, path: str, arg: str = "") -> bytes:
    """One file operation asked of an exec server on ``chan`` (then closed): its first
    frame's kind, a space and its data (``b"Z write /x: ..."``)."""
    try:
        await chan.ask_files(op, path, arg)
        kind, data = await chan.frame()
        return kind + b" " + data
    finally:
        chan.close()
