"""E2B sandboxes: trajectories with the lifetime E2B gives a sandbox (killed when its
timeout passes, unless extended) and their commands, known by pid.

A sandbox made here carries its timeout as a trajectory label and its ``envVars`` as the
trajectory's ``env_vars``, both kept by its node agent: after a scheduler restart the
trajectory comes back from its agent, its commands still get its variables, and the
sandbox gets a fresh timeout of that length when the reaper first sees it (its remaining
time is not kept). Any other open trajectory of the tenant is a sandbox too by its id
(found: connected to, killed), but is not listed: a list is of the sandboxes made here,
so that an E2B cleanup that kills all it lists leaves the trajectories opened through /v1
(an RL trainer's) alone. It has no timeout, as it had none, and ends as any trajectory
does. A sandbox whose environment ended by itself (its trajectory lost) serves nothing,
but can be killed, and is closed when its timeout passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tangram.api.wire import OpenTrajectory, TrajectoryState
from tangram.service.engine import Engine
from tangram.service.live import LiveExec
from tangram.service.records import ActionRecord, EngineError, TrajectoryRecord

log = logging.getLogger("tangram.service.e2b")

TIMEOUT_LABEL = "e2b.tangram.dev/timeout-s"
DEFAULT_TIMEOUT_S = 300  # E2B's default
MAX_TIMEOUT_S = 24 * 3600
REAP_EVERY_S = 1.0
NO_END_S = 365 * 24 * 3600  # the endAt of a sandbox that has no end: a year after it opened
OUTPUT_BACKLOG = 256  # output chunks held for a reader before its command waits


def sandbox_labels(metadata: dict[str, str], timeout_s: int) -> dict[str, str]:
    """A sandbox's trajectory labels: its metadata, and its timeout."""
    return {**metadata, TIMEOUT_LABEL: str(timeout_s)}


@dataclass(eq=False)
class Proc:
    """A command started through envd's Process service."""

    pid: int
    tag: str | None
    config: dict[str, object]  # as asked: cmd, args, envs, cwd
    stdin: bool
    pty: bool
    rec: ActionRecord = field(init=False)  # once submitted
    live: LiveExec = field(init=False)
    # Its output on the way to each stream reading it: every reader gets every event from
    # when it attached, as envd fans them out. None reading (E2B's disconnect leaves the
    # command running): its output is dropped, not held.
    readers: list[asyncio.Queue[tuple[str, str]]] = field(default_factory=list)
    signalled: int | None = None  # the last signal SendSignal sent it
    _room: asyncio.Event = field(default_factory=asyncio.Event)

    def output(self, kind: str, text: str) -> None:
        event = ("pty" if self.pty else kind, text)
        for queue in self.readers:
            queue.put_nowait(event)

    def _full(self) -> bool:
        return any(queue.qsize() >= OUTPUT_BACKLOG for queue in self.readers)

    async def room(self) -> None:
        """Until each reader has taken enough of its output (its command waits meanwhile,
        for the slowest reader)."""
        while self._full():
            self._room.clear()
            await self._room.wait()

    def taken(self) -> None:
        if not self._full():
            self._room.set()

    def attach(self) -> asyncio.Queue[tuple[str, str]]:
        """A new reader: it gets the output from now on, beside any reader already there."""
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.readers.append(queue)
        return queue

    def detach(self, queue: asyncio.Queue[tuple[str, str]]) -> None:
        self.readers = [q for q in self.readers if q is not queue]
        self.taken()  # (a command that waited for this reader goes on)


@dataclass(eq=False)
class Sandbox:
    tenant: str
    id: str
    trajectory: TrajectoryRecord
    end_at: float | None  # unix seconds; None: no timeout
    procs: dict[int, Proc] = field(default_factory=dict)
    next_pid: int = 1

    @property
    def metadata(self) -> dict[str, str]:
        return {k: v for k, v in self.trajectory.labels.items() if k != TIMEOUT_LABEL}

    def new_pid(self) -> int:
        pid, self.next_pid = self.next_pid, self.next_pid + 1
        return pid


