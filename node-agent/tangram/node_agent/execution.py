"""What every runtime shares: the result of an action, and how a running one is supervised."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import contextvars
import hashlib
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

IDLE_QUOTA_CORES = 0.1  # what a trajectory may use between actions (shells, stray jobs)
SETUP_TIMEOUT_S = 600.0  # each setup command of an environment, in every runtime


class ExecError(RuntimeError):
    """A runtime request that cannot be carried out; the message says why.

    A sandbox that cannot start or run also says ``reason``, its cause in one CamelCase
    word (one of ``tangram.api.reasons.SANDBOX_FAILURES``: the pool's status and Events
    show it), and whether the same request may succeed if tried again (``retryable``: a
    timeout, an eviction; not a missing image).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        retryable: bool = False,
        errno: int | None = None,
        ended: bool = False,
        ran_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable
        self.errno = errno  # a file operation the environment refused: its error number
        # The environment may have ended under the request (its exec server went): the
        # agent looks at once, to say why (``NodeAgent.ended_why``).
        self.ended = ended
        # A command that failed once started: how long it ran (its action's exec_s, not
        # time the system added).
        self.ran_s = ran_s


class InputCutOffError(ExecError):
    """A command's streamed input ended because nobody was left to send the rest (its
    link dropped), not because its requester ended it: the command is killed, never run
    on the part that came."""


def check_setup(
    argv: Sequence[str], code: int | None, timed_out: bool, timeout_s: float, stderr: str
) -> None:
    """Raise why an environment's setup command ``argv`` failed, if it did, in the same
    words in every runtime: its exit code, or the ``timeout_s`` it ran past (then it was
    killed). Not retried by clients: a retry would spend the whole timeout again, and a
    command that hangs (a prompt, a dead mirror) hangs again."""
    if timed_out:
        said = f"timed out after {timeout_s:g} s (killed)"
    elif code != 0:
        said = f"failed with exit code {code}"
    else:
        return
    raise ExecError(f"setup {list(argv)} {said}: {stderr[-500:]}", reason="SetupFailed")


@dataclass(frozen=True, slots=True)
class Gone:
    """An environment that ended by itself (killed, evicted, deleted): its trajectory is
    lost, for ``reason`` (one of ``SANDBOX_FAILURES``)."""

    trajectory: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Output:
    stdout: bytes
    stdout_truncated: bool
    stderr: bytes
    stderr_truncated: bool


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int | None  # None when killed by the runtime
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    cores: tuple[int, ...]
    setup_s: float  # cgroup update and start, before the command runs
    exec_s: float  # the command itself
    teardown_s: float  # back to the idle set
    path: str = "process"  # how it was started: fast, portable (Docker) or process
    fallback: str = ""  # why the fast path was not taken, when it was not
    signal: int | None = None  # the signal that killed the command, when one did
    note: str = ""  # beside the outcome, what its caller must know (a session's state lost)
    oom_killed: bool = False  # it (or its child) SIGKILLed as the OOM killer killed in its sandbox

    @property
    def dop(self) -> int:
        return len(self.cores)

    @classmethod
    def of(
        cls,
        code: int | None,
        output: Output,
        timed_out: bool,
        cores: Sequence[int],
        stamps: tuple[float, float, float, float],
        *,
        path: str = "process",
    ) -> ExecResult:
        """Assemble a result from the output and the four time stamps of an exec.

        A command killed by a signal (``code`` is minus the signal) reports 128 + the
        signal, as shells and Docker do, and the signal apart: an exit with that code is
        not a death by it.
        """
        t0, t1, t2, t3 = stamps
        killed = -code if code is not None and code < 0 else None
        return cls(
            128 + killed if killed is not None else code,
            _text(output.stdout, output.stdout_truncated),
            _text(output.stderr, output.stderr_truncated),
            output.stdout_truncated,
            output.stderr_truncated,
            timed_out,
            tuple(sorted(cores)),
            t1 - t0,
            t2 - t1,
            t3 - t2,
            path,
            signal=killed,
        )


