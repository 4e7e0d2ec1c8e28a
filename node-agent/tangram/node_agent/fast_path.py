"""Allocate-on-execution through an environment's exec server: what the Docker and the
pod runtimes share once they know where an environment's exec server and cgroup are.

Before each command the environment's cgroup gets exactly the action's cores and a
matching quota; the exec server (the environment's PID 1) starts the command, which so
inherits the cgroup; afterwards the cgroup goes back to the idle set. Every connection
checks that the socket is the exec server's own (its pid, SO_PEERCRED), so a command that
plants a server over the socket's name cannot answer for the environment.
"""

from __future__ import annotations

import asyncio
import signal
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tangram.node_agent.cgroups import CgroupError, Cgroups
from tangram.node_agent.env_files import EnvFiles
from tangram.node_agent.exec_server import Channel
from tangram.node_agent.execution import (
    IDLE_QUOTA_CORES,
    Allotments,
    ExecError,
    ExecIO,
    ExecResult,
    Output,
    check_request,
    feeding,
    render,
    supervise,
)
from tangram.node_agent.sessions import (
    INTERRUPT_GRACE_S,
    BashSession,
    PythonSession,
    Session,
)

__all__ = ["Command", "ExecServerRuntime", "FastPath", "Reachable", "cgroup_of"]


@dataclass(frozen=True, slots=True)
class Reachable:
    """An environment as the fast path reaches it."""

    key: str  # names its cgroup's holders: concurrent actions share the cgroup
    socket: Path  # the exec server's socket, as a path this agent can connect to
    pid: int  # the exec server, as this agent's /proc sees it
    cgroup: str  # its group, relative to the cgroup root
    workdir: str
    started: int = 0  # the exec server's start time (/proc/<pid>/stat): pids are reused
    proc_root: Path = Path("/proc")

    def alive(self) -> bool:
        """The exec server is still the process this environment was found with: a dead
        server's pid may have gone to another process, even another sandbox's server,
        which the listener check alone would then let through."""
        fields = stat_fields(self.pid, self.proc_root)
        if fields is not None and fields[0] in ("Z", "X"):  # ended, not yet reaped
            return False
        return not self.started or (fields is not None and int(fields[19]) == self.started)

    def check_alive(self) -> None:
        if not self.alive():
            raise ExecError(
                f"the environment's exec server (pid {self.pid}) has ended: the environment is "
                "gone",
                ended=True,
            )


def stat_fields(pid: int, proc_root: Path = Path("/proc")) -> list[str] | None:
    """Process ``pid``'s ``stat`` after "pid (comm) " (state first: field 3 is [0]);
    None when there is no such process."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # (comm may hold spaces and parentheses)


def start_time(pid: int, proc_root: Path = Path("/proc")) -> int:
    """When process ``pid`` started (clock ticks since boot); 0 when there is none."""
    fields = stat_fields(pid, proc_root)
    return int(fields[19]) if fields else 0  # field 22


@dataclass(frozen=True, slots=True)
class Command:
    """One action's command as the runtimes run it."""

    argv: list[str]  # {dop} already filled in
    cores: Sequence[int]
    timeout_s: float | None
    env: dict[str, str]
    output_cap: int
    io: ExecIO | None = None  # stdin, streamed output, signals, a terminal


