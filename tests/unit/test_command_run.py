"""What every runtime shares about running a command: how its argv's ``{dop}`` is filled,
and how the wait for it ends (``execution.supervise``): its end, its deadline, a stop that
keeps its output (a cancel the scheduler wants the output of), a cancel."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tangram.node_agent import execution
from tangram.node_agent.execution import STOP, ExecError, Output, render, supervise


class Command:
    """A command that writes ``said`` and runs until it is killed or ``end`` is set."""

    def __init__(self, said: bytes = b"partial\n") -> None:
        self.said, self.end, self.kills = said, asyncio.Event(), 0

    async def collect(self) -> Output:
        await self.end.wait()
        return Output(self.said, False, b"", False)

    async def kill(self) -> None:
        self.kills += 1
        self.end.set()


async def _nothing() -> None:
    return None


def test_a_command_that_ends_is_not_killed() -> None:
    async def go() -> tuple[Output, bool, int]:
        cmd = Command()
        cmd.end.set()
        STOP.set(asyncio.Event())
        out, killed = await supervise(cmd.collect(), None, cmd.kill, _nothing)
        return out, killed, cmd.kills

    assert asyncio.run(go()) == (Output(b"partial\n", False, b"", False), False, 0)


@pytest.mark.parametrize("stop", [False, True])
def test_a_deadline_kills_and_keeps_the_output_with_or_without_a_stop(stop: bool) -> None:
    async def go() -> tuple[bytes, bool, int]:
        cmd = Command()
        if stop:
            STOP.set(asyncio.Event())  # never set
        out, killed = await supervise(cmd.collect(), 0.01, cmd.kill, _nothing)
        return out.stdout, killed, cmd.kills

    assert asyncio.run(go()) == (b"partial\n", True, 1)


def test_a_stop_kills_the_command_and_keeps_what_it_wrote() -> None:
    async def go() -> tuple[bytes, bool, int]:
        cmd, stop = Command(), asyncio.Event()
        STOP.set(stop)
        watching = asyncio.ensure_future(supervise(cmd.collect(), None, cmd.kill, _nothing))
        await asyncio.sleep(0)
        assert not watching.done()
        stop.set()
        out, killed = await watching
        return out.stdout, killed, cmd.kills

    assert asyncio.run(go()) == (b"partial\n", True, 1)


def test_a_cancel_kills_and_cancels_as_before() -> None:
    async def go() -> tuple[bool, int, int]:
        cmd, left = Command(), []

        async def on_cancel() -> None:
            left.append(1)

        STOP.set(asyncio.Event())
        watching = asyncio.ensure_future(supervise(cmd.collect(), None, cmd.kill, on_cancel))
        await asyncio.sleep(0)
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        return watching.cancelled(), cmd.kills, len(left)

    assert asyncio.run(go()) == (True, 1, 1)


class Unanswered(Command):
    """A command whose kill is never answered (its exec server's handler was stopped)."""

    async def kill(self) -> None:
        self.kills += 1


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
def test_a_kill_that_is_never_answered_is_given_up(
    ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait after a kill was unbounded: a command whose end never came held its
    action, and its cores, for good. It is given up after ``KILL_ANSWER_S``, saying so,
    and the command's wait is cancelled; a cancel still cancels."""
    monkeypatch.setattr(execution, "KILL_ANSWER_S", 0.05)

    async def go() -> str:
        cmd, left = Unanswered(), []

        async def on_cancel() -> None:
            left.append(1)

        collect = asyncio.ensure_future(cmd.collect())
        timeout = 0.01 if ending == "deadline" else None
        watching = asyncio.ensure_future(supervise(collect, timeout, cmd.kill, on_cancel))
        if ending == "cancel":
            await asyncio.sleep(0)
            watching.cancel()
            with pytest.raises(asyncio.CancelledError):
                await watching
            assert left == [1]
            return ""
        with pytest.raises(ExecError) as e:
            await watching
        await asyncio.sleep(0)
        assert collect.cancelled() and cmd.kills == 1
        return str(e.value)

    said = asyncio.run(asyncio.wait_for(go(), 30))  # (the wait it bounds was for ever)
    assert ending == "cancel" or "its end was not told within 0.05 s" in said


def test_dop_is_filled_and_a_doubled_one_is_left_literal() -> None:
    """``{{dop}}`` used to become ``{1}``: a Python f-string's ``{dop}`` in ``python3 -c``
    could not be written at all."""
    argv = ["echo", "{dop}", "{dop", "{{dop}}", "{DOP}", "x{dop}y", 'print(f"{{dop}}")']
    assert render(argv, 4) == ["echo", "4", "{dop", "{dop}", "{DOP}", "x4y", 'print(f"{dop}")']
    assert render(["{{{dop}}}"], 2) == ["{{dop}}"]  # (the doubled form is taken first)