@dataclass(frozen=True, slots=True)
class Opened:
    """An environment given to a trajectory."""

    container_id: str
    warm: bool  # taken from the warm pool
    seconds: float


class Allotments:
    """The cores held by the actions running in each environment right now.

    An environment has one cgroup, so actions running in it at the same time share it: it
    gets the union of their cores and the sum of their quotas, and returns to the idle set
    only when the last of them ends. (One at a time, an action's cgroup is exactly its own
    cores.)
    """

    def __init__(self) -> None:
        self._held: dict[str, list[tuple[tuple[int, ...], float]]] = {}

    def enter(self, env: str, cores: Sequence[int], quota: float) -> tuple[list[int], float]:
        """Register an action; the limits the environment needs now."""
        self._held.setdefault(env, []).append((tuple(cores), quota))
        return self._limits(env)

    def leave(self, env: str, cores: Sequence[int], quota: float) -> tuple[list[int], float] | None:
        """An action ended; the limits the others still need, or None for the idle set."""
        held = self._held.get(env, [])
        if (tuple(cores), quota) in held:
            held.remove((tuple(cores), quota))
        if not held:
            self._held.pop(env, None)
            return None
        return self._limits(env)

    def _limits(self, env: str) -> tuple[list[int], float]:
        held = self._held[env]
        return sorted({c for cores, _ in held for c in cores}), sum(q for _, q in held)


def check_request(
    is_open: bool, trajectory: str, argv: Sequence[str], cores: Sequence[int]
) -> None:
    """The checks every runtime makes before running anything."""
    if not is_open:
        raise ExecError(f"trajectory: {trajectory} is not open")
    if not argv:
        raise ExecError("argv: empty command")
    if not cores:
        raise ExecError("cores: an action needs at least one core")


_DOP = re.compile(r"\{\{dop\}\}|\{dop\}")


def render(argv: Sequence[str], dop: int) -> list[str]:
    """Fill ``{dop}`` in an argv template, ``{{dop}}`` being a literal ``{dop}`` (an
    f-string's, say); nothing else is interpreted."""
    fill = str(dop)
    return [_DOP.sub(lambda m: "{dop}" if len(m[0]) == 7 else fill, a) for a in argv]


def _text(data: bytes, cut: bool) -> str:
    """Output as text. Cut at its cap, it may end inside a character: that part is left
    out rather than shown as U+FFFD, which would read as output the command wrote."""
    if not cut:
        return data.decode(errors="replace")
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)


def cap(kept: bytearray, chunk: bytes, limit: int) -> bool:
    """Append what fits of ``chunk`` under ``limit`` bytes; True when some was cut."""
    room = limit - len(kept)
    kept += chunk[: max(0, room)]
    return len(chunk) > room


async def supervise(
    collect: Awaitable[Output],
    timeout_s: float | None,
    kill: Callable[[], Awaitable[None]],
    on_cancel: Callable[[], Awaitable[None]],
    *,
    cancelled: bool = False,
) -> tuple[Output, bool]:
    """Await a command's output; at the deadline kill it, on cancellation kill and re-raise.

    Returns the output (what it wrote before being killed, if it was) and whether it was
    killed before its end: at the deadline, or when this task's ``STOP`` was set (a cancel
    that keeps the output, which the caller tells from a timeout by the event).
    ``cancelled``: the caller was cancelled while the command started, and it is killed at
    once.
    """
    task = asyncio.ensure_future(collect)
    stop = STOP.get()
    try:
        if cancelled:
            raise asyncio.CancelledError
        if stop is None:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s), False
        stopped = asyncio.ensure_future(stop.wait())
        try:  # (asyncio.wait cancels neither on a cancel: the except below kills)
            await asyncio.wait({task, stopped}, timeout=timeout_s, return_when=FIRST)
        finally:
            stopped.cancel()
        if task.done():
            return task.result(), False
        raise TimeoutError
    except TimeoutError:
        _stop_output()  # a reader that gives no credit must not hold the kill back
        await kill()
        return await _killed(task), True
    except asyncio.CancelledError:
        _stop_output()
        await kill()
        with contextlib.suppress(Exception):
            await _killed(task)
        await on_cancel()
        raise