def cgroup_of(pid: int, cgroups: Cgroups, proc_root: Path = Path("/proc")) -> str:
    """The cgroup of process ``pid`` that holds its CPU limits, read from
    ``/proc/<pid>/cgroup`` (cgroupfs and systemd drivers, v1 and v2), checked readable."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError as e:
        raise ExecError(f"the container's cgroup is not visible here: {e.strerror}") from None
    paths: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for ctrl in controllers.split(",") if controllers else [""]:
            paths[ctrl] = path
    if cgroups.version == 1:
        group = paths.get("cpuset")
        if group is None or paths.get("cpu") != group:
            raise ExecError("the container's cpuset and cpu cgroups differ")
    else:
        group = paths.get("")
    if not group:
        raise ExecError("the container's cgroup was not found")
    group = group.strip("/")
    try:
        cgroups.cpus(group)
    except OSError as e:
        raise ExecError(f"the container's cgroup {group}: {e.strerror}") from None
    return group


class FastPath:
    """Runs commands and sessions in reachable environments on exactly their cores."""

    def __init__(self, cgroups: Cgroups, idle_cores: Sequence[int]) -> None:
        self.cgroups = cgroups
        self.idle_cores = tuple(idle_cores)
        self.allot = Allotments()
        self.sessions: dict[tuple[str, str, str], Session] = {}  # (trajectory, kind, name)
        # One start per session: concurrent first uses would each start a shell, and
        # all but the last would run (and keep state) where no later action looks.
        self._starting: weakref.WeakValueDictionary[tuple[str, str, str], asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    async def session_for(
        self, key: tuple[str, str, str], reach: Reachable, env: Mapping[str, str]
    ) -> Session:
        """The live session ``key`` (trajectory, kind, name), started on first use."""
        lock = self._starting.setdefault(key, asyncio.Lock())
        async with lock:
            sess = self.sessions.get(key)
            if sess is None or not sess.alive:
                start = BashSession.start if key[1] == "bash" else PythonSession.start
                sess = await start(reach.socket, reach.workdir, env, server_pid=reach.pid)
                self.sessions[key] = sess
            return sess

    # Concurrent actions of one environment share its cgroup (see ``Allotments``).
    def enter(self, key: str, cores: Sequence[int]) -> tuple[list[int], float]:
        return self.allot.enter(key, cores, float(len(cores)))

    def leave(self, key: str, cores: Sequence[int]) -> tuple[list[int], float]:
        rest = self.allot.leave(key, cores, float(len(cores)))
        return rest or (list(self.idle_cores), IDLE_QUOTA_CORES)

    def _limit(self, env: Reachable, cores: Sequence[int], quota_cores: float) -> None:
        try:
            self.cgroups.limit(env.cgroup, cores, quota_cores)
        except CgroupError as e:
            # A group that went with its environment is the environment's end, reported
            # as such (``gone``); a live one the agent cannot write is the node's problem.
            raise ExecError(str(e), reason="CgroupsUnwritable" if env.alive() else "") from None

    def group_enter(self, env: Reachable, cores: Sequence[int]) -> None:
        try:
            self._limit(env, *self.enter(env.key, cores))
        except ExecError:  # not entered: its cores must not stay in the group's union
            self.allot.leave(env.key, cores, float(len(cores)))
            raise

    def group_leave(self, env: Reachable, cores: Sequence[int]) -> None:
        rest = self.leave(env.key, cores)
        try:
            self._limit(env, *rest)
        except ExecError:
            if env.alive():
                raise
            # Its group went with its environment (a removed container): nothing is left
            # to limit, and the command's own ending says why, the environment's end
            # looked for (this error, raised in exec's ``finally``, hid that).

    async def exec(self, env: Reachable, cmd: Command) -> ExecResult:
        t0 = time.perf_counter()
        env.check_alive()
        self.group_enter(env, cmd.cores)
        left = False

        async def idle() -> None:
            nonlocal left
            if not left:  # once, whichever way the action ends
                left = True
                self.group_leave(env, cmd.cores)

        io = cmd.io
        try:
            chan = await Channel.start(
                env.socket, cmd.argv, cwd=env.workdir, env=cmd.env, server_pid=env.pid,
                mode="pty" if io is not None and io.pty else "pipe",
                # A terminal's input stays open, as a terminal's does.
                stdin=io is not None and (io.stdin is not None or io.pty),
            )  # fmt: skip
            t1 = time.perf_counter()
            # A SIGKILL's cause, told below; read as the command starts, beside its run
            # rather than before it (an OOM kill in these microseconds goes untold).
            ooms = self.cgroups.oom_kills(env.cgroup)
            try:
                async with feeding(io, chan.write, chan.close_stdin, chan.kill):
                    output, timed_out = await supervise(
                        chan.collect(cmd.output_cap, io.output if io else None),
                        cmd.timeout_s,
                        chan.kill,
                        idle,
                    )
            except ExecError as e:
                e.ran_s = time.perf_counter() - t1
                raise
            finally:
                chan.close()
            t2 = time.perf_counter()
        finally:
            await idle()  # also when the server failed the command: no cores stay held
        t3 = time.perf_counter()
        if not timed_out and chan.exit_code is None:
            # The connection ended before the command's exit: its environment went (a
            # deleted pod, a killed container) or its handler did. No outcome to give: an
            # exit of None read as a command that ran to its end.
            # (A sandbox's PID 1 ends its handlers before it ends itself: looked at again.)
            alive = env.alive()
            if alive:
                await asyncio.sleep(ENDING_S)
                alive = env.alive()
            why = " (its handler ended first: a command that signals its parent, $PPID, ends"
            gone = f"{why} its own run)" if alive else "; the environment is gone"
            raise ExecError(
                f"the exec server's connection ended before the command's exit status{gone}",
                ended=True,
                ran_s=t2 - t1,
            )
        code = None if timed_out else chan.exit_code
        result = ExecResult.of(code, output, timed_out, cmd.cores, (t0, t1, t2, t3), path="fast")
        # The OOM killer's signal, to the command or to a process it waited for (a shell's
        # 137): an OOM kill in its sandbox meanwhile says which.
        if code in (-signal.SIGKILL, 128 + signal.SIGKILL) and self.oom_since(env, ooms):
            result = replace(result, oom_killed=True)
        return result

    def oom_since(self, env: Reachable, before: int | None) -> bool:
        """Whether the OOM killer killed in ``env``'s sandbox since its count was
        ``before`` (None: the count cannot be read here)."""
        after = self.cgroups.oom_kills(env.cgroup) if before is not None else None
        return after is not None and before is not None and after > before

    def end_sessions(self, trajectory: str) -> None:
        """The trajectory's environment is going: its sessions end with it."""
        for key in [k for k in self.sessions if k[0] == trajectory]:
            self.sessions.pop(key).alive = False


