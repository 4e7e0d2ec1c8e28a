"""Trajectory environments as Docker containers (the only module that imports ``docker``).

A trajectory's container lives as long as the trajectory: its memory is reserved and
limited for that whole life; between actions its cpuset is the node's small idle core
set with a minimal quota. Before each command the container's cgroup gets exactly the
assigned cores and a matching quota (allocate-on-execution, seed 000 §5.2), and after it
the idle set again. Two paths:

- **fast**: the agent writes the container's cgroup files itself and asks the exec
  server, the container's PID 1, to start the command over a Unix socket;
- **portable**: Docker's update and exec APIs, as the paper does. Used when the fast
  path is not possible (no exec server binary, a container created without it, no
  access to the container's cgroup), and the result says why.

Opening takes a ready container from the template's warm pool when there is one (a
rename), else creates one. Docker labels are immutable, so a container's trajectory is
its name (``tangram-t-<trajectory>``); labels name the pool, the environment and the
template version. The name is also the ready marker: a container is made under
``tangram-m-<random>`` and renamed only once its setup ran, so ``adopt`` discards what an
agent killed meanwhile half built.

The exec server's socket is in a tiny tmpfs of the container's own
(``env_template.run_tmpfs``), reached through its PID 1's root as the pod runtime does:
no host directory is shared with the container, so nothing it writes lands in the
agent's state uncounted by its disk limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from tangram.api.wire import EnvSpec
from tangram.node_agent.cgroups import PERIOD_US, format_cpulist
from tangram.node_agent.env_template import (
    LABEL,
    MAKING_PREFIX,
    TRAJECTORY_PREFIX,
    WARM_PREFIX,
    User,
    Workdir,
    digest,
    pick_user,
    spec,
)
from tangram.node_agent.exec_server import IN_CONTAINER_BIN, SOCKET_NAME, Built, socket_in
from tangram.node_agent.execution import (
    IDLE_QUOTA_CORES,
    ExecError,
    ExecResult,
    Opened,
    Output,
    cap,
    check_setup,
    owner_id,
    supervise,
)
from tangram.node_agent.fast_path import (
    Command,
    Reachable,
    cgroup_of,
    start_time,
    stat_fields,
)
from tangram.node_agent.warm_pool import SandboxRuntime

__all__ = ["DockerRuntime", "Opened", "import_busybox"]

log = logging.getLogger("tangram.agent")
DISK = f"{LABEL}/disk"  # bytes of writable layer, on containers whose limit the agent keeps
_ENDED = ("exited", "dead", "gone")  # container states of an ended sandbox ("gone": removed)


@dataclass(slots=True)
class Env:
    """A container the agent holds: an open trajectory's or a warm one."""

    container: Any
    template: str  # digest() of the EnvSpec it was built from
    workdir: str
    execd: bool  # its PID 1 is the exec server
    # A container of an older agent: its socket directory, a host directory it can write
    # (``{state}/run/<token>``, label ``run``). None: the socket is in its own tmpfs.
    run_dir: Path | None = None
    reach: Reachable | None = None  # its exec server and cgroup, resolved on first use


KILL_START_S = 5.0  # how long a kill waits for an exec being started to have a pid


async def _nothing() -> None:
    return None


