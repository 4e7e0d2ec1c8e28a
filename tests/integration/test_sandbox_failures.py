"""Sandbox failures through the service, on a real Docker Engine: an environment whose
image is not on the node is refused with 502 naming the cause; a sandbox killed behind
the agent's back loses its trajectory with the reason, unasked; a node whose agent says
it cannot run actions is refused; and each cause shows in the figures the operator turns
into the pool's SandboxesHealthy condition and Events."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import docker.errors
import httpx
import pytest
import websockets

from tangram.api.inventory import NodeInventory
from tangram.api.wire import AgentHello, EnvSpec, Problem, TrajectoryState
from tangram.client import Client, TangramError
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.env_template import TRAJECTORY_PREFIX
from tangram.node_agent.runtimes import Sandboxes
from tangram.service.auth import AGENT_TENANT, OPERATOR_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import service, until

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("docker")]
USER, OPERATOR, AGENT = "u" * 24, "o" * 24, "g" * 24


def _config(busybox: str) -> PoolConfig:
    def env(name: str, image: str) -> EnvConfig:
        return EnvConfig(spec=EnvSpec(name=name, image=image, memory_gb=0.1, workdir="/tmp"))

    return PoolConfig(
        envs={"box": env("box", busybox), "ghost": env("ghost", "tangram-test/not-here:1")}
    )


def _problems(url: str) -> dict[tuple[str, str], dict[str, Any]]:
    figures = httpx.get(f"{url}/v1/admin/status", headers={"Authorization": f"Bearer {OPERATOR}"})
    figures.raise_for_status()
    return {(p["reason"], p["subject"]): p for p in figures.json()["problems"]}


def test_failed_and_ended_sandboxes_are_answered_and_counted_by_cause(
    docker_client: Any, busybox: str, tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="docker", idle_cores=1)
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    with (
        service(_config(busybox), agent, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, USER) as client,
    ):
        assert _problems(running.url) == {}
        with pytest.raises(TangramError) as refused:
            client.open("ghost")
        assert refused.value.status == 502, refused.value  # not retried: it cannot succeed
        assert "(ImageUnavailable)" in str(refused.value)
        assert "tangram-test/not-here:1: not found on this node" in str(refused.value)

        opened = client.open("box")
        assert client.exec(opened.id, ["echo", "alive"]).stdout == "alive\n"
        docker_client.containers.get(TRAJECTORY_PREFIX + opened.id).kill()
        until(lambda: client.get(opened.id).state is TrajectoryState.LOST, "the loss reported")
        with pytest.raises(TangramError) as lost:
            client.exec(opened.id, ["true"])
        assert lost.value.status == 409
        assert "ended with exit code 137" in str(lost.value) and "(SandboxExited)" in str(
            lost.value
        )
        with pytest.raises(docker.errors.NotFound):  # removed by the agent
            docker_client.containers.get(TRAJECTORY_PREFIX + opened.id)

        problems = _problems(running.url)
        assert set(problems) == {
            ("ImageUnavailable", "TrajectoryEnv ghost"),
            ("SandboxExited", "TrajectoryEnv box"),
        }
        assert problems[("ImageUnavailable", "TrajectoryEnv ghost")]["count"] == 1
        client.close(opened.id)  # a lost trajectory still closes cleanly


def test_a_warm_sandbox_that_cannot_be_made_shows_before_any_open_fails(
    busybox: str, tmp_path: Path
) -> None:
    """Its top-up failed in silence (the env said SandboxesHealthy until a user's open
    failed): it counts now, as a failed open of the env does."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="docker", idle_cores=1)
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    spec = EnvSpec(name="ghost", image="tangram-test/not-here:1", memory_gb=0.1, warm=1)
    config = PoolConfig(envs={"ghost": EnvConfig(spec=spec)})
    with service(config, agent, tmp_path, tokens=tokens) as (running, _):
        until(lambda: ("ImageUnavailable", "TrajectoryEnv ghost") in _problems(running.url),
              "the warm sandbox's failure was not reported")  # fmt: skip
        problem = _problems(running.url)[("ImageUnavailable", "TrajectoryEnv ghost")]
        assert "tangram-test/not-here:1: not found on this node" in problem["message"]


