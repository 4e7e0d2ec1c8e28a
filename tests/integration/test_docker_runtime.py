"""The Docker runtime against a real Docker Engine: cpusets, limits, hardening, re-adoption."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tangram.node_agent.docker_runtime import DockerRuntime, EnvTemplate
from tangram.node_agent.inventory import parse_cpulist
from tangram.node_agent.process_runtime import ExecError

# One worker runs every Docker test, so only one of them may start (and stop) dockerd.
pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture
def runtime(docker_client: Any, busybox: str) -> Iterator[DockerRuntime]:
    rt = DockerRuntime(CORES[:1], client=docker_client)
    yield rt
    for t in list(rt.containers):
        rt.close(t)


def template(busybox: str, **kw: Any) -> EnvTemplate:
    return EnvTemplate(name="test-env", image=busybox, memory_gb=0.25, **kw)


def tid() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def test_the_command_sees_exactly_its_cores_then_the_idle_set(
    runtime: DockerRuntime, busybox: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = asyncio.run(
        runtime.exec(t, ["grep", "Cpus_allowed_list", "/proc/self/status"], CORES[-1:])
    )
    assert res.exit_code == 0
    assert parse_cpulist(res.stdout.split(":")[1]) == CORES[-1:]
    runtime.containers[t].reload()
    host = runtime.containers[t].attrs["HostConfig"]
    assert parse_cpulist(host["CpusetCpus"]) == CORES[:1]
    assert host["CpuQuota"] == 10_000  # the idle quota, 0.1 core


def test_dop_and_the_memory_limit_reach_the_container(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = asyncio.run(runtime.exec(t, ["sh", "-c", "echo {dop} $TANGRAM_DOP"], CORES))
    assert res.stdout.split() == [str(len(CORES))] * 2
    limit = asyncio.run(
        runtime.exec(
            t,
            [
                "sh",
                "-c",
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes "
                "2>/dev/null || cat /sys/fs/cgroup/memory.max",
            ],
            CORES[:1],
        )
    )
    assert int(limit.stdout) == int(0.25 * 1024**3)


def test_hardening_is_in_effect(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    status = asyncio.run(runtime.exec(t, ["cat", "/proc/self/status"], CORES[:1])).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"
    nets = asyncio.run(runtime.exec(t, ["ls", "/sys/class/net"], CORES[:1])).stdout.split()
    assert nets == ["lo"]


def test_a_runaway_command_is_killed_at_its_timeout(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = asyncio.run(
        runtime.exec(t, ["sh", "-c", "setsid sleep 600 & sleep 600"], CORES[:1], timeout_s=1.0)
    )
    assert res.timed_out and res.exit_code is None
    processes = runtime.containers[t].top()["Processes"]
    assert len(processes) == 1  # only the environment's PID 1 is left


def test_cancellation_stops_the_command(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))

    async def scenario() -> None:
        task = asyncio.create_task(runtime.exec(t, ["sleep", "600"], CORES[:1]))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert len(runtime.containers[t].top()["Processes"]) == 1


def test_output_is_capped_and_flagged(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = asyncio.run(
        runtime.exec(
            t,
            ["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo err >&2"],
            CORES[:1],
            output_cap=1000,
        )
    )
    assert len(res.stdout) == 1000 and res.stdout_truncated
    assert res.stderr == "err\n"


def test_a_restarted_agent_readopts_its_containers_with_their_files(
    runtime: DockerRuntime, docker_client: Any, busybox: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox, setup=[["sh", "-c", "echo ready > setup.txt"]]))
    asyncio.run(runtime.exec(t, ["sh", "-c", "echo progress > notes.txt"], CORES[:1]))
    restarted = DockerRuntime(CORES[:1], client=docker_client)
    assert t in restarted.adopt()
    res = asyncio.run(restarted.exec(t, ["cat", "setup.txt", "notes.txt"], CORES[:1]))
    assert res.stdout == "ready\nprogress\n"


def test_read_only_root_with_a_writable_workdir(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox, read_only_root=True))
    ok = asyncio.run(runtime.exec(t, ["touch", "/work/x"], CORES[:1]))
    denied = asyncio.run(runtime.exec(t, ["touch", "/bin/x"], CORES[:1]))
    assert ok.exit_code == 0 and denied.exit_code != 0


def test_failing_setup_and_bad_requests_are_refused(runtime: DockerRuntime, busybox: str) -> None:
    with pytest.raises(ExecError, match="setup"):
        runtime.open(tid(), template(busybox, setup=[["false"]]))
    assert runtime.containers == {}
    with pytest.raises(ExecError, match="not open"):
        asyncio.run(runtime.exec("nope", ["true"], CORES[:1]))
    with pytest.raises(ExecError, match="cannot start"):
        runtime.open(tid(), template("tangram-test/missing:0"))