class DockerRuntime(SandboxRuntime[Env]):
    def __init__(
        self,
        idle_cores: Sequence[int],
        *,
        client: Any = None,
        state_dir: Path = Path("/var/lib/tangram/agent"),
        execd: Built | None = None,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        proc_root: Path = Path("/proc"),
    ) -> None:
        super().__init__(idle_cores, cgroup_root, proc_root)
        try:
            # One connection per thread that may call the engine at once (asyncio's
            # default executor has at most 32): the SDK's 10 made a burst of opens log
            # "Connection pool is full" and reconnect.
            self.client = client or docker.from_env(max_pool_size=32)
            self.client.ping()
        except DockerException as e:
            raise ExecError(f"docker: the engine is not reachable: {e}") from None
        self.state_dir = state_dir
        # Several agents may share a Docker Engine (pools, tests): each adopts only its own.
        self.owner = owner_id(state_dir)
        self.execd = execd.path if execd else None
        self.no_fast = execd.reason if execd else "no exec server was configured"
        self.storage_opt = True  # until the engine says its storage driver has none
        self.disk_check_s = 10.0  # how often the agent measures limited writable layers
        self._disk_checked = float("-inf")

    # ---- lifecycle: the warm pool's hooks (warm_pool.SandboxRuntime) --------------
    def _make(self, template: EnvSpec, trajectory: str | None) -> Env:
        name = TRAJECTORY_PREFIX + trajectory if trajectory else WARM_PREFIX + secrets.token_hex(6)
        return self._create(template, name, trajectory)

    def _claim(self, env: Env, trajectory: str) -> bool:
        # Docker cannot relabel a container: the name is the ownership record.
        try:
            _rename(env.container, TRAJECTORY_PREFIX + trajectory)
        except (APIError, NotFound):
            return False
        return True

    def _key(self, env: Env) -> str:
        return str(env.container.id)

    def adopt(self) -> list[str]:
        """Find the containers this agent owns (after a restart) and take them back.

        Running ones are taken as they are, stopped ones restarted (their files survive);
        ones Docker will not start (being removed, dead) are left out and reported lost
        by the caller, which sees them missing from the returned trajectories.
        """
        found = self.client.containers.list(
            all=True,
            filters={"label": f"{LABEL}/owner={self.owner}"},
            ignore_removed=True,  # one removed between listing and inspecting is no error
        )
        for c in found:
            if c.status in ("removing", "dead"):
                continue
            run = c.labels.get(f"{LABEL}/run")
            run_dir = self.state_dir / "run" / run if run else None
            # Its agent ended before its setup did; or it is a warm one of an older agent,
            # whose socket directory is a host directory its commands could fill: the
            # pool makes a new one (a trajectory's is kept, with its files).
            if c.name.startswith(MAKING_PREFIX) or (run_dir and c.name.startswith(WARM_PREFIX)):
                self._discard(Env(c, "", "/", False, run_dir))
                continue
            started = c.status not in ("running", "paused")
            try:
                if c.status == "paused":
                    c.unpause()
                elif started:
                    if run_dir is not None:  # its last socket would pass for the new one's
                        (run_dir / SOCKET_NAME).unlink(missing_ok=True)
                    c.start()
            except (APIError, NotFound):
                continue
            entry = (c.attrs.get("Config", {}).get("Entrypoint") or [""])[0]
            execd = entry == IN_CONTAINER_BIN
            env = Env(
                c,
                c.labels[f"{LABEL}/template"],
                c.attrs.get("Config", {}).get("WorkingDir") or "/",
                execd,
                run_dir if execd else None,
            )
            if started:  # its exec server starts again with it: taken back once it listens
                try:
                    self._await_exec_server(env)
                except (ExecError, DockerException) as e:  # its commands will say so too
                    log.warning("container %s restarted, but %s", c.name, e)
            if c.name.startswith(TRAJECTORY_PREFIX):
                self.envs[c.name.removeprefix(TRAJECTORY_PREFIX)] = env
            elif c.name.startswith(WARM_PREFIX):
                self.warm_pool.setdefault(env.template, []).append(env)
        return sorted(self.envs)

    def _create(self, template: EnvSpec, ready_name: str, trajectory: str | None) -> Env:
        """Create, start and set up a container, under a name that ``adopt`` discards
        until the end, when it is renamed ``ready_name``: an agent killed meanwhile leaves
        nothing a successor would take for ready."""
        user, workdir = self._image_facts(template)
        name = MAKING_PREFIX + secrets.token_hex(6)
        labels: dict[str, str] = {f"{LABEL}/owner": self.owner}
        if trajectory:
            labels[f"{LABEL}/trajectory"] = trajectory
        kwargs = spec(
            template,
            name=name,
            labels=labels,
            idle_cores=self.idle_cores,
            user=user,
            execd=str(self.execd) if self.execd else None,
        )
        try:
            container = self._create_sized(template, kwargs)
        except BaseException as e:
            if not isinstance(e, DockerException):  # no answer (a timeout): it may exist
                self._remove_named(name)
                raise
            raise ExecError(
                f"image {template.image}: cannot create the environment: {e}",
                reason="SandboxStartFailed",
            ) from None
        env = Env(container, digest(template), template.workdir, self.execd is not None)
        try:
            if user and not template.read_only_root and not (workdir and workdir.writable_by(user)):
                self._own_workdir(container, template.workdir, user, workdir)
            container.start()
            self._await_exec_server(env)
            self._setup(env, template)
            _rename(container, ready_name)  # the ready marker: adopt takes it from now on
        except BaseException as e:
            # Any failure (a requests timeout, a cancel too): a container left behind
            # would keep its resources, and a trajectory's name, taken.
            self._discard(env)
            if not isinstance(e, DockerException):  # (APIError is one)
                raise
            raise ExecError(
                f"image {template.image}: cannot start the environment: {e}",
                reason="SandboxStartFailed",
            ) from None
        return env

    def _remove_named(self, name: str) -> None:
        """Remove this agent's container ``name`` if the engine made it after all."""
        with contextlib.suppress(Exception):  # best effort: adopt discards it otherwise
            container = self.client.containers.get(name)
            if container.labels.get(f"{LABEL}/owner") == self.owner:
                container.remove(force=True, v=True)

    def _create_sized(self, template: EnvSpec, kwargs: dict[str, Any]) -> Any:
        """Create the container; with a disk limit, the engine's own (``storage_opt``)
        where its storage driver has one (overlay2 needs xfs with pquota), else the
        agent's: the container is labelled, and ``gone`` measures its writable layer."""
        if template.disk_gb is None:
            return self.client.containers.create(template.image, **kwargs)
        limit = str(int(template.disk_gb * 1024**3))
        if self.storage_opt:
            try:
                return self.client.containers.create(
                    template.image, **kwargs, storage_opt={"size": limit}
                )
            except APIError as e:
                try:  # the same without the option: then the option was what failed
                    container = self.client.containers.create(template.image, **kwargs)
                except APIError:
                    raise e from None
                container.remove(force=True)
                self.storage_opt = False
                log.warning(
                    "docker: the storage driver cannot limit a container's disk (%s); the "
                    "agent measures each limited container's writable layer instead",
                    e.explanation or e,
                )
        kwargs["labels"] = {**kwargs["labels"], DISK: limit}
        return self.client.containers.create(template.image, **kwargs)

    def _survey(self) -> Callable[[Env], str | None] | None:
        """One listing of this agent's containers (no inspection unless one ended), and
        every ``disk_check_s`` the writable layers of those the agent limits. What it saw
        of an ended one: its state (exited, dead, gone), or why it is over its limit."""
        try:
            listed = self.client.containers.list(
                all=True, sparse=True, filters={"label": f"{LABEL}/owner={self.owner}"}
            )
            over = self._over_disk()
        except DockerException:
            return None  # the engine is unreachable: nothing can be told about any of them
        states = {c.id: c.attrs.get("State") for c in listed}

        def seen(env: Env) -> str | None:
            state = states.get(env.container.id, "gone")
            return over.get(env.container.id) or (state if state in _ENDED else None)

        return seen

    def _over_disk(self) -> dict[str, str]:
        """The containers whose writable layer holds more than their limit, each with
        what it holds (Docker's SizeRw); empty until ``disk_check_s`` has passed."""
        now = time.monotonic()
        if now - self._disk_checked < self.disk_check_s:
            return {}
        self._disk_checked = now
        sized = self.client.api.containers(
            all=True, size=True, filters={"label": [f"{LABEL}/owner={self.owner}", DISK]}
        )
        over: dict[str, str] = {}
        for c in sized:
            used, limit = int(c.get("SizeRw") or 0), int(c["Labels"][DISK])
            if used > limit:
                over[c["Id"]] = (
                    f"its writable layer holds {used / 2**20:.0f} MiB, over the TrajectoryEnv's "
                    f"diskGiB ({limit / 2**30:g} GiB)"
                )
        return over

    def _ending(self, env: Env, seen: str) -> tuple[str, str]:
        name = env.container.name
        if seen == "gone":
            return "SandboxDeleted", f"container {name} was removed"
        if seen not in _ENDED:  # over its disk limit: what it holds
            return "DiskLimitExceeded", f"container {name}: {seen}"
        try:
            env.container.reload()
            info = env.container.attrs.get("State") or {}
        except (APIError, NotFound):
            return "SandboxDeleted", f"container {name} was removed"
        if info.get("OOMKilled"):
            return "SandboxOOMKilled", (
                f"container {name}: the sandbox ran out of memory (OOMKilled): raise the "
                "TrajectoryEnv's memoryGB"
            )
        said = f" ({info['Error']})" if info.get("Error") else ""
        return "SandboxExited", (
            f"container {name}: the sandbox ended with exit code {info.get('ExitCode')}{said}"
        )

    def _setup(self, env: Env, template: EnvSpec) -> None:
        """Setup is bounded work at open time: the idle cores without the idle quota. Through
        the exec server where it can, as every action and as pods: what a setup command
        leaves running is killed at its end (through the engine's exec it lived on, on the
        idle cores and in every later action's)."""
        if not template.setup:
            return
        timeout = self.setup_timeout_s
        fast = not self._fast_unavailable(env)
        if not fast:
            env.container.update(cpu_quota=-1)
        for argv in template.setup:
            cmd = Command(list(argv), self.idle_cores, timeout, {}, 1 << 16)
            if fast:
                assert env.reach is not None  # (resolved by _fast_unavailable)
                res = asyncio.run(self.fast.exec(env.reach, cmd))  # (back to idle limits)
                code, timed_out, said = res.exit_code, res.timed_out, res.stderr or res.stdout
            else:
                ran = self._engine_exec(env.container, cmd, env.workdir)
                output, timed_out, code = asyncio.run(ran)
                said = (output.stderr or output.stdout).decode(errors="replace")
            check_setup(argv, code, timed_out, timeout, said)
        if not fast:
            idle = int(IDLE_QUOTA_CORES * PERIOD_US)
            env.container.update(cpu_period=PERIOD_US, cpu_quota=idle)

    def _await_exec_server(self, env: Env) -> None:
        """Until the container's exec server listens; then its reach is resolved, so that
        its first action asks the engine nothing more."""
        if not env.execd:
            return
        env.container.reload()
        pid = int(env.container.attrs["State"].get("Pid") or 0)  # (0: it has ended already)
        sock = self._socket(env, pid)
        now = time.monotonic()
        deadline, look = now + 10, now + 0.25
        while pid:
            try:
                os.stat(sock)
            except PermissionError:
                return  # out of this agent's reach: the portable path serves it (below)
            except OSError:
                pass  # not there yet
            else:
                self._resolve(env, pid)  # (a reason it cannot be: its first action says)
                return
            now = time.monotonic()
            if now > look:  # one that exited would otherwise hold us till the deadline
                env.container.reload()
                look = now + 0.25
            if now > deadline or env.container.status != "running":
                break
            time.sleep(0.002)
        env.container.reload()
        logs = env.container.logs(tail=5).decode(errors="replace").strip()
        raise ExecError(f"the exec server did not start (container {env.container.status}): {logs}")

    def _socket(self, env: Env, pid: int) -> Path:
        """Where this agent reaches the exec server's socket: in the container's own
        tmpfs, through its PID 1's root (``pid``, as this agent's /proc sees it); in the
        host socket directory of a container of an older agent."""
        if env.run_dir is not None:
            return env.run_dir / SOCKET_NAME
        return socket_in(self.proc_root, pid)

    @staticmethod
    def _own_workdir(container: Any, path: str, user: User, workdir: Workdir | None) -> None:
        """Make the workdir the environment user's: Docker would make a missing one root's,
        and the image's own may be another user's; a container without capabilities cannot
        chown it. Only the directory itself: what the image put in it stays as it is. Its
        permission bits are kept."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(path.strip("/"))  # missing parents are made root's
            info.type, info.uid, info.gid = tarfile.DIRTYPE, user.uid, user.gid
            info.mode = workdir.mode if workdir else 0o755
            tar.addfile(info)
        container.put_archive("/", buf.getvalue())

    def _image_facts(self, template: EnvSpec) -> tuple[User | None, Workdir | None]:
        """The user commands run as, and the image's own workdir (None: it has none)."""
        try:
            image = self.client.images.get(template.image)
        except ImageNotFound:
            raise ExecError(
                f"image {template.image}: not found on this node", reason="ImageUnavailable"
            ) from None
        key = f"{image.id}|{template.user}|{template.workdir}"
        if key not in self._facts:
            passwd, workdir = self._probe(image.id, template.workdir)
            configured = image.attrs.get("Config", {}).get("User") or None
            self._facts[key] = (pick_user(passwd, template.user, configured), workdir)
        return self._facts[key]

    def _probe(self, image_id: str, workdir: str) -> tuple[str, Workdir | None]:
        """Read the image's /etc/passwd and its workdir's owner (never started)."""
        probe = self.client.containers.create(image_id, entrypoint=["/"], network_mode="none")
        try:
            try:
                stream, _ = probe.get_archive(workdir)
                found = _first_member(stream)  # the directory itself: no more is read
                owned = None
                if found is not None and found.isdir():  # a link: replaced by a directory
                    owned = Workdir(found.uid, found.gid, found.mode & 0o7777)
            except NotFound:
                owned = None
            try:
                stream, _ = probe.get_archive("/etc/passwd")
            except NotFound:
                return "", owned
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.extractfile("passwd")
                return (member.read().decode(errors="replace") if member else ""), owned
        finally:
            probe.remove(force=True)

    def _env_name(self, env: Env) -> str:
        return str(env.container.labels.get(f"{LABEL}/env", ""))

    def _discard(self, env: Env) -> None:
        with contextlib.suppress(NotFound, APIError):
            env.container.remove(force=True, v=True)
        if env.run_dir is not None:
            shutil.rmtree(env.run_dir, ignore_errors=True)

    # ---- execution ---------------------------------------------------------------
    async def run(self, trajectory: str, cmd: Command, path: str) -> ExecResult:
        """``path``: ``auto`` (fast when possible), ``fast`` (fail if impossible) or
        ``portable`` (Docker's update and exec APIs)."""
        held = self.envs.get(trajectory)
        assert held is not None  # checked by exec
        why = "" if path == "portable" else self._fast_unavailable(held)
        if path == "fast" and why:
            raise ExecError(f"path: the fast path is not possible here: {why}")
        if cmd.io is not None and (why or path == "portable"):
            raise ExecError(
                "stdin, pty and streamed output need the exec server: "
                f"{why or 'the portable path was asked for'}"
            )
        if path != "portable" and not why:
            assert held.reach is not None  # resolved by _fast_unavailable
            return await self.fast.exec(held.reach, cmd)
        res = await self._exec_portable(held, cmd)
        return replace(res, fallback=why)

    def _reached(self, held: Env, need: str) -> Reachable:
        why = self._fast_unavailable(held)
        if why:
            raise ExecError(f"{need} need the exec server: {why}")
        assert held.reach is not None
        return held.reach

    def _fast_unavailable(self, env: Env) -> str:
        """Why the fast path cannot serve this container ('' when it can)."""
        if not env.execd:
            return self.no_fast if self.execd is None else "created without the exec server"
        if env.reach is None:
            env.container.reload()
            return self._resolve(env, int(env.container.attrs["State"]["Pid"]))
        return ""

    def _resolve(self, env: Env, pid: int) -> str:
        """Resolve ``env.reach`` for its PID 1 ``pid``; why it cannot be ('' when it is)."""
        try:
            group = cgroup_of(pid, self.cgroups, self.proc_root)
        except ExecError as e:
            return str(e)
        socket = self._socket(env, pid)
        try:
            os.stat(socket.parent)
        except PermissionError as e:  # (a missing socket is no reason: exec says so)
            return (
                f"the exec server's socket is reached through /proc/<pid>/root, which "
                f"this agent may not enter ({e.strerror}): that takes root"
            )
        except OSError:
            pass
        env.reach = Reachable(
            str(env.container.id), socket, pid, group, env.workdir,
            start_time(pid, self.proc_root), self.proc_root,
        )  # fmt: skip
        return ""

    async def _exec_portable(self, held: Env, cmd: Command) -> ExecResult:
        container = held.container
        t0 = time.perf_counter()
        key = str(container.id)
        entered = self.fast.enter(key, cmd.cores)
        left = False

        async def idle() -> None:
            nonlocal left
            if not left:  # once, whichever way the action ends (as FastPath.exec)
                left = True
                await asyncio.to_thread(self._update, container, *self.fast.leave(key, cmd.cores))

        try:
            # Shielded: on a cancel the leave's update must not race this one's thread.
            entering = asyncio.ensure_future(asyncio.to_thread(self._update, container, *entered))
            try:
                await asyncio.shield(entering)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await entering
                raise
            t1 = time.perf_counter()
            output, timed_out, code = await self._engine_exec(container, cmd, held.workdir, idle)
            t2 = time.perf_counter()
        finally:
            # Also when the exec could not be created (a restarting container) or the
            # action was cancelled before it ran: its cores must not stay in the cgroup.
            await idle()
        t3 = time.perf_counter()
        stamps = (t0, t1, t2, t3)
        return ExecResult.of(code, output, timed_out, cmd.cores, stamps, path="portable")

    async def _engine_exec(
        self,
        container: Any,
        cmd: Command,
        workdir: str,
        on_cancel: Callable[[], Awaitable[None]] = _nothing,
    ) -> tuple[Output, bool, int | None]:
        """``cmd`` through the engine's exec API (its cores are the caller's to set), its
        process tree killed at its timeout: its output, whether the deadline passed and its
        exit code (None: killed)."""
        api = self.client.api
        created = await asyncio.to_thread(
            api.exec_create, container.id, cmd.argv, environment=cmd.env, workdir=workdir
        )
        exec_id = created["Id"]

        async def kill() -> None:
            await asyncio.to_thread(self._kill_exec, api, exec_id)

        collect = asyncio.to_thread(self._collect, api, exec_id, cmd.output_cap)
        output, timed_out = await supervise(collect, cmd.timeout_s, kill, on_cancel)
        if timed_out:
            return output, True, None
        return output, False, (await asyncio.to_thread(api.exec_inspect, exec_id))["ExitCode"]

    @staticmethod
    def _update(container: Any, cores: Sequence[int], quota_cores: float) -> None:
        container.update(
            cpuset_cpus=format_cpulist(cores),
            cpu_period=PERIOD_US,
            cpu_quota=max(1000, int(quota_cores * PERIOD_US)),
        )

    @staticmethod
    def _collect(api: Any, exec_id: str, limit: int) -> Output:
        out, err = bytearray(), bytearray()
        out_cut = err_cut = False
        for chunk_out, chunk_err in api.exec_start(exec_id, stream=True, demux=True):
            if chunk_out:
                out_cut |= cap(out, chunk_out, limit)
            if chunk_err:
                err_cut |= cap(err, chunk_err, limit)
        return Output(bytes(out), out_cut, bytes(err), err_cut)

    def _kill_exec(self, api: Any, exec_id: str) -> None:
        """SIGKILL the exec's process, its process group and all its descendants. One not
        started yet (a cancel that came as it was being started: no pid) is waited for,
        for ``KILL_START_S`` at most, and killed once it runs."""
        deadline = time.monotonic() + KILL_START_S
        while (pid := int((seen := api.exec_inspect(exec_id)).get("Pid") or 0)) <= 0:
            if seen.get("ExitCode") is not None or time.monotonic() > deadline:
                return  # (ended already)
            time.sleep(0.01)
        for victim in tree(self.proc_root, pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)