OOM_KILLED = "the kernel's out-of-memory killer killed in the sandbox meanwhile: its memory ran out"


ENDING_S = 0.2  # how long a PID 1 that ends its handlers may take to end itself


def _session_lost(kind: str) -> str:
    return (
        f"the {kind} session did not answer its interrupt within {INTERRUPT_GRACE_S:g} s "
        "and was killed: its state is lost, the next step starts a fresh session"
    )


class ExecServerRuntime:
    """``exec`` and ``session`` for the runtimes whose environments are reached through an
    exec server (Docker, pods): each says how to reach a trajectory's environment, or why
    it cannot, and how it runs a command."""

    fast: FastPath
    envs: Mapping[str, object]  # the open trajectories' environments

    def reachable(self, trajectory: str, need: str) -> Reachable:
        """The open trajectory's environment, reached through its exec server; or why
        not, for what ``need`` names (sessions, the files API)."""
        held = self.envs.get(trajectory)
        if held is None:
            raise ExecError(f"trajectory: {trajectory} is not open")
        return self._reached(held, need)

    def _reached(self, held: Any, need: str) -> Reachable:
        """How an open environment's exec server is reached, or why it is not."""
        raise NotImplementedError

    def files(self, trajectory: str) -> EnvFiles:
        """The environment's files, through its exec server (no core: nothing is run)."""
        reach = self.reachable(trajectory, "files")

        async def connect() -> Channel:
            reach.check_alive()
            return await Channel.connect(reach.socket, reach.pid)

        return EnvFiles(connect, reach.workdir)

    async def run(self, trajectory: str, cmd: Command, path: str) -> ExecResult:
        """Run a checked command in an open trajectory's environment by ``path``."""
        raise NotImplementedError

    async def exec(
        self,
        trajectory: str,
        argv: Sequence[str],
        cores: Sequence[int],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        output_cap: int = 1 << 20,
        path: str = "auto",
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the trajectory's environment on exactly ``cores``."""
        check_request(trajectory in self.envs, trajectory, argv, cores)
        full_env = {**(env or {}), "TANGRAM_DOP": str(len(cores))}
        cmd = Command(render(argv, len(cores)), cores, timeout_s, full_env, output_cap, io)
        return await self.run(trajectory, cmd, path)

    async def session(
        self,
        trajectory: str,
        kind: str,
        code: str,
        cores: Sequence[int],
        *,
        name: str = "main",
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        output_cap: int = 1 << 20,
    ) -> ExecResult:
        """Run ``code`` in the trajectory's persistent ``kind`` session (bash or python),
        started on first use, on exactly ``cores`` for the duration of the action."""
        check_request(trajectory in self.envs, trajectory, [code] if code else [], cores)
        reach = self._reached(self.envs[trajectory], "sessions")
        if kind not in ("bash", "python"):
            raise ExecError(f"kind: {kind!r} is not a session kind (bash, python)")
        reach.check_alive()
        fast = self.fast
        dop_env = {**(env or {}), "TANGRAM_DOP": str(len(cores))}
        t0 = time.perf_counter()
        fast.group_enter(reach, cores)
        try:
            sess = await fast.session_for((trajectory, kind, name), reach, dop_env)
            t1 = time.perf_counter()
            # {dop} is filled in bash commands, as in argv; Python reads TANGRAM_DOP.
            text = render([code], len(cores))[0] if kind == "bash" else code
            ooms = fast.cgroups.oom_kills(reach.cgroup)
            try:
                reply = await sess.run(
                    text, timeout_s=timeout_s, output_cap=output_cap, env=dop_env
                )
            except ExecError as e:  # (the session's own process ended: was it the OOM killer?)
                e.ran_s = time.perf_counter() - t1
                if not fast.oom_since(reach, ooms):
                    raise
                raise ExecError(
                    f"{e} ({OOM_KILLED})", retryable=e.retryable, ended=e.ended, ran_s=e.ran_s
                ) from None
            t2 = time.perf_counter()
        finally:
            fast.group_leave(reach, cores)
        t3 = time.perf_counter()
        output = Output(
            reply.stdout.encode(),
            reply.stdout_truncated,
            reply.stderr.encode(),
            reply.stderr_truncated,
        )
        result = ExecResult.of(
            reply.exit_code, output, reply.timed_out, cores, (t0, t1, t2, t3), path=kind
        )
        if reply.lost:  # (else its timeout reads as one the session lived through)
            result = replace(result, note=_session_lost(kind))
        return result