class Sandboxes:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.clock = clock
        self._known: dict[tuple[str, str], Sandbox] = {}
        self._reaper: asyncio.Task[None] | None = None
        # Sandboxes being killed at their timeout: each on its own task, so a close its
        # agent never answers holds up neither another's nor the next rounds.
        self.expiring: set[asyncio.Task[None]] = set()

    async def create(
        self, tenant: str, template: str, timeout_s: int, metadata: dict[str, str],
        env_vars: dict[str, str],
    ) -> Sandbox:  # fmt: skip
        req = OpenTrajectory(
            env=template, labels=sandbox_labels(metadata, timeout_s), env_vars=env_vars
        )
        rec = await self.engine.open_trajectory(tenant, req)
        box = Sandbox(tenant, rec.id, rec, None)
        self._end(box, self.clock() + timeout_s)
        self._known[(tenant, rec.id)] = box
        return box

    def find(self, tenant: str, sid: str, *, lost: bool = False) -> Sandbox:
        """``tenant``'s sandbox ``sid``: any of its trajectories that is open; ``lost``:
        or lost (its environment gone), which can still be killed."""
        try:
            rec = self.engine.trajectory(tenant, sid)  # 404 for an unknown or a stranger's
        except EngineError as e:
            if e.kind != "not_found":
                raise
            # E2B's SDK reads "was not found" as a sandbox killed or past its timeout
            # (SandboxNotRunningException); one killed here has left no record.
            raise EngineError("not_found", "sandbox", f"sandbox {sid} was not found "
                              f"({e.message})") from None  # fmt: skip
        box = self._known.get((tenant, sid))
        if box is not None and box.trajectory is not rec:
            box = None  # the id was closed and opened again since
        if rec.state.closed:
            self._known.pop((tenant, sid), None)
        if rec.state.closed or (rec.state is TrajectoryState.LOST and not lost):
            # (a lost one stays known: the reaper still closes it at its timeout)
            why = f": {rec.ended}" if rec.ended else ""
            raise EngineError("not_found", "sandbox", f"sandbox {sid} was not found "
                              f"({rec.state}{why})")  # fmt: skip
        if box is None:
            box = self._known[(tenant, sid)] = Sandbox(tenant, sid, rec, None)
            self._end(box, self._adopted_end(rec))
        return box

    def mine(self, tenant: str) -> list[Sandbox]:
        """The tenant's sandboxes made through E2B's API (their timeout's label says so,
        after a restart too) that are open. Not its other trajectories, though ``find``
        takes any of them by id: an E2B script that lists every sandbox and kills it
        (a cleanup) killed the trajectories an RL trainer opened through /v1."""
        found = []
        for rec in list(self.engine.state.trajectories.values()):
            if rec.tenant == tenant and TIMEOUT_LABEL in rec.labels:
                with contextlib.suppress(EngineError):
                    found.append(self.find(tenant, rec.id))
        return found

    async def kill(self, tenant: str, sid: str) -> None:
        """Close the sandbox's trajectory, a lost one too: it holds a record until closed."""
        self.find(tenant, sid, lost=True)
        self._known.pop((tenant, sid), None)
        await self.engine.close_trajectory(tenant, sid)

    def shown_end(self, box: Sandbox) -> float:
        """When the sandbox ends unless it is used or extended (E2B's ``endAt``, unix
        seconds): its timeout. A trajectory without one (opened through /v1) ends when
        its env's idleTimeoutSeconds finds it idle: that long after its last use, or from
        now while it is busy (a command queued or running, a files request, its opening).
        With no idle timeout either it has no end:
        ``NO_END_S`` after it opened, as E2B's API needs a date."""
        if box.end_at is not None:
            return box.end_at
        rec, now = box.trajectory, self.clock()
        limit = self.engine.state.env_of(rec).idle_timeout_s
        if limit is None:
            return rec.opened_at + NO_END_S
        held = self.engine.core.trajectories.get(rec.key)  # (its actions queued or running)
        if rec.running or rec.transfers or rec.opening is not None or (held and held.in_flight):
            return now + limit  # busy: the idle timeout closes it only once it is not
        idle_for = self.engine.state.clock() - rec.active_at  # (the engine's clock: monotonic)
        return now + max(0.0, limit - idle_for)

    def set_timeout(self, box: Sandbox, timeout_s: int, *, extend_only: bool = False) -> None:
        """``extend_only`` (a connect): only ever later, and a sandbox with no timeout (a
        /v1 trajectory) keeps none."""
        end = self.clock() + timeout_s
        if not extend_only or (box.end_at is not None and end > box.end_at):
            self._end(box, end)

    @staticmethod
    def _end(box: Sandbox, end_at: float | None) -> None:
        """Its timeout: what ends it, not its env's idle timeout (the docs promise the
        sandbox lives till ``timeout`` passes, however idle)."""
        box.end_at = end_at
        box.trajectory.timed = end_at is not None

    def _adopted_end(self, rec: TrajectoryRecord) -> float | None:
        """When a sandbox made before a restart ends. Anyone may set the label through
        /v1: a value that is not a timeout this API could have given is kept in bounds."""
        label = rec.labels.get(TIMEOUT_LABEL, "")
        if not (label.isascii() and label.isdecimal()):
            return None
        return self.clock() + min(int(label[:12]), MAX_TIMEOUT_S)

    def start(self) -> None:
        """Run the reaper, from the service's start: sandboxes of a scheduler that
        restarted are reaped whether or not anyone asks about them."""
        self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            try:
                await self.reap_once()
            except Exception:  # one bad record must not end the reaping of every sandbox
                log.exception("reaping sandboxes failed; trying again in %s s", REAP_EVERY_S)

    async def reap_once(self) -> None:
        """Kill the sandboxes whose timeout has passed, lost ones too; take on the ones
        made before a restart (their label says so)."""
        for rec in list(self.engine.state.trajectories.values()):
            if TIMEOUT_LABEL in rec.labels and (rec.tenant, rec.id) not in self._known:
                with contextlib.suppress(EngineError):
                    self.find(rec.tenant, rec.id, lost=True)
        now = self.clock()
        due = []
        for key, box in list(self._known.items()):
            if box.trajectory.state.closed:
                self._known.pop(key, None)
            elif box.end_at is not None and box.end_at <= now:
                due.append(box)
        for box in due:
            self._known.pop((box.tenant, box.id), None)  # (not due again while it goes)
            task = asyncio.create_task(self._expire(box))
            self.expiring.add(task)
            task.add_done_callback(self.expiring.discard)

    async def _expire(self, box: Sandbox) -> None:
        log.info("sandbox %s reached its timeout: killed", box.id)
        try:
            await self.kill(box.tenant, box.id)
        except EngineError as e:
            if e.kind != "not_found":  # (gone meanwhile: nothing to do)
                log.warning("killing sandbox %s at its timeout failed: %s", box.id, e)
        except Exception:
            log.exception("killing sandbox %s at its timeout failed", box.id)

    async def stop(self) -> None:
        for task in [self._reaper, *self.expiring]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