def _rename(container: Any, name: str) -> None:
    container.rename(name)
    container.attrs["Name"] = "/" + name  # what ``container.name`` says, without a reload


class _Chunks(io.RawIOBase):
    """A file over an iterator of byte chunks (Docker's archive stream), read lazily."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._left = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._left:
            self._left = next(self._chunks, b"")
            if not self._left:
                return 0
        n = min(len(buf), len(self._left))
        buf[:n], self._left = self._left[:n], self._left[n:]
        return n


def _first_member(chunks: Iterator[bytes]) -> tarfile.TarInfo | None:
    """The first entry of a tar stream, reading no further (a workdir may be large)."""
    with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks)), mode="r|") as tar:
        return tar.next()


def tree(proc_root: Path, root: int) -> list[int]:
    """``root``, every descendant, and (when ``root`` leads one) its process group."""
    parent: dict[int, int] = {}
    group: dict[int, int] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name), proc_root)
        if fields is None:
            continue
        parent[int(entry.name)], group[int(entry.name)] = int(fields[1]), int(fields[2])
    out = {root}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in out and pid not in out:
                out.add(pid)
                grew = True
    if group.get(root) == root:
        out |= {pid for pid, g in group.items() if g == root}
    return sorted(out)


def local_busybox(tag: str) -> str | None:
    """``import_busybox`` into this host's Docker Engine (for the benchmarks: only this
    module imports the docker SDK, tests/unit/test_layering.py)."""
    return import_busybox(docker.from_env(), tag)


def import_busybox(client: Any, tag: str, busybox: Path = Path("/bin/busybox")) -> str | None:
    """A minimal image (busybox-static and its applet links), imported once under ``tag``.

    Nothing can be pulled on an air-gapped node; this makes an image for the exec
    benchmark and quick tests out of Debian's busybox-static. None when it is missing.
    """
    try:
        client.images.get(tag)
        return tag
    except ImageNotFound:
        pass
    if not busybox.exists() or not _looks_static(busybox):
        return None
    applets = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "work", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for name in applets:
            if name == "busybox":
                continue
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    repository, version = tag.rsplit(":", 1)
    client.api.import_image_from_data(buf.getvalue(), repository=repository, tag=version)
    return tag


def _looks_static(path: Path) -> bool:
    """No ELF interpreter segment (PT_INTERP) means a static binary."""
    data = path.read_bytes()[:4096]
    return b"/lib64/ld-linux" not in data and b"/lib/ld-linux" not in data
