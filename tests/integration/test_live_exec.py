"""Streaming exec end to end: output as it is produced, stdin given or kept open, signals
and a terminal, through the real client, the action stream, the service, a real agent and
the environment's exec server (Docker) or the process runtime."""

from __future__ import annotations

import asyncio
import hashlib
import os
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tangram.client import AsyncClient, AsyncTrajectory, LiveAction, TangramError
from tangram.node_agent import runtimes
from tangram.node_agent.exec_server import Built

from .service_harness import RUNTIMES, box_pool

CORES = sorted(os.sched_getaffinity(0))
HANG_GUARD_S = 120  # a scenario that has not ended by then hangs: a failure, not a wait
# More input than can ever wait for a running command that does not read: the service's
# 16 MiB, the link's window of chunks (8 MiB) and the exec server's 16 MiB (24 MiB could
# all be taken by the node when its pump kept up: no refusal, and the command slept on).
OVERFLOWING_INPUT = 64 << 20
Scenario = Callable[[AsyncTrajectory], Any]


def _run(request: pytest.FixtureRequest, kind: str, tmp: Path, scenario: Scenario,
         image: str | None = None, **config: Any) -> None:  # fmt: skip
    """``scenario`` on a trajectory of the ``box`` environment on ``kind``, with the async
    client on its action stream; ``config``: more PoolConfig fields."""
    with box_pool(request, kind, tmp, image=image, **config) as (running, token):

        async def go() -> None:
            async with AsyncClient(running.url, token) as c, c.trajectory("box") as t:
                await asyncio.wait_for(scenario(t), HANG_GUARD_S)

        asyncio.run(go())


@pytest.fixture(params=RUNTIMES)
def on(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Scenario], None]:
    return lambda scenario: _run(request, request.param, tmp_path, scenario)


async def _until(action: LiveAction, *texts: str) -> str:
    """Output until each of ``texts`` has appeared (the command still running)."""
    seen = ""
    async for _, piece in action.output():
        seen += piece
        if all(text in seen for text in texts):
            return seen
    raise AssertionError(f"the command ended without writing {texts!r}: {seen!r}")


def test_stdin_given_with_the_request(on: Callable[[Scenario], None]) -> None:
    """As text, or as bytes of UTF-8 (bytes failed deep in the JSON encoder); other bytes
    are refused naming ``stdin``, before anything is sent."""

    async def scenario(t: AsyncTrajectory) -> None:
        r = await t.exec(["sh", "-c", "tr a-z A-Z; echo done"], stdin="shout\n")
        assert (r.exit_code, r.stdout) == (0, "SHOUT\ndone\n")
        r = await t.exec(["cat"], stdin="grüß\n".encode())
        assert r.stdout == "grüß\n"
        with pytest.raises(ValueError, match=r"^stdin: bytes that are not UTF-8 \(at 1\)"):
            await t.exec(["cat"], stdin=b"a\xff")

    on(scenario)


@pytest.mark.parametrize("interactive", [False, True])
def test_a_streamed_command_cancelled_by_its_key_ends_with_its_run_time(
    on: Callable[[Scenario], None], interactive: bool
) -> None:
    """Its result said it ran for no time at all (exec_s 0): the run time went to
    overhead, as a plain exec's did before its cancel kept it. Its stdin open, the same."""

    async def scenario(t: AsyncTrajectory) -> None:
        argv = ["sh", "-c", "echo first; exec sleep 60"]
        action = await t.exec_live(argv, idempotency_key="live", interactive=interactive)
        await _until(action, "first")
        assert await t.client.cancel("key:live")
        result = await action.result()
        assert result.status.value == "cancelled" and result.error is None, result
        assert result.timings.exec_s > 0 and result.allocation.path is not None, result

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
        await action.write(b"tw\xc3")  # bytes of UTF-8 too, a character split in two
        await action.write(b"\xb6\n")
        await _until(action, "twö\n")
        await action.close_stdin()
        result = await action.result()
        assert (result.exit_code, result.stdout) == (0, "one\ntwö\n")

    on(scenario)


