"""Trajectory environments as Docker containers (the only module that imports ``docker``).

A trajectory's container lives as long as the trajectory: its memory is reserved and
limited for that whole life; between actions its cpuset is the node's small idle core
set with a minimal quota. This is the *portable* allocate-on-execution path of seed 000
§5.2: before each command, Docker's update API sets the container's cpuset and quota to
exactly the assigned cores; the command runs through Docker's exec API; then the
container returns to the idle set.

Hardened by default: no network, every capability dropped, no-new-privileges, a pids
limit, optionally a read-only root file system with a writable working directory.
Commands are argv lists; nothing is passed through a shell unless the argv says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

from tangram.node_agent.cgroups import PERIOD_US, format_cpulist
from tangram.node_agent.execution import (
    IDLE_QUOTA_CORES,
    ExecError,
    ExecResult,
    Output,
    cap,
    check_request,
    render,
    supervise,
)

LABEL = "dev.tangram"  # label prefix that marks and identifies our containers


@dataclass(frozen=True, slots=True)
class EnvTemplate:
    """How to build a trajectory's environment (the TrajectoryEnv custom resource's core)."""

    name: str
    image: str
    memory_gb: float = 1.0
    workdir: str = "/work"
    env: Mapping[str, str] = field(default_factory=dict)
    setup: Sequence[Sequence[str]] = ()  # argv lists run once when the environment opens
    network: str = "none"
    read_only_root: bool = False
    user: str | None = None
    pids_limit: int = 512
    pool: str = "default"


class DockerRuntime:
    def __init__(
        self,
        idle_cores: Sequence[int],
        *,
        client: Any = None,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
    ) -> None:
        if not idle_cores:
            raise ExecError("idle_cores: at least one core must hold idle trajectories")
        try:
            self.client = client or docker.from_env()
            self.client.ping()
        except DockerException as e:
            raise ExecError(f"docker: the engine is not reachable: {e}") from None
        self.idle_cores = tuple(idle_cores)
        self.cgroup_root = cgroup_root
        self.containers: dict[str, Any] = {}

    # ---- lifecycle ---------------------------------------------------------------
    def open(self, trajectory: str, template: EnvTemplate) -> str:
        """Create and start the trajectory's container; returns its id."""
        if trajectory in self.containers:
            raise ExecError(f"trajectory: {trajectory} is already open")
        mem = int(template.memory_gb * 1024**3)
        kwargs: dict[str, Any] = {
            "command": ["sleep", "2147483647"],  # PID 1 only keeps the environment alive
            "detach": True,
            "name": f"tangram-{trajectory}",
            "labels": {
                f"{LABEL}/trajectory": trajectory,
                f"{LABEL}/env": template.name,
                f"{LABEL}/pool": template.pool,
            },
            "network_mode": template.network,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "pids_limit": template.pids_limit,
            "mem_limit": mem,
            "memswap_limit": mem,  # no swap: the limit is the trajectory's memory
            "cpuset_cpus": format_cpulist(self.idle_cores),
            "cpu_period": PERIOD_US,
            "cpu_quota": int(IDLE_QUOTA_CORES * PERIOD_US),
            "working_dir": template.workdir,
            "environment": dict(template.env),
            "read_only": template.read_only_root,
        }
        if template.read_only_root:
            kwargs["tmpfs"] = {template.workdir: "rw,exec", "/tmp": "rw"}
        if template.user:
            kwargs["user"] = template.user
        try:
            container = self.client.containers.run(template.image, **kwargs)
        except (APIError, DockerException) as e:
            raise ExecError(f"image {template.image}: cannot start the environment: {e}") from None
        self.containers[trajectory] = container
        try:
            container.exec_run(["mkdir", "-p", template.workdir])
            for argv in template.setup:
                code, out = container.exec_run(list(argv), workdir=template.workdir)
                if code != 0:
                    raise ExecError(
                        f"setup {list(argv)} failed with exit code {code}: "
                        f"{out.decode(errors='replace')[-500:]}"
                    )
        except ExecError:
            self.close(trajectory)
            raise
        return str(container.id)

    def close(self, trajectory: str) -> None:
        """Remove the container and everything it wrote."""
        container = self.containers.pop(trajectory, None)
        if container is None:
            return
        with contextlib.suppress(NotFound):
            container.remove(force=True, v=True)

    def adopt(self) -> list[str]:
        """Find the containers this agent owns (after a restart) and take them back.

        Running ones are taken as they are, stopped ones restarted (their files survive);
        ones Docker will not start (being removed, dead) are left out and reported lost
        by the caller, which sees them missing from the returned trajectories.
        """
        found = self.client.containers.list(all=True, filters={"label": f"{LABEL}/trajectory"})
        for c in found:
            if c.status in ("removing", "dead"):
                continue
            try:
                if c.status == "paused":
                    c.unpause()
                elif c.status != "running":
                    c.start()
            except (APIError, NotFound):
                continue
            self.containers[c.labels[f"{LABEL}/trajectory"]] = c
        return sorted(self.containers)

    # ---- execution ---------------------------------------------------------------
    async def exec(
        self,
        trajectory: str,
        argv: Sequence[str],
        cores: Sequence[int],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        output_cap: int = 1 << 20,
    ) -> ExecResult:
        """Run ``argv`` in the trajectory's container on exactly ``cores`` (portable path)."""
        container = self.containers.get(trajectory)
        check_request(container is not None, trajectory, argv, cores)
        assert container is not None  # for the type checker: check_request raised otherwise
        t0 = time.perf_counter()
        await asyncio.to_thread(self._limit, container, cores, float(len(cores)))
        t1 = time.perf_counter()
        api = self.client.api
        full_env = {**(env or {}), "TANGRAM_DOP": str(len(cores))}
        exec_id = await asyncio.to_thread(
            api.exec_create, container.id, render(argv, len(cores)), environment=full_env
        )

        async def kill() -> None:
            await asyncio.to_thread(self._kill_execs, container)

        async def idle() -> None:
            await asyncio.to_thread(self._limit, container, self.idle_cores, IDLE_QUOTA_CORES)

        collect = asyncio.to_thread(self._collect, api, exec_id["Id"], output_cap)
        output, timed_out = await supervise(collect, timeout_s, kill, idle)
        t2 = time.perf_counter()
        code = None
        if not timed_out:
            code = (await asyncio.to_thread(api.exec_inspect, exec_id["Id"]))["ExitCode"]
        await idle()
        t3 = time.perf_counter()
        return ExecResult.of(code, output, timed_out, cores, (t0, t1, t2, t3))

    def _limit(self, container: Any, cores: Sequence[int], quota_cores: float) -> None:
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

    def _kill_execs(self, container: Any) -> None:
        """SIGKILL every process in the container but its PID 1, through its cgroup.

        The cgroup also holds children that left the exec's process group (setsid).
        """
        container.reload()
        init = int(container.attrs["State"]["Pid"])
        procs = self._cgroup_procs(container.id)
        for pid in procs:
            if pid != init:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _cgroup_procs(self, container_id: str) -> list[int]:
        for path in (
            self.cgroup_root / "cpuset" / "docker" / container_id / "cgroup.procs",  # v1
            self.cgroup_root / "system.slice" / f"docker-{container_id}.scope" / "cgroup.procs",
            self.cgroup_root / "docker" / container_id / "cgroup.procs",  # v2, cgroupfs driver
        ):
            if path.exists():
                return [int(p) for p in path.read_text(encoding="ascii").split()]
        raise ExecError(f"container {container_id[:12]}: its cgroup was not found")
