"""Streaming exec end to end: output as it is produced, stdin given or kept open, signals
and a terminal, through the real client, the action stream, the service, a real agent and
the environment's exec server (Docker) or the process runtime."""

from __future__ import annotations

import asyncio
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tangram.api.wire import EnvSpec
from tangram.client import AsyncClient, AsyncTrajectory, LiveAction
from tangram.node_agent.agent import NodeAgent
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import service

CORES = sorted(os.sched_getaffinity(0))
_DOCKER = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("docker")]
RUNTIMES = [
    pytest.param("process", marks=pytest.mark.xdist_group("service")),
    pytest.param("docker", marks=_DOCKER),
]
Scenario = Callable[[AsyncTrajectory], Any]


def _run(request: pytest.FixtureRequest, tmp_path: Path, image: str, scenario: Scenario) -> None:
    """``scenario`` on a trajectory of an environment of ``image`` (the runtime of the
    parameter), with the async client on its action stream."""
    kind: str = request.param if hasattr(request, "param") else "docker"
    if os.geteuid() != 0:
        pytest.skip("the agents write cgroups: needs root")
    spec = EnvSpec(name="box", image=image, memory_gb=0.3, workdir="/work")
    agent = NodeAgent.create(
        tmp_path / "agent", runtime=kind, idle_cores=1, cores_for_actions=len(CORES)
    )
    with service(PoolConfig(envs={"box": EnvConfig(spec=spec)}), agent, tmp_path) as (r, token):

        async def go() -> None:
            async with AsyncClient(r.url, token) as client, client.trajectory("box") as t:
                await scenario(t)

        asyncio.run(go())


@pytest.fixture(params=RUNTIMES)
def on(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Scenario], None]:
    image = "unused-by-the-process-runtime"
    if request.param == "docker":
        request.getfixturevalue("docker_client")
        image = request.getfixturevalue("busybox")
    return lambda scenario: _run(request, tmp_path, image, scenario)


async def _until(action: LiveAction, *texts: str) -> str:
    """Output until each of ``texts`` has appeared (the command still running)."""
    seen = ""
    async for _, piece in action.output():
        seen += piece
        if all(text in seen for text in texts):
            return seen
    raise AssertionError(f"the command ended without writing {texts!r}: {seen!r}")


def test_stdin_given_with_the_request(on: Callable[[Scenario], None]) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        r = await t.exec(["sh", "-c", "tr a-z A-Z; echo done"], stdin="shout\n")
        assert (r.exit_code, r.stdout) == (0, "SHOUT\ndone\n")

    on(scenario)


def test_output_streams_before_the_end_and_sigint_stops_it_and_frees_its_cores(
    on: Callable[[Scenario], None],
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        argv = ["sh", "-c", "echo first; echo to-err >&2; sleep 60; echo never"]
        action = await t.exec_live(argv, cores=len(CORES))
        seen = await _until(action, "first", "to-err")  # (both written: no race with the signal)
        assert "never" not in seen  # shown while the command still runs
        await action.signal("SIGINT")
        result = await action.result()
        assert result.status.value == "ok" and result.exit_code == 128 + 2, result
        assert result.stdout == "first\n" and result.stderr == "to-err\n"
        # Every core was the stopped command's; an action that needs them all now runs.
        after = await t.exec(["echo", "after"], cores=len(CORES))
        assert after.stdout == "after\n"

    on(scenario)


def test_interactive_stdin_is_answered_as_it_goes(on: Callable[[Scenario], None]) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        action = await t.exec_live(["cat"], interactive=True)
        await action.write("one\n")
        assert await _until(action, "one\n") == "one\n"  # answered before stdin ends
        await action.write("two\n")
        await _until(action, "two\n")
        await action.close_stdin()
        result = await action.result()
        assert (result.exit_code, result.stdout) == (0, "one\ntwo\n")

    on(scenario)


def test_a_signal_sent_while_it_queues_reaches_it_when_it_starts(
    on: Callable[[Scenario], None],
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        hold = ["sh", "-c", "touch held; sleep 2"]
        holder = asyncio.ensure_future(t.exec(hold, cores=len(CORES)))
        while not await t.files.exists("held"):  # it holds every core from here on
            await asyncio.sleep(0.05)
        action = await t.exec_live(["sleep", "60"])  # so this one waits in the queue
        await action.signal("SIGTERM")
        result = await action.result()
        assert result.exit_code == 128 + 15, result
        await holder

    on(scenario)


def test_a_pty_is_a_terminal_or_refused_where_there_is_none(
    on: Callable[[Scenario], None],
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        argv = ["sh", "-c", "test -t 0 && test -t 1 && echo terminal"]
        r = await t.exec(argv, pty=True)
        if r.status.value == "error":  # the process runtime has none, and says so
            assert r.error is not None and "pty" in r.error.message, r
            return
        assert (r.exit_code, r.stdout) == (0, "terminal\n")

    on(scenario)


PYTEST_SUITE = textwrap.dedent(
    """
    import time

    def test_quick():
        pass

    def test_slow():
        time.sleep(60)
    """
)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.xdist_group("docker")
def test_pytest_v_shows_its_first_result_before_it_ends_and_sigint_stops_it(
    docker_client: Any, coding_image: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        await t.files.write("test_live.py", PYTEST_SUITE)
        # Under a terminal, as a person would run it: Python writes a line at a time.
        argv = ["python3", "-m", "pytest", "-v", "--color=no", "-p", "no:cacheprovider"]
        action = await t.exec_live(argv, pty=True)
        seen = await _until(action, "test_quick PASSED")
        assert " passed" not in seen  # the run is not over: no summary yet
        await action.signal("SIGINT")
        result = await action.result()
        assert result.exit_code == 2, result  # pytest: interrupted
        assert "KeyboardInterrupt" in result.stdout

    _run(request, tmp_path, coding_image, scenario)
