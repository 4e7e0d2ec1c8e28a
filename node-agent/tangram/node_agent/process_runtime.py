"""The process runtime: trajectories as directories and cgroups, for hosts without Docker.

Each trajectory gets a working directory and a cgroup. Between actions the cgroup is
pinned to the node's small shared idle core set with a minimal quota; for each action
the agent writes exactly the assigned cores and a matching quota (allocate-on-execution),
starts the command already inside the cgroup, and returns the cgroup to the idle set
when the command ends.

It does not isolate like a container: commands share the host's file system, network,
users and process table. Use it for trusted workloads, development and embedded mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tangram.api.wire import NO_TERMINALS_WHY
from tangram.node_agent.cgroups import Cgroups, join
from tangram.node_agent.execution import (
    IDLE_QUOTA_CORES,
    Allotments,
    ExecError,
    ExecIO,
    ExecResult,
    Output,
    cap,
    check_request,
    feeding,
    render,
    supervise,
)
from tangram.node_agent.fast_path import stat_fields

__all__ = ["ExecError", "ExecResult", "ProcessRuntime"]

log = logging.getLogger("tangram.agent")


@dataclass(slots=True)
class _Kept:
    """What a stream gave so far, kept where a cancelled read leaves it."""

    data: bytearray = field(default_factory=bytearray)
    cut: bool = False


async def _drain(
    stream: asyncio.StreamReader | None,
    limit: int,
    fd: int,
    on_output: Callable[[int, bytes], Awaitable[None]] | None,
    kept: _Kept,
) -> None:
    """Read a stream to its end into ``kept`` (its first ``limit`` bytes); ``on_output``
    gets each piece as it comes (streaming exec)."""
    if stream is not None:
        while chunk := await stream.read(65536):
            if on_output is not None:
                await on_output(fd, chunk)
            kept.cut |= cap(kept.data, chunk, limit)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


# After a kill beside other commands: how long its output may still come before the
# action ends without the rest (a leftover of it may hold its pipes open).
LEFTOVER_GRACE_S = 1.0
KILL_WAIT_S = 5.0  # how long a close waits for a killed files server to be gone
CLOSED_PREFIX = ".closed-"  # a closed trajectory's directory, renamed as its removal starts


async def _returncode(proc: asyncio.subprocess.Process) -> int:
    """The exit status of a process that has exited, as soon as asyncio's child watcher
    has reaped it, whatever holds its pipes."""
    await _exited(proc)
    while proc.returncode is None:
        await asyncio.sleep(0.005)
    return proc.returncode


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Until the process has exited. Not ``proc.wait()``: before Python 3.12 that also
    waits for its pipes to close, which a leftover holding them postpones."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return  # exited and reaped already
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:  # an exited process's pidfd stays readable
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


class ProcessRuntime:
    def __init__(
        self,
        base_dir: Path,
        cgroups: Cgroups,
        idle_cores: Sequence[int],
        *,
        group_prefix: str = "tangram",
    ) -> None:
        if not idle_cores:
            raise ExecError("idle_cores: at least one core must hold idle trajectories")
        self.base_dir = base_dir
        self.cgroups = cgroups
        self.idle_cores = tuple(idle_cores)
        self.prefix = group_prefix
        self._open: set[str] = set()
        # trajectory -> pids of its files servers (env_files.one_shot): not in its cgroup,
        # where the end of an action would kill them as its leftovers.
        self.files_servers: dict[str, set[int]] = {}
        self.allot = Allotments()
        self._running: dict[str, int] = {}  # commands running, by trajectory

    def _group(self, trajectory: str) -> str:
        return f"{self.prefix}/{trajectory}"

    def held(self) -> list[str]:
        """The trajectories open here."""
        return sorted(self._open)

    def workdir(self, trajectory: str) -> Path:
        return self.base_dir / trajectory

    def open(self, trajectory: str) -> Path:
        """Create the trajectory's working directory and idle cgroup."""
        if not trajectory or "/" in trajectory or trajectory.startswith("."):
            raise ExecError(f"trajectory: {trajectory!r} is not a valid name")
        if trajectory in self._open:
            raise ExecError(f"trajectory: {trajectory} is already open")
        work = self.workdir(trajectory)
        work.mkdir(parents=True, exist_ok=True)
        group = self._group(trajectory)
        self.cgroups.create(group)
        self.cgroups.limit(group, self.idle_cores, IDLE_QUOTA_CORES)
        self._open.add(trajectory)
        return work

    def close(self, trajectory: str) -> None:
        """Kill whatever still runs in the trajectory (its files servers too), remove its
        cgroup and directory."""
        group = self._group(trajectory)
        self._kill_group(group)
        _kill_all(self.files_servers.pop(trajectory, set()))  # (writing into its directory)
        with contextlib.suppress(FileNotFoundError):
            self.cgroups.remove(group)
        work = self.workdir(trajectory)
        # Out of the trajectories' names first, so that nothing left of it (a tree no
        # removal could finish) is ever taken back as an open trajectory by a restart.
        closed = self.base_dir / f"{CLOSED_PREFIX}{secrets.token_hex(8)}"
        try:
            work.rename(closed)
        except OSError:  # gone already, or a mount point itself (EBUSY)
            closed = work
        if not remove_tree(closed):
            log.warning("trajectory %s: its directory was not all removed: %s", trajectory, closed)
        self._open.discard(trajectory)

    def release(self) -> None:
        """At exit: remove this agent's cgroup when no trajectory is left in it (one that
        is stays, with its group, for the next agent to adopt)."""
        if not self._open:
            with contextlib.suppress(OSError):
                self.cgroups.remove(self.prefix)

    def adopt(self) -> list[str]:
        """Take back the trajectories a previous agent left (a restart): their directories
        and cgroups stay; whatever still ran in them is killed, since nobody waits for it."""
        if not self.base_dir.is_dir():
            return []
        for work in sorted(self.base_dir.iterdir()):
            name = work.name
            if name.startswith(CLOSED_PREFIX):  # closed, what was left of it: try again
                remove_tree(work)
                continue
            if not work.is_dir() or name in self._open or name.startswith("."):
                continue
            group = self._group(name)
            self._kill_group(group)
            self.cgroups.create(group)
            self.cgroups.limit(group, self.idle_cores, IDLE_QUOTA_CORES)
            self._open.add(name)
        return sorted(self._open)

    async def _when_done(
        self, trajectory: str, proc: asyncio.subprocess.Process
    ) -> set[int] | None:
        """Once the command has exited: if it was the trajectory's last one running, kill
        what is left in its cgroup (on the event loop, so that no command of the
        trajectory starts in between); the processes killed, None if it was not the last."""
        try:
            await _exited(proc)
        finally:  # also when the action is cancelled
            last = self._leave(trajectory)
        return self._kill_leftovers(self._group(trajectory)) if last else None

    def _leave(self, trajectory: str) -> bool:
        """One command of ``trajectory`` is done (or never started); whether it was the
        last one counted."""
        self._running[trajectory] -= 1
        if self._running[trajectory]:
            return False
        del self._running[trajectory]
        return True

    def _kill_leftovers(self, group: str) -> set[int]:
        """SIGKILL every process in the cgroup; the ones killed. It does not wait for them
        to leave the group: a killed process runs no more code, and one forked before its
        parent died is in the group too, so rounds go on until no new process is found."""
        killed: set[int] = set()
        for _ in range(1000):
            try:
                found = set(self.cgroups.pids(group)) - killed
            except FileNotFoundError:
                break
            if not found:
                break
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= found
        return killed

    def _await_exit(self, group: str, killed: set[int]) -> None:
        """Until the killed processes have left the group (they exit within moments)."""
        for _ in range(500):
            try:
                if not killed & set(self.cgroups.pids(group)):
                    return
            except FileNotFoundError:
                return
            time.sleep(0.002)

    def _kill_group(self, group: str) -> None:
        """SIGKILL every process in the cgroup, including ones that left the process group,
        and wait till they have left it."""
        self._await_exit(group, self._kill_leftovers(group))

    async def exec(
        self,
        trajectory: str,
        argv: Sequence[str],
        cores: Sequence[int],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        output_cap: int = 1 << 20,
        quota_cores: float | None = None,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run ``argv`` on exactly ``cores``; cancelling the awaiting task kills it. ``io``:
        its stdin, streamed output and signals (no terminal here)."""
        check_request(trajectory in self._open, trajectory, argv, cores)
        if io is not None and io.pty:
            raise ExecError(f"pty: {NO_TERMINALS_WHY}")
        group = self._group(trajectory)
        t0 = time.perf_counter()
        quota = float(quota_cores if quota_cores is not None else len(cores))
        self.cgroups.limit(group, *self.allot.enter(trajectory, cores, quota))
        t1 = time.perf_counter()
        full_env = {**os.environ, **(env or {}), "TANGRAM_DOP": str(len(cores))}

        def release() -> None:  # the others running here keep theirs (see Allotments)
            rest = self.allot.leave(trajectory, cores, quota)
            self.cgroups.limit(group, *(rest or (self.idle_cores, IDLE_QUOTA_CORES)))

        stdin = asyncio.subprocess.PIPE if io and io.stdin else asyncio.subprocess.DEVNULL
        # Counted before it starts: it is in the cgroup as soon as it is forked, and
        # another command ending meanwhile must not take it for a leftover (``_when_done``,
        # ``kill``) and kill it.
        self._running[trajectory] = self._running.get(trajectory, 0) + 1
        try:
            proc, cancelled = await _spawned(
                asyncio.create_subprocess_exec(
                    *render(argv, len(cores)),
                    cwd=self.workdir(trajectory),
                    env=full_env,
                    stdin=stdin,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,  # its own process group, killed as a whole
                    preexec_fn=partial(_enter, self.cgroups.join_files(group)),
                )
            )
        except (OSError, subprocess.SubprocessError) as e:
            # Not started (no such program, not executable, the cgroup not joined): its
            # cores go back, and it ends as the exec server reports such a command.
            self._not_started(trajectory, group)
            release()
            why = f"tangram: {argv[0]}: {e.strerror if isinstance(e, OSError) else e}\n"
            t2 = time.perf_counter()
            return ExecResult.of(
                127, Output(b"", False, why.encode(), False), False, cores, (t0, t1, t2, t2)
            )
        except BaseException:  # cancelled while it failed to start
            self._not_started(trajectory, group)
            release()
            raise

        # No process outlives its action: what the command leaves running (setsid,
        # double-forked) stays in the trajectory's cgroup, and is killed as soon as no
        # command of the trajectory runs any more (while one does, the leftovers cannot be
        # told from its processes). That also ends an action whose leftover holds its
        # output pipes open.
        watch = asyncio.ensure_future(self._when_done(trajectory, proc))

        # Stopped when the action is killed beside others of its trajectory: what it left
        # running may hold its pipes open till they end, so its output is not awaited.
        out, err = _Kept(), _Kept()
        reading = asyncio.gather(
            _drain(proc.stdout, output_cap, 1, io.output if io else None, out),
            _drain(proc.stderr, output_cap, 2, io.output if io else None, err),
        )
        # Retrieved whatever happens: an action cancelled before it collected its output
        # (the agent's stop) left the gather's CancelledError "never retrieved", a
        # traceback in the agent's log at every stop.
        reading.add_done_callback(_retrieved)
        abandoned = False

        async def collect() -> Output:
            nonlocal abandoned
            try:
                await asyncio.wait((reading, watch), return_when=asyncio.FIRST_COMPLETED)
                # Exited as the trajectory's last command, its cgroup emptied: what still
                # holds its pipes left the cgroup (root can), and would hold the action
                # for as long as it likes.
                if (
                    not reading.done()
                    and _emptied(watch)
                    and not (await asyncio.wait((reading,), timeout=LEFTOVER_GRACE_S))[0]
                ):
                    log.warning("trajectory %s: a process that left its cgroup holds the "
                                "output of %s; not waited for", trajectory, argv[0])  # fmt: skip
                    abandoned = True
                    reading.cancel()
                    # Our ends of its pipes, which nothing will close now (asyncio's
                    # Process has no public close; its transport's closes the pipes of
                    # an exited command).
                    proc._transport.close()  # type: ignore[attr-defined]
                await reading
            except asyncio.CancelledError:
                if not abandoned:  # (the action's own cancel)
                    reading.cancel()
                    raise
            return Output(bytes(out.data), out.cut, bytes(err.data), err.cut)

        async def ended() -> int:
            # (proc.wait() would also wait for pipes that a leftover of it still holds)
            return await _returncode(proc) if abandoned else await proc.wait()

        async def write(data: bytes) -> None:
            assert proc.stdin is not None
            with contextlib.suppress(ConnectionError):  # it stopped reading: it may end
                proc.stdin.write(data)
                await proc.stdin.drain()

        async def close_stdin() -> None:
            if proc.stdin is not None:
                proc.stdin.close()

        async def send_signal(sig: int) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        async def kill() -> None:
            # Its own process group; the trajectory's whole cgroup only when no other
            # command of the trajectory runs (else those would be killed too). Its own
            # command, if still running, is one of those counted.
            others = self._running.get(trajectory, 0) - (proc.returncode is None)
            await asyncio.to_thread(self._kill, proc, None if others > 0 else group)
            if others > 0:  # its leftovers end with the trajectory's last command
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_exited(proc), LEFTOVER_GRACE_S)
                nonlocal abandoned
                abandoned = True
                reading.cancel()

        async def idle() -> None:
            await ended()
            await watch
            release()

        async with feeding(io, write, close_stdin, send_signal):
            output, timed_out = await supervise(
                collect(), timeout_s, kill, idle, cancelled=cancelled
            )
        code = await ended()
        killed = await watch
        if killed:  # the result says the action ended: so have they (not on the loop)
            await asyncio.to_thread(self._await_exit, group, killed)
        t2 = time.perf_counter()
        release()
        t3 = time.perf_counter()
        return ExecResult.of(
            None if timed_out else code, output, timed_out, cores, (t0, t1, t2, t3)
        )

    def _not_started(self, trajectory: str, group: str) -> None:
        """Uncount a command that did not start; the last one counted, it ends what the
        others left (they ended while it started, and left that to it)."""
        if self._leave(trajectory):
            self._kill_group(group)

    def _kill(self, proc: asyncio.subprocess.Process, group: str | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if group is not None:
            self._kill_group(group)


def _emptied(watch: asyncio.Future[set[int] | None]) -> bool:
    """Whether the command's watch has ended its trajectory's cgroup (its last command)."""
    return (
        watch.done()
        and not watch.cancelled()
        and watch.exception() is None
        and (watch.result() is not None)
    )


def _kill_all(pids: set[int]) -> None:
    """SIGKILL ``pids`` and wait (bounded) till each is dead: a zombie, or reaped."""
    for pid in list(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(_alive(pid) for pid in list(pids)) and time.monotonic() < deadline:
        time.sleep(0.002)


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in "ZX"  # (its state: zombie, dead)


async def _spawned(
    spawn: Coroutine[Any, Any, asyncio.subprocess.Process],
) -> tuple[asyncio.subprocess.Process, bool]:
    """The started process, and whether the caller was cancelled while it started. The
    spawn itself is never cancelled: asyncio would then wait till the child's pipes close,
    which a process the child left running holds as long as that lives. The caller kills
    what started as it kills any cancelled action."""
    task = asyncio.ensure_future(spawn)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            cancelled = True
    if cancelled and task.exception() is not None:  # (raises if it was cancelled itself)
        raise asyncio.CancelledError
    return task.result(), cancelled


def _enter(files: Sequence[str]) -> None:
    """In the command's process before exec: join its group and start every signal at its
    default. Ignored signals survive exec, and an agent started in the background has
    SIGINT and SIGQUIT ignored: its commands could then not be interrupted."""
    join(files)
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):  # the C library's own
                signal.signal(sig, signal.SIG_DFL)
    # Nothing but its stdin, stdout and stderr crosses the exec. uvloop's spawn (the
    # embedded mode's loop) leaves the command copies of its own output sockets: a job it
    # put in the background with its output sent elsewhere then held the action open.
    for fd in _open_fds():
        if fd > 2:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def remove_tree(path: Path) -> bool:
    """Remove ``path`` and all it holds, however deep; whether it is gone. Before Python
    3.13 ``shutil.rmtree`` recurses once per level, so a tree deeper than the recursion
    limit (a command's ``mkdir -p`` makes one in a moment) is left, and its RecursionError
    escapes ``ignore_errors``: then coreutils' ``rm``, which walks any depth.

    A file system a command mounted in it (a root command may: nothing isolates it) is
    unmounted first, and if one cannot be, nothing is removed: ``rmtree`` and ``rm
    --one-file-system`` alike delete what a bind mount of the same file system shows."""
    for point in sorted(mounts_under(path), key=lambda p: -len(p.parts)):
        if _LIBC.umount2(os.fsencode(point), MNT_DETACH) != 0:
            log.warning("%s: not unmounted (%s)", point, os.strerror(ctypes.get_errno()))
    if mounts_under(path):
        return False
    with contextlib.suppress(RecursionError):
        shutil.rmtree(path, ignore_errors=True)
    if path.exists() or path.is_symlink():
        subprocess.run(["rm", "-rf", "--", str(path)], check=False, capture_output=True)
    return not (path.exists() or path.is_symlink())


def mounts_under(path: Path) -> list[Path]:
    """The mount points at or under ``path``, from this process's mount table."""
    try:
        table = Path("/proc/self/mountinfo").read_bytes()
    except OSError:
        return []
    inside = []
    for line in table.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:  # the fifth is the mount point, with \ooo escapes
            point = Path(os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8)]), fields[4])))
            if point == path or path in point.parents:
                inside.append(point)
    return inside


_OCTAL = re.compile(rb"\\([0-7]{3})")
_LIBC = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2  # umount2: detach now, free once nothing uses it