def test_a_command_whose_sandbox_is_removed_under_it_says_why(
    docker_client: Any, busybox: str, tmp_path: Path
) -> None:
    """It said only that the exec server's connection ended; the cause (SandboxDeleted)
    came with the next watch, seconds later, to the commands after it."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="docker", idle_cores=1)
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    with (
        service(_config(busybox), agent, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, USER) as client,
    ):
        opened = client.open("box")
        started = "/tmp/started"
        got: list[Any] = []
        runner = threading.Thread(target=lambda: got.append(
            client.exec(opened.id, ["sh", "-c", f"touch {started}; exec sleep 60"])))  # fmt: skip
        runner.start()
        container = docker_client.containers.get(TRAJECTORY_PREFIX + opened.id)
        until(lambda: container.exec_run(["test", "-e", started]).exit_code == 0,
              "the command did not start")  # fmt: skip
        container.remove(force=True)
        runner.join(60)
        (result,) = got
        assert result.error is not None and result.error.code == "exec_failed", result
        assert "(SandboxDeleted: container " in result.error.message, result.error
        assert client.get(opened.id).state is TrajectoryState.LOST  # told before the answer


def test_a_trajectory_that_writes_past_its_disk_limit_is_lost_with_the_reason(
    docker_client: Any, busybox: str, tmp_path: Path
) -> None:
    """diskGiB through the service: the agent's watch finds the writable layer over the
    limit, ends the environment and says why, unasked; the cause is counted for the pool's
    SandboxesHealthy condition."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="docker", idle_cores=1)
    assert isinstance(agent.runtime, Sandboxes)
    agent.runtime.inner.disk_check_s = 0  # measure at every look (every 2 s), not every 10
    spec = EnvSpec(name="disk", image=busybox, memory_gb=0.1, disk_gb=0.02)  # 20 MiB
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    with (
        service(
            PoolConfig(envs={"disk": EnvConfig(spec=spec)}), agent, tmp_path, tokens=tokens
        ) as (running, _),  # fmt: skip
        Client(running.url, USER) as client,
    ):
        opened = client.open("disk")
        wrote = client.exec(opened.id, ["sh", "-c", "head -c 41943040 /dev/zero > big"])
        assert wrote.exit_code == 0
        until(lambda: client.get(opened.id).state is TrajectoryState.LOST, "the loss reported")
        with pytest.raises(TangramError) as lost:
            client.exec(opened.id, ["true"])
        assert lost.value.status == 409 and "(DiskLimitExceeded)" in str(lost.value)
        assert "over the TrajectoryEnv's diskGiB" in str(lost.value)
        problems = _problems(running.url)
        assert set(problems) == {("DiskLimitExceeded", "TrajectoryEnv disk")}
        client.close(opened.id)


def test_a_node_that_says_it_cannot_run_actions_is_refused_and_counted(
    tmp_path: Path,
) -> None:
    """The scheduler's side, with a hello as an agent on a static-CPU-manager node sends."""
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    inventory = NodeInventory(node_id="n9", hostname="n9", numa=[[0]], memory_gb=1.0,
                              cgroup_version=2)  # fmt: skip
    hello = AgentHello(
        node="n9", inventory=inventory, runtime="pod", action_cores=[0], idle_cores=[0],
        problem=Problem(reason="CPUManagerStatic", message="node n9: the CPU manager is static"),
    )  # fmt: skip

    async def join(url: str) -> int | None:
        ws_url = url.replace("http", "ws") + "/v1/agents"
        headers = {"Authorization": f"Bearer {AGENT}"}
        async with websockets.connect(ws_url, additional_headers=headers) as ws:
            await ws.send(hello.model_dump_json())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            return closed.value.rcvd.code if closed.value.rcvd else None

    with service(PoolConfig(), None, tmp_path, tokens=tokens) as (running, _):
        assert asyncio.run(join(running.url)) == 1008
        assert "n9" not in running.engine.hub.links
        problems = _problems(running.url)
        assert problems[("CPUManagerStatic", "node n9")]["message"].endswith("is static")