# How long a killed command's end is awaited. Its end comes from whatever ran it (an exec
# server's handler, a cgroup): one that never says it (a handler its command stopped,
# under an exec server older than the one that kills such a handler) must not hold the
# action, and its cores, for ever.
KILL_ANSWER_S = 10.0


async def _killed(task: asyncio.Future[Output]) -> Output:
    try:
        return await asyncio.wait_for(asyncio.shield(task), KILL_ANSWER_S)
    except TimeoutError:
        task.cancel()
        raise ExecError(
            f"the command was killed but its end was not told within {KILL_ANSWER_S:g} s "
            "(was its exec server's handler stopped?): given up, its cores given back"
        ) from None


@dataclass(frozen=True, slots=True)
class ExecIO:
    """What streams while a command runs (streaming exec): its output as it is produced,
    its standard input, signals for its process group, and whether it has a terminal."""

    output: Callable[[int, bytes], Awaitable[None]] | None = None  # (1 or 2, bytes)
    stdin: AsyncIterator[bytes] | None = None  # until its end, then stdin is closed
    signals: asyncio.Queue[int] | None = None
    pty: bool = False
    # Once the command is being killed: ``output`` drops what it would wait to send.
    stop_output: Callable[[], None] | None = None


# Set, the command that ``supervise`` watches in this task is killed as at its deadline,
# and its output kept: how the agent cancels an exec whose scheduler wants what it wrote.
STOP: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("STOP", default=None)
FIRST = asyncio.FIRST_COMPLETED

# What ``supervise`` calls as it kills a command: the ``stop_output`` of the ExecIO that
# ``feeding`` runs the command with (this task's), if it has one. A context variable, so
# that every runtime that feeds a command through ``feeding`` gets it unasked.
_output_stop: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "_output_stop", default=None
)


def _stop_output() -> None:
    stop = _output_stop.get()
    if stop is not None:
        stop()


@contextlib.asynccontextmanager
async def feeding(
    io: ExecIO | None,
    write: Callable[[bytes], Awaitable[None]],
    close_stdin: Callable[[], Awaitable[None]],
    send_signal: Callable[[int], Awaitable[None]],
) -> AsyncIterator[None]:
    """While the block runs (the command), give it its stdin and its signals; nothing for
    a plain exec (``io`` None, the common case)."""
    if io is None:
        yield
        return
    token = _output_stop.set(io.stop_output)
    task = asyncio.ensure_future(_feed(io, write, close_stdin, send_signal))
    try:
        yield
    finally:
        _output_stop.reset(token)
        task.cancel()
        (fed,) = await asyncio.gather(task, return_exceptions=True)
    if isinstance(fed, InputCutOffError):  # (killed for it: its exit is not its outcome)
        raise fed


async def _feed(
    io: ExecIO,
    write: Callable[[bytes], Awaitable[None]],
    close_stdin: Callable[[], Awaitable[None]],
    send_signal: Callable[[int], Awaitable[None]],
) -> None:
    async def stdin() -> None:
        if io.stdin is None:
            return
        try:
            async for data in io.stdin:
                await write(data)
            await close_stdin()
        except InputCutOffError:
            # Not its end: an EOF now would run it on part of its input.
            with contextlib.suppress(ExecError):
                await send_signal(signal.SIGKILL)
            raise
        except ExecError:
            return  # it ended, and stopped taking input

    async def signals() -> None:
        while io.signals is not None:
            await send_signal(await io.signals.get())

    parts = [asyncio.ensure_future(stdin()), asyncio.ensure_future(signals())]
    try:
        await asyncio.gather(*parts)
    finally:  # both end with the command, whichever ended first
        for part in parts:
            part.cancel()


async def given(data: bytes) -> AsyncIterator[bytes]:
    """Standard input given whole (``stdin`` of a request)."""
    if data:
        yield data


def owner_id(state_dir: Path) -> str:
    """Names the agent that owns an environment (container, pod or cgroup): its state
    directory's digest."""
    return hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