@pytest.mark.parametrize("limit", [None, 2048])
@pytest.mark.parametrize("kind", RUNTIMES)
def test_a_write_larger_than_a_frame_arrives_whole_and_the_stream_goes_on(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, limit: int | None
) -> None:
    """Over 3 MiB of input, as JSON over 6 MiB: characters beyond the BMP (12 bytes each,
    escaped), others escaped too. One message of it would end the stream (1009); it goes
    in several, in order. A pool's ``maxRequestBytes`` (2 KiB) bounds execs, not their
    input: its parts, each under a frame, all arrive."""
    text = "\U0001f600" * (1 << 18) + "line \u2713 \t\x01\n" * (1 << 18)
    config: dict[str, Any] = {} if limit is None else {"max_request_bytes": limit}

    async def scenario(t: AsyncTrajectory) -> None:
        action = await t.exec_live(["sha256sum"], interactive=True)
        await action.write(text)
        await action.close_stdin()
        result = await action.result()
        assert result.exit_code == 0, result
        assert result.stdout.split()[0] == hashlib.sha256(text.encode()).hexdigest()
        assert not action.refused and not action._stream.closed
        assert (await t.exec(["echo", "after"])).stdout == "after\n"

    _run(request, kind, tmp_path, scenario, **config)


def test_refused_input_is_kept_on_the_action_and_the_command_goes_on(
    on: Callable[[Scenario], None],
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        action = await t.exec_live(["sh", "-c", "echo up; sleep 60"])  # not interactive
        await _until(action, "up")
        await action.close_stdin()  # it has no stdin to close: the service refuses
        while not action.refused:
            await asyncio.sleep(0.05)
        (refusal,) = action.refused
        assert refusal.status == 400 and "not sent interactive" in str(refusal), refusal
        await action.signal("SIGINT")  # still running, still the action's
        assert (await action.result()).exit_code == 128 + 2

    on(scenario)


def test_a_signal_sent_while_it_queues_reaches_it_when_it_starts(
    on: Callable[[Scenario], None],
) -> None:
    async def scenario(t: AsyncTrajectory) -> None:
        hold = ["sh", "-c", "touch held; sleep 60"]
        holder = asyncio.ensure_future(t.exec(hold, cores=len(CORES), idempotency_key="hold"))
        while not await t.files.exists("held"):  # it holds every core from here on
            assert not holder.done(), holder.result()
            await asyncio.sleep(0.05)
        action = await t.exec_live(["sleep", "60"])  # so this one waits in the queue
        await action.signal("SIGTERM")
        await asyncio.sleep(0.5)
        # Still queued behind the holder: the signal waits with it, not lost, not early.
        assert not holder.done() and not action._answer.done()
        await t.client.cancel("key:hold")  # the cores free: it starts, and gets it
        result = await action.result()
        assert result.exit_code == 128 + 15, result
        await holder

    on(scenario)


def test_a_pty_is_a_terminal_or_refused_where_there_is_none(
    on: Callable[[Scenario], None], request: pytest.FixtureRequest
) -> None:
    has_terminals = request.node.callspec.params["on"] == "docker"

    async def scenario(t: AsyncTrajectory) -> None:
        argv = ["sh", "-c", "test -t 0 && test -t 1 && echo terminal"]
        if has_terminals:
            r = await t.exec(argv, pty=True)
            assert (r.exit_code, r.stdout) == (0, "terminal\n"), r
            return
        # The process runtime has none, and says so when asked, before it queues.
        with pytest.raises(TangramError, match="the process runtime has no terminals") as e:
            await t.exec(argv, pty=True)
        assert (e.value.status, e.value.field) == (400, "pty")
        live = await t.exec_live(argv, pty=True)  # the same, streamed
        with pytest.raises(TangramError, match="the process runtime has no terminals") as e:
            await live.result()
        assert (e.value.status, e.value.field) == (400, "pty")

    on(scenario)


@pytest.mark.docker
@pytest.mark.xdist_group("docker")
def test_without_the_exec_server_input_terminals_and_streams_are_refused_before_they_queue(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Docker agent without the exec server (no C compiler to build it) runs plain
    commands on the portable path; what needs the server is refused at once, naming the
    field and why, instead of queueing and failing once run."""
    monkeypatch.setattr(runtimes, "build", lambda cache_dir: Built(None, "no C compiler"))

    async def scenario(t: AsyncTrajectory) -> None:
        r = await t.exec(["echo", "plain"])
        assert (r.exit_code, r.stdout) == (0, "plain\n"), r
        assert (r.allocation.path, r.allocation.fallback) == ("portable", "no C compiler")
        asks: list[tuple[str, Callable[[], Any]]] = [
            ("session", lambda: t.bash("pwd")),
            ("pty", lambda: t.exec(["true"], pty=True)),
            ("stdin", lambda: t.exec(["cat"], stdin="x")),
            ("stream", lambda: _result_of(t.exec_live(["true"]))),
            ("interactive", lambda: _result_of(t.exec_live(["cat"], interactive=True))),
        ]
        for field, ask in asks:
            with pytest.raises(TangramError, match=r"exec server.*no C compiler") as e:
                await ask()
            assert (e.value.status, e.value.field) == (400, field)

    _run(request, "docker", tmp_path, scenario)


def test_a_session_on_the_process_runtime_is_refused_before_it_queues(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """It queued, took a core, and failed once run (``exec_failed``)."""

    async def scenario(t: AsyncTrajectory) -> None:
        for kind in ("bash", "python"):
            with pytest.raises(TangramError, match="sessions need the Docker or pod") as e:
                await t.client.exec(t.id, session={"kind": kind, "name": "main"}, code="1")
            assert (e.value.status, e.value.field) == (400, "session")

    _run(request, "process", tmp_path, scenario)


async def _result_of(started: Awaitable[LiveAction]) -> Any:
    return await (await started).result()


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

    _run(request, "docker", tmp_path, scenario, coding_image)


@pytest.mark.parametrize("queued", [False, True], ids=["running", "queued"])
def test_input_past_what_may_wait_for_the_command_kills_it_and_says_so(
    on: Callable[[Scenario], None], queued: bool
) -> None:
    """Over 16 MiB of input waiting for a command that does not read: the rest was
    refused, and the command ran on what had gone through and ended ``ok``. Queued when
    it overflowed, the kill must go ahead of the input, which the command never reads."""

    async def scenario(t: AsyncTrajectory) -> None:
        holder = None
        if queued:
            hold = ["sh", "-c", "touch held; sleep 60"]
            holder = asyncio.ensure_future(t.exec(hold, cores=len(CORES), idempotency_key="h"))
            while not await t.files.exists("held"):  # it holds every core from here on
                assert not holder.done(), holder.result()
                await asyncio.sleep(0.05)
        action = await t.exec_live(["sh", "-c", "sleep 600; wc -c"], interactive=True)
        await action.write("x" * OVERFLOWING_INPUT)
        if holder is not None:
            while not action.refused:  # (the refusal comes while it still queues)
                await asyncio.sleep(0.05)
            await t.client.cancel("key:h")
            await holder
        result = await action.result()
        assert result.status == "error" and result.error is not None, result
        assert result.error.code == "input_refused", result.error
        assert action.refused and action.refused[0].status == 413

    on(scenario)


def test_a_dropped_stream_ends_its_interactive_commands_input(
    on: Callable[[Scenario], None],
) -> None:
    """Nobody can end its stdin once the caller's stream is gone: it is ended for it, so
    the command finishes (and frees its cores); a retry under its key gets the result."""

    async def scenario(t: AsyncTrajectory) -> None:
        other = AsyncClient(t.client.url, t.client._headers["Authorization"][7:])
        async with other:
            action = await other.exec_live(t.id, ["cat"], interactive=True, idempotency_key="cat")
            await action.write("kept\n")
            await _until(action, "kept")
        # the stream dropped with the client: a retry under the key waits for the end
        again = await t.client.exec(t.id, ["cat"], idempotency_key="cat")
        assert (again.exit_code, again.stdout) == (0, "kept\n")

    on(scenario)


def test_a_dropped_stream_cancels_its_streamed_commands_sent_without_a_key(
    on: Callable[[Scenario], None],
) -> None:
    """Nobody can collect one (no key), read its output or end its input once its caller's
    stream is gone: it is cancelled, even running, so an endless one does not hold its
    cores (and its trajectory) for good."""

    async def scenario(t: AsyncTrajectory) -> None:
        other = AsyncClient(t.client.url, t.client._headers["Authorization"][7:])
        async with other:
            argv = ["sh", "-c", "while true; do echo spam; sleep 0.05; done"]
            action = await other.exec_live(t.id, argv, cores=len(CORES))
            await _until(action, "spam")
        # Every core was the endless command's: one that needs them all runs once it ends.
        after = await t.exec(["echo", "after"], cores=len(CORES), queue_timeout_s=60)
        assert after.stdout == "after\n", after

    on(scenario)


def test_input_for_an_exec_that_has_ended_is_refused_at_once(
    on: Callable[[Scenario], None],
) -> None:
    """It went out and was refused on the stream later, only logged: the caller's write
    looked taken."""

    async def scenario(t: AsyncTrajectory) -> None:
        action = await t.exec_live(["sh", "-c", "echo done"], interactive=True)
        assert (await action.result()).stdout == "done\n"
        for late in (action.write("late\n"), action.close_stdin()):
            with pytest.raises(TangramError) as e:
                await late
            assert e.value.code == "conflict" and "the exec has ended" in str(e.value)

    on(scenario)
