"""Where environments live, behind one interface: the :class:`Runtime` protocol and the
name → factory registry the agent, ``tangram agent --runtime`` and ``tangram up --runtime``
read.

A new runtime is one module with its class plus one :func:`register` call below; nothing
else in the agent, the wire models or the command line names runtimes. The agent asks a
runtime only what this protocol says: it never branches on which one it holds.

Registered: ``docker`` (containers of a Docker Engine: embedded mode, hosts that have one),
``pod`` (sandboxes as pods on this Kubernetes node: the operator's choice), ``process``
(commands in a directory and a cgroup of the host: no isolation) and ``noop`` (runs
nothing, on virtual cores: benchmarks of the service). ``auto`` is not a runtime but a
name for docker: where no engine answers it fails, saying how to fix that. The process
runtime, which isolates nothing, runs only when asked for by name, and says so loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from tangram.api.wire import NO_SESSIONS_WHY, EnvSpec, Problem
from tangram.node_agent.env_files import EnvFiles, one_shot, one_shots_ended
from tangram.node_agent.exec_server import Built, build
from tangram.node_agent.execution import (
    SETUP_TIMEOUT_S,
    ExecError,
    ExecIO,
    ExecResult,
    Gone,
    check_setup,
)

log = logging.getLogger("tangram.agent")
# Threads for making sandboxes (opens, warm top-ups): each may hold one for minutes (a
# cold pod's start and setup), so they have threads of their own, and at most this many
# run at once; the rest wait for one there, not in the default pool.
MAKING_THREADS = 32
# How long a stopping agent waits for environments still being made (a warm one made after
# the warm pool was emptied would be left behind). Within the 30 s a pod is given to stop.
SHUTDOWN_MAKING_S = 10.0
REBUILD_AFTER_S = 30.0  # a failed build of the process runtime's files server, tried again


WarmFailed = Callable[[str, ExecError], None]


class Runtime(Protocol):
    """The environments of one agent."""

    kind: str  # its registered name, which the agent's hello reports
    fast_path: str  # why actions cannot take the fast path ('' when they can)
    no_io: str  # why commands cannot have input, a pty or streamed output ('' when they can)
    problem: Problem | None  # why this node cannot run actions at all (None: it can)
    # Told of each warm environment it could not make (the env's name, why); set by the
    # agent, which tells the scheduler: nothing else would until an open failed too.
    warm_failed: WarmFailed | None

    def adopt(self) -> list[str]:
        """Take back what a previous agent with the same state left; the trajectories."""
        ...

    def held(self) -> list[str]:
        """The trajectories whose environments it holds."""
        ...

    async def open(self, trajectory: str, spec: EnvSpec) -> tuple[float, bool]:
        """Make (or claim) the trajectory's environment: (seconds, whether warm)."""
        ...

    async def keep_warm(self, specs: Sequence[EnvSpec]) -> None:
        """Keep environments ready for exactly ``specs``: each topped up to its ``warm``,
        those of any other environment removed (nothing where none are kept)."""
        ...

    def close(self, trajectory: str) -> None: ...

    async def gone(self) -> list[Gone]:
        """The environments that ended by themselves since the last call (killed,
        evicted, deleted), no longer held, each with why."""
        ...

    async def exec(
        self,
        trajectory: str,
        argv: Sequence[str],
        cores: Sequence[int],
        *,
        timeout_s: float | None,
        env: Mapping[str, str],
        output_cap: int,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run ``argv`` in the environment on ``cores`` (allocate on execution); ``io``:
        its stdin, streamed output, signals and terminal, when it has any."""
        ...

    async def session(
        self,
        trajectory: str,
        kind: str,
        code: str,
        cores: Sequence[int],
        *,
        name: str,
        timeout_s: float | None,
        env: Mapping[str, str],
        output_cap: int,
    ) -> ExecResult:
        """Run ``code`` in the trajectory's persistent ``kind`` session."""
        ...

    def files(self, trajectory: str) -> EnvFiles:
        """The trajectory's files, through its environment's exec server."""
        ...

    async def shutdown(self) -> None:
        """The agent stops: release what is not a trajectory's (warm environments)."""
        ...


@dataclass(frozen=True, slots=True)
class Setting:
    """What a factory is given: the agent's state, its node and its idle cores."""

    state_dir: Path
    node: str
    idle: list[int]
    cache_dir: Path | None = None
    owner_id: str = ""  # names this agent's environments apart from other agents'
    options: Mapping[str, Any] = field(default_factory=dict)  # runtime-specific (pods=...)


@dataclass(frozen=True, slots=True)
class Registration:
    make: Callable[[Setting], Runtime]
    help: str
    virtual_cores: bool = False  # runs nothing: actions get virtual cores, not the host's


_REGISTRY: dict[str, Registration] = {}
# What ``auto`` means. Never the process runtime: a fallback to running commands on the
# host, unisolated, must not happen because a Docker Engine happened to be down.
AUTO = "docker"


def register(name: str, make: Callable[[Setting], Runtime], help: str, **kw: Any) -> None:
    _REGISTRY[name] = Registration(make, help, **kw)


def names() -> list[str]:
    return list(_REGISTRY)


def registration(name: str) -> Registration:
    found = _REGISTRY.get(name)
    if found is None:
        raise ExecError(f"runtime {name!r}: unknown (known: auto, {', '.join(_REGISTRY)})")
    return found


def create(name: str, setting: Setting) -> Runtime:
    """The runtime ``name`` (or ``auto``), ready for :meth:`Runtime.adopt`."""
    if name != "auto":
        return registration(name).make(setting)
    try:
        return registration(AUTO).make(setting)
    except ExecError as e:
        raise ExecError(
            f"runtime auto means {AUTO}, and {e}; start a Docker Engine (dockerd, or "
            "systemctl start docker), or name --runtime process to run commands on this "
            "host as this user, with no isolation"
        ) from None


def help_text(leave_out: Sequence[str] = ()) -> str:
    """The registered runtimes, each with what it is, but those in ``leave_out``."""
    return "; ".join(f"{n}: {r.help}" for n, r in _REGISTRY.items() if n not in leave_out)


# --- the adapters -----------------------------------------------------------------------


class Sandboxes:
    """A runtime whose environments run an exec server (Docker containers, pods): their
    calls block, so they go to a thread; a claimed warm environment is refilled off the
    request path."""

    def __init__(self, kind: str, inner: Any, fast_path: str = "") -> None:
        self.kind, self.inner, self.fast_path = kind, inner, fast_path
        self.no_io = fast_path  # (no fast path here: no exec server, which io needs)
        self.problem: Problem | None = getattr(inner, "problem", None)
        self.warm_failed: WarmFailed | None = None
        self._background: set[asyncio.Future[None]] = set()
        # One top-up at a time: concurrent ones (a refill after each of several opens)
        # would each see the pool short and together overfill it.
        self._warming = asyncio.Lock()
        # Closes, the gone watch and other short calls stay in the loop's default pool,
        # which a burst of cold opens would otherwise fill.
        self._making = ThreadPoolExecutor(MAKING_THREADS, thread_name_prefix="tangram-make")
        self._in_flight: set[Future[Any]] = set()  # makes running or queued in it

    def adopt(self) -> list[str]:
        adopted: list[str] = self.inner.adopt()
        return adopted

    def held(self) -> list[str]:
        return sorted(self.inner.envs)

    def _make(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        making = self._making.submit(fn, *args)
        self._in_flight.add(making)
        making.add_done_callback(self._in_flight.discard)
        return asyncio.wrap_future(making)

    async def open(self, trajectory: str, spec: EnvSpec) -> tuple[float, bool]:
        making = self._make(self.inner.open, trajectory, spec)
        try:
            opened = await asyncio.shield(making)
        except asyncio.CancelledError:
            # Its thread goes on; what it makes is nobody's (the scheduler forgets an open
            # cut off, and a hello sent meanwhile did not list it): closed once made.
            making.add_done_callback(partial(self._abandoned, trajectory))
            raise
        if spec.warm:
            refill = asyncio.ensure_future(self.warm(spec))
            self._background.add(refill)
            refill.add_done_callback(self._background.discard)
        return float(opened.seconds), bool(opened.warm)

    async def keep_warm(self, specs: Sequence[EnvSpec]) -> None:
        async with self._warming:
            with contextlib.suppress(ExecError):  # (a sandbox left is retired next time)
                await asyncio.to_thread(self.inner.retire_warm, {s.name for s in specs})
        for spec in specs:
            await self.warm(spec)

    async def warm(self, spec: EnvSpec) -> None:
        async with self._warming:
            try:
                await self._make(self.inner.warm, spec)
            except ExecError as e:  # the next open fails the same way: said now, not then
                log.warning("a warm sandbox of %s could not be made: %s", spec.name, e)
                if self.warm_failed is not None:
                    self.warm_failed(spec.name, e)

    def _abandoned(self, trajectory: str, making: asyncio.Future[Any]) -> None:
        if making.cancelled() or making.exception() is not None:
            return  # nothing was made (a failed open removes what it began)
        closing = asyncio.ensure_future(asyncio.to_thread(self.inner.close, trajectory))
        self._background.add(closing)
        closing.add_done_callback(self._background.discard)

    def close(self, trajectory: str) -> None:
        self.inner.close(trajectory)

    async def gone(self) -> list[Gone]:
        ended: list[Gone] = await asyncio.to_thread(self.inner.gone)
        return ended

    # Commands and sessions are the exec server's, through the inner runtime as they are.
    async def exec(
        self, trajectory: str, argv: Sequence[str], cores: Sequence[int], **kw: Any
    ) -> ExecResult:
        result: ExecResult = await self.inner.exec(trajectory, argv, cores, **kw)
        return result

    async def session(
        self, trajectory: str, kind: str, code: str, cores: Sequence[int], **kw: Any
    ) -> ExecResult:
        result: ExecResult = await self.inner.session(trajectory, kind, code, cores, **kw)
        return result

    def files(self, trajectory: str) -> EnvFiles:
        found: EnvFiles = self.inner.files(trajectory)
        return found

    async def shutdown(self) -> None:
        """Queued makes never start; those running finish (for ``SHUTDOWN_MAKING_S`` at
        most), so that a warm environment made meanwhile is released with the rest, not
        left (a node that leaves the pool gets no agent to take it back)."""
        self._making.shutdown(wait=False, cancel_futures=True)
        running = [f for f in list(self._in_flight) if not f.done()]  # (threads discard)
        if running:
            await asyncio.to_thread(wait_all, running, SHUTDOWN_MAKING_S)
        await asyncio.to_thread(self.inner.shutdown_warm)


class Processes:
    """The process runtime: a directory and a cgroup per trajectory, no isolation. The
    environment's variables and setup commands are applied here (there is no image)."""

    kind = "process"
    fast_path = "the process runtime"
    no_io = ""  # (input and streamed output; no pty, refused by its runtime's name)
    problem: Problem | None = None
    warm_failed: WarmFailed | None = None  # (a directory is never made warm)

    def __init__(self, inner: Any, idle: list[int], cache_dir: Path) -> None:
        """``cache_dir``: where the exec server its files API runs is built, on first use
        (one-shot, confined to a trajectory's directory)."""
        self.inner, self.idle = inner, idle
        self._env: dict[str, dict[str, str]] = {}
        self._cache_dir = cache_dir
        self._execd: Built | None = None
        self._failed_at = -math.inf  # when building it last failed (monotonic)
        self.setup_timeout_s = SETUP_TIMEOUT_S  # each setup command's

    def adopt(self) -> list[str]:
        adopted: list[str] = self.inner.adopt()
        return adopted

    def held(self) -> list[str]:
        held: list[str] = self.inner.held()
        return held

    async def open(self, trajectory: str, spec: EnvSpec) -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.inner.open(trajectory)
        self._env[trajectory] = dict(spec.env)
        try:
            for argv in spec.setup:
                timeout = self.setup_timeout_s
                res = await self.inner.exec(
                    trajectory, argv, self.idle, timeout_s=timeout, env=spec.env
                )
                check_setup(argv, res.exit_code, res.timed_out, timeout, res.stderr)
        except BaseException:  # failed, or cut off: the scheduler forgets an open cut off
            self.close(trajectory)
            raise
        return loop.time() - t0, False

    async def keep_warm(self, specs: Sequence[EnvSpec]) -> None:
        return None  # a directory needs no warming

    def close(self, trajectory: str) -> None:
        self._env.pop(trajectory, None)
        self.inner.close(trajectory)

    async def gone(self) -> list[Gone]:
        return []  # a directory does not end by itself

    async def exec(
        self,
        trajectory: str,
        argv: Sequence[str],
        cores: Sequence[int],
        *,
        env: Mapping[str, str],
        **kw: Any,
    ) -> ExecResult:
        base = self._env.get(trajectory, {})
        result: ExecResult = await self.inner.exec(
            trajectory, argv, cores, env={**base, **env}, **kw
        )
        return result

    async def session(self, trajectory: str, kind: str, code: str, cores: Sequence[int],
                      **kw: Any) -> ExecResult:  # fmt: skip
        raise ExecError(f"session: {NO_SESSIONS_WHY}")

    def files(self, trajectory: str) -> EnvFiles:
        if trajectory not in self.inner.held():
            raise ExecError(f"trajectory: {trajectory} is not open")
        # Built when the files API is first used; a failed build (a full disk, a compiler
        # missing) is tried again after a while, not given up on for the agent's life.
        retry = time.monotonic() - self._failed_at > REBUILD_AFTER_S
        if self._execd is None or (self._execd.path is None and retry):
            self._execd = build(self._cache_dir)
            if self._execd.path is None:
                self._failed_at = time.monotonic()
        if self._execd.path is None:
            raise ExecError(f"files: {self._execd.reason}")
        root, running = self.inner.workdir(trajectory), self.inner.files_servers
        return EnvFiles(
            one_shot(self._execd.path, root, running.setdefault(trajectory, set())), "/"
        )

    async def shutdown(self) -> None:
        await one_shots_ended()  # (their connections closed with the requests they served)
        self.inner.release()


# --- the factories (imports inside: choosing a runtime loads only that one) ----------------


def _docker(s: Setting) -> Runtime:
    from tangram.node_agent.docker_runtime import DockerRuntime

    built = build(s.cache_dir or s.state_dir / "cache")
    inner = DockerRuntime(s.idle, state_dir=s.state_dir / "docker", execd=built)
    return Sandboxes("docker", inner, built.reason)


def _pod(s: Setting) -> Runtime:
    from tangram.node_agent.kube_pods import kube_pod_api
    from tangram.node_agent.pod_runtime import PodRuntime

    pods = s.options.get("pods")
    if pods is None:
        raise ExecError("--runtime pod needs --namespace and --execd-image")
    inner = PodRuntime(
        s.idle,
        api=kube_pod_api(pods.namespace, pods.kubeconfig),
        node=s.node,
        namespace=pods.namespace,
        execd_image=pods.execd_image,
        execd_path=pods.execd_path,
        owner=pods.owner(),
        agent=s.owner_id,  # as Docker's: this agent's state directory
    )
    return Sandboxes("pod", inner, "")


def _process(s: Setting) -> Runtime:
    from tangram.node_agent.cgroups import CgroupError, detect
    from tangram.node_agent.process_runtime import ProcessRuntime

    cgroups = detect()
    prefix = f"tangram-{s.owner_id}"  # apart from other agents' groups
    try:  # fail at start, naming the cause, rather than at the first trajectory
        cgroups.create(prefix)
    except (OSError, CgroupError) as e:
        raise ExecError(
            f"the process runtime needs write access to the cgroup hierarchy "
            f"({cgroups.__class__.__name__} at /sys/fs/cgroup): {e}; run as root, or use "
            "--runtime docker"
        ) from None
    inner = ProcessRuntime(s.state_dir / "trajectories", cgroups, s.idle, group_prefix=prefix)
    log.warning(
        "runtime process: NO ISOLATION. Commands run directly on this host as uid %d, with "
        "its file system (this agent's state and token files included), network, users and "
        "processes; only their cores are limited. Use it for trusted commands only; "
        "--runtime docker (or pod) runs them in sandboxes",
        os.geteuid(),
    )
    return Processes(inner, s.idle, s.cache_dir or s.state_dir / "cache")


def _noop(s: Setting) -> Runtime:
    from tangram.node_agent.noop_runtime import NoopRuntime

    return NoopRuntime()


register("docker", _docker, "containers of a Docker Engine")
register("pod", _pod, "sandboxes as pods on this Kubernetes node (the operator's choice)")
register("process", _process, "commands in a directory and cgroup of the host: no isolation")
register("noop", _noop, "runs nothing (benchmarks of the service only)", virtual_cores=True)


__all__ = ["AUTO", "Processes", "Runtime", "Sandboxes", "Setting", "create", "names", "register"]
