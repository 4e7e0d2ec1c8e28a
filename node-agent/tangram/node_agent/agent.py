"""The node agent: one runtime behind the operations the scheduler service asks for.

``NodeAgent.create`` picks the Docker runtime when a Docker Engine is reachable and the
process runtime otherwise, re-adopts what a previous agent left, and answers
``AgentRequest``s (open, close, exec, session, warm, cancel; services and call on a GPU
node) with ``AgentReply``s. The link to the scheduler (``link.py``) only moves these
messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram.api.inventory import NodeInventory
from tangram.api.wire import (
    FILES_FEATURE,
    OPEN_KEYS_FEATURE,
    TAR_FEATURE,
    AgentCall,
    AgentCancel,
    AgentClose,
    AgentExec,
    AgentFiles,
    AgentHello,
    AgentInput,
    AgentOpen,
    AgentReply,
    AgentRequest,
    AgentServices,
    AgentSession,
    AgentWarm,
    EnvSpec,
    ExecOutcome,
    FilesOutcome,
    RunningAction,
    RunningCall,
    TrajectoryMeta,
    fit_output,
    json_bytes,
)
from tangram.node_agent import state_lock
from tangram.node_agent.execution import (
    STOP,
    ExecError,
    ExecIO,
    ExecResult,
    Gone,
    given,
    owner_id,
)
from tangram.node_agent.gpu_service import GpuOptions, GpuRole
from tangram.node_agent.gpus import nvml_gpus
from tangram.node_agent.inventory import read_inventory
from tangram.node_agent.key_journal import KeyJournal
from tangram.node_agent.pod_runtime import DEFAULT_EXECD_PATH
from tangram.node_agent.runtimes import Runtime, Setting, create, registration
from tangram.node_agent.streams import Stream
from tangram.private_files import private_dir, write_private

log = logging.getLogger("tangram.agent")
# A stopped exec not ended this long after (its kill could not end it) is cancelled:
# within the scheduler's wait for the answer (CANCEL_WAIT_S, 5 s).
STOP_GRACE_S = 4.0
MAX_ENDED = 1024  # environments found ended kept, to say why a request on one failed
# How long a request whose exec server went looks for its environment's end, and how often.
ENDED_LOOK_S, ENDED_LOOK_EVERY_S = 2.0, 0.1
MAX_REMEMBERED = 50_000  # results kept per agent for retried keys ...
MAX_REMEMBERED_BYTES = 256 << 20  # ... and the bytes they may hold
CUT_OFF = (
    "its outcome is unknown: it was running when the node agent stopped, and it may have "
    "run to its end; it is not run again"
)


def _nowhere(message: str) -> None:
    return None  # no link: a streamed request's chunk has nobody to go to


Keyed = AgentExec | AgentSession | AgentCall


def _cancel(task: asyncio.Future[AgentReply]) -> None:
    if not task.done():
        task.cancel()


@dataclass(frozen=True, slots=True)
class _KeyedRun:
    """A keyed run in flight, as a later link's hello reports it if its link dropped."""

    request: Keyed
    started: float  # monotonic

    def running(self, key: str, now: float) -> RunningAction | RunningCall:
        req, running_s = self.request, now - self.started
        if isinstance(req, AgentCall):
            return RunningCall(key=key, service=req.service, gpus=list(req.gpus),
                               running_s=running_s, digest=req.digest)  # fmt: skip
        return RunningAction(key=key, trajectory=req.trajectory, cores=list(req.cores),
                             running_s=running_s, digest=req.digest,
                             timeout_s=req.timeout_s)  # fmt: skip

    @property
    def asked(self) -> str:
        return _asked(self.request)

    @property
    def journaled(self) -> bool:
        """Whether it is written down, before it starts and when it ends. A service call
        is not: cut off by the agent's end it is run again when retried (an inference
        changes nothing a second run could repeat), rather than answered as unknown; and
        its outputs, often large and many, stay in memory only."""
        return not isinstance(self.request, AgentCall)


def _what(req: Keyed) -> str:
    """What a key runs, to tell a retry from another request reusing the key."""
    if isinstance(req, AgentCall):
        return f"a call of service {req.service}"
    return f"{req.op} on {req.trajectory}"


def _trajectory_of(asked: str) -> str | None:
    """The trajectory a run (an ``_asked``) ran in; None for a service call's."""
    what = asked.partition("\0")[0]
    for op in ("exec on ", "session on "):
        if what.startswith(op):
            return what[len(op) :]
    return None


# What may differ between a request and its retry: the link's id, where the scheduler
# placed it, the key itself, and how its output travels. The scheduler's digest is the
# scheduler's to compare (an older one sends none): left out, journals stay comparable.
_PLACEMENT = {"rid", "cores", "gpus", "key", "stream", "interactive", "ahead", "digest"}


def _asked(req: Keyed) -> str:
    """What a key runs and a digest of the rest of its request (its command, input,
    environment, limits), NUL-joined: a retry must match both. A plain ``str``, so that
    the many the agent keeps are no work for the cyclic GC."""
    body = req.model_dump_json(exclude=_PLACEMENT).encode()
    return f"{_what(req)}\0{hashlib.blake2b(body, digest_size=8).hexdigest()}"


def _conflict(ran: str, asked: str) -> str | None:
    """Why a request may not reuse a key that ``ran`` (an ``_asked``), if it may not."""
    if ran == asked:
        return None
    was, now = ran.partition("\0")[0], asked.partition("\0")[0]
    if was != now:
        return f"its idempotency key was used for {was}, not {now}"
    return f"its idempotency key was used for {was} with another request"


def split_cores(
    cores: Sequence[int], idle: int, for_actions: int | None
) -> tuple[list[int], list[int]]:
    """(action cores, idle cores): the idle set is the first ``idle`` cores; actions get
    the last ``for_actions`` (default: all the others; all of them on a one-core node)."""
    ordered = sorted(cores)
    if idle < 1:
        raise ExecError("idle_cores: at least one core must hold idle trajectories")
    idle_set = ordered[: min(idle, len(ordered))]
    rest = ordered[len(idle_set) :] or ordered
    n = len(rest) if for_actions is None else min(for_actions, len(ordered))
    actions = rest[-n:] if n <= len(rest) else ordered[-n:]
    return sorted(actions), idle_set


@dataclass(frozen=True, slots=True)
class PodOptions:
    """What the pod runtime needs to know of its cluster (``tangram agent --runtime pod``)."""

    namespace: str  # where the sandbox pods go: the pool's
    execd_image: str  # an image holding the exec server (the agent's own)
    execd_path: str = DEFAULT_EXECD_PATH
    pool: str = ""  # the ActionPool that owns the sandboxes (with pool_uid)
    pool_uid: str = ""
    kubeconfig: str | None = None  # outside a pod; in one, its ServiceAccount

    def owner(self) -> dict[str, object] | None:
        if not (self.pool and self.pool_uid):
            return None
        return {"apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool", "name": self.pool,
                "uid": self.pool_uid, "controller": False, "blockOwnerDeletion": False}  # fmt: skip


class NodeAgent:
    def __init__(
        self,
        runtime: Runtime,
        inventory: NodeInventory,
        action_cores: list[int],
        idle_cores: list[int],
        *,
        node: str,
        gpu: GpuRole | None = None,
        agent_id: str = "",
    ) -> None:
        self.runtime = runtime
        runtime.warm_failed = self._warm_failed
        self.gpu = gpu  # RewardService calls on this node's GPUs, if it serves them
        self.inventory = inventory
        self.action_cores = action_cores
        self.idle_cores = idle_cores
        self.node = node
        # Which agent this is to the scheduler (its state directory's digest): another
        # agent of the pool on the same node has another.
        self.agent_id = agent_id
        self.meta_dir: Path | None = None  # where trajectory metadata outlives the agent
        self._state_lock: int | None = None  # its state directory's lock (state_lock.hold)
        self.meta: dict[str, TrajectoryMeta] = {}
        self._tasks: dict[int, asyncio.Task[AgentReply]] = {}
        # A running exec's stop (its task's ``STOP``): set by a cancel that keeps its output
        self._stops: dict[asyncio.Future[AgentReply], asyncio.Event] = {}
        # Environments found ended, by trajectory, the latest few: why a request on one
        # failed (``ended_why``). The looks for them one at a time (``_looking``).
        self._ended: dict[str, Gone] = {}
        self._looking = asyncio.Lock()
        # At-most-once execution per key: finished replies, and keyed runs in flight.
        # Keyed runs outlive the link that asked for them.
        # Replies are kept as JSON: bytes are invisible to the cyclic GC, whereas 50,000
        # live reply models made its full collections 150 ms pauses under load.
        self._results: OrderedDict[str, bytes] = OrderedDict()
        self._result_bytes = 0
        self._unjournaled: set[str] = set()  # keys in _results the journal does not hold
        self._unjournaled_bytes = 0
        self._ran: dict[str, str] = {}  # _asked of the keys in _results (journaled: unknown)
        # The keys of each trajectory's runs: forgotten when it closes, since a trajectory
        # opened again under its name is another environment (a key reused there must run
        # there, not replay what ran in the one closed). Running at its close: not kept.
        self._keys_of: dict[str, set[str]] = {}
        self._unkept: set[str] = set()
        self._keyed: dict[str, asyncio.Task[AgentReply]] = {}
        self._keyed_info: dict[str, _KeyedRun] = {}
        self._orphaned: set[str] = set()  # keyed runs whose requester's link dropped
        self._unsent: list[AgentReply] = []  # their results, until a link takes them
        self._sink: Callable[[AgentReply], None] | None = None
        self._post: Callable[[str], None] = _nowhere  # chunks of streamed requests (JSON)
        self._streams: dict[int, Stream] = {}  # by rid
        self.journal: KeyJournal | None = None  # keyed runs on disk (with a state dir)
        # A stop on purpose: when it began (monotonic: the signal's time, ``note_stop``),
        # its one wind-down, and whether that killed what still ran. What the stop kills
        # is not answered: its scheduler ends it as for any agent lost (``outcome_unknown``;
        # a keyed one, "started" in the journal, reads "unknown" to the next agent too).
        self.stop_began: float | None = None
        self._winding: asyncio.Future[int] | None = None
        self._cut = False

    @classmethod
    def create(
        cls,
        state_dir: Path,
        *,
        node: str | None = None,
        runtime: str = "auto",
        idle_cores: int = 1,
        cores_for_actions: int | None = None,
        cache_dir: Path | None = None,
        gpus: GpuOptions | None = None,
        pods: PodOptions | None = None,
        exclusive: bool = False,
    ) -> NodeAgent:
        """An agent for this machine; ``runtime``: auto, docker, pod (sandboxes as pods on
        this Kubernetes node: ``pods`` says where), process, or noop (runs nothing, on
        ``cores_for_actions`` virtual cores: for benchmarks of the service); ``gpus``:
        whether it serves RewardService calls, and on which devices; ``exclusive``: the
        state directory is this process's alone while it runs (ExecError if another agent
        has it: the CLI's agents; a test may stand in for a restart in one process)."""
        lock = state_lock.hold(state_dir) if exclusive else None
        try:
            agent = cls._create(
                state_dir, node=node, runtime=runtime, idle_cores=idle_cores,
                cores_for_actions=cores_for_actions, cache_dir=cache_dir, gpus=gpus, pods=pods,
            )  # fmt: skip
        except BaseException:
            if lock is not None:
                state_lock.release(lock)
            raise
        agent._state_lock = lock
        return agent

    @classmethod
    def _create(
        cls,
        state_dir: Path,
        *,
        node: str | None,
        runtime: str,
        idle_cores: int,
        cores_for_actions: int | None,
        cache_dir: Path | None,
        gpus: GpuOptions | None,
        pods: PodOptions | None,
    ) -> NodeAgent:
        private_dir(state_dir, narrow=True)  # outputs and tenants (its journal, meta/)
        if pods is not None and pods.pool_uid:
            state_lock.claim(state_dir, pods.pool_uid)
        options = gpus or GpuOptions()
        inventory = read_inventory(gpus=nvml_gpus if options.mode in ("auto", "cuda") else None)
        name = node or inventory.hostname
        if runtime != "auto" and registration(runtime).virtual_cores:
            # Cores that are numbers only; the idle one apart from them, as a host's is.
            actions = list(range(cores_for_actions or 1024))
            idle = [len(actions)]
        else:
            host = sorted(os.sched_getaffinity(0))
            actions, idle = split_cores(host, idle_cores, cores_for_actions)
        setting = Setting(state_dir, name, idle, cache_dir, owner_id(state_dir), {"pods": pods})
        agent = cls(create(runtime, setting), inventory, actions, idle, node=name,
                    agent_id=setting.owner_id)  # fmt: skip
        if agent.runtime.problem is not None:  # the scheduler refuses it, and says so
            log.error("this node cannot run actions: %s", agent.runtime.problem.message)
        agent.runtime.adopt()  # what a previous agent left; hello() reports what is held
        agent.load_meta(state_dir / state_lock.META_DIR)
        agent.use_journal(KeyJournal(state_dir / state_lock.JOURNAL_FILE))
        agent.gpu = GpuRole.start(options, nvml_gpus=len(inventory.gpus))
        return agent

    @property
    def kind(self) -> str:
        return self.runtime.kind

    @property
    def fast_path(self) -> str:
        return self.runtime.fast_path

    def hello(self) -> AgentHello:
        now = time.monotonic()
        cut = [run.running(k, now) for k, run in self._keyed_info.items() if k in self._orphaned]
        return AgentHello(
            node=self.node,
            inventory=self.inventory,
            runtime=self.kind,
            action_cores=self.action_cores,
            idle_cores=self.idle_cores,
            fast_path=self.fast_path,
            no_io=self.runtime.no_io,
            trajectories=[
                self.meta.get(t) or TrajectoryMeta(id=t, tenant="", env="") for t in self._held()
            ],
            running=[r for r in cut if isinstance(r, RunningAction)],
            calls=[r for r in cut if isinstance(r, RunningCall)],
            gpu=self.gpu.info if self.gpu is not None else None,
            problem=self.runtime.problem,
            features=[FILES_FEATURE, TAR_FEATURE, OPEN_KEYS_FEATURE],
            agent=self.agent_id,
        )

    def _held(self) -> list[str]:
        return self.runtime.held()

    def attach(
        self, sink: Callable[[AgentReply], None], post: Callable[[str], None] = _nowhere
    ) -> None:
        """A link is up: results of runs whose requester went away go to ``sink``, the
        chunks of streamed requests to ``post``."""
        self._sink, self._post = sink, post
        for reply in self._unsent:
            sink(reply)
        self._unsent.clear()

    def detach(self) -> None:
        self._sink, self._post = None, _nowhere
        # Their output has nowhere to go now, and input not ended is cut off: a keyed
        # command reading it is killed and fails, rather than run on part of it.
        for stream in self._streams.values():
            stream.close()

    def received(self, req: AgentRequest) -> None:
        """A request as the link reads it, before its task starts: a streamed one's
        stream is ready for the input that may follow it in the same frame."""
        streamed = isinstance(req, AgentFiles) or (
            isinstance(req, AgentExec) and (req.stream or req.interactive)
        )
        if streamed and req.rid not in self._streams:
            self._streams[req.rid] = Stream(req.rid, self._post)  # ends with its link

    def input(self, msg: AgentInput) -> None:
        """Data or credit for a streamed request (in the order the link read them); one
        whose request has ended is dropped."""
        stream = self._streams.get(msg.target)
        if stream is not None:
            stream.take(msg)

    def keep_unsent(self, reply: AgentReply) -> None:
        """A result the link took but could not send: the next link gets it."""
        self._unsent.append(reply)

    async def handle(self, req: AgentRequest) -> AgentReply:
        """Answer one request; errors become a reply, never an exception. At a stop on
        purpose, a request that came after it began is answered at once ``not_taken``
        (nothing of it ran: its scheduler ends it retryable, and a retry of its key
        reaches an agent that runs it), and one the stop killed is not answered
        (``CancelledError``): the scheduler ends it as the link closes, ``outcome_unknown``."""
        if isinstance(req, AgentCancel):
            task = self._keyed.get(req.key) if req.key else self._tasks.get(req.target or -1)
            stop = self._stops.get(task) if task is not None and req.output else None
            if (stream := self._streams.get(req.target or -1)) is not None:
                # What waits to send its output would hold the kill back. A stopped
                # command's input is not cut: it would end failing for its input, not
                # cancelled with what it wrote.
                stream.stop_output() if stop is not None else stream.close()
            if task is not None and stop is not None:
                stop.set()  # killed as at its deadline: it answers with what it wrote
                # (and is cancelled after all if the kill cannot end it)
                asyncio.get_running_loop().call_later(STOP_GRACE_S, _cancel, task)
            elif task is not None:
                task.cancel()
            return AgentReply(rid=req.rid, ok=True)
        try:
            if self.stop_began is not None and not self._ran_here(req):
                return AgentReply(rid=req.rid, ok=False, retryable=True, not_taken=True,
                                  error=f"{req.op}: the node agent is stopping")  # fmt: skip
            self.received(req)  # (the link has, unless a caller hands it in directly)
            if isinstance(req, Keyed) and req.key is not None:
                return await self._once(req, req.key)
            task = asyncio.ensure_future(self._run(req))
            self._tasks[req.rid] = task
            try:
                return await task
            except asyncio.CancelledError:
                if self._cut:  # killed by the stop: left unanswered, as said above
                    raise
                return AgentReply(rid=req.rid, ok=False, error="cancelled")
            finally:
                self._tasks.pop(req.rid, None)
        finally:
            if (stream := self._streams.pop(req.rid, None)) is not None:
                stream.close()

    def _ran_here(self, req: AgentRequest) -> bool:
        """Whether ``req`` is keyed and its key ran, or runs, here: its replay or its run's
        end answers it, never "not taken" (which would let it run again elsewhere)."""
        key = req.key if isinstance(req, Keyed) else None
        return key is not None and (key in self._results or key in self._keyed)

    async def _once(self, req: Keyed, key: str) -> AgentReply:
        """Run a keyed action or service call at most once: a repeat gets the first run's
        reply, or waits for the run in flight. The run goes on if the requester's link
        drops; its result is then sent, unasked, on the next link (rid 0, with its key)."""
        # The scheduler refuses a key reused for something else while it remembers the key;
        # past that (its bound, its restart) the agent must not answer with another's reply.
        task = self._keyed.get(key)
        ran = self._ran.get(key) if task is None else self._keyed_info[key].asked
        if ran is not None and (why := _conflict(ran, _asked(req))) is not None:
            return AgentReply(rid=req.rid, ok=False, key=key, error=why)
        done = self._results.get(key)
        if done is not None:
            replayed = AgentReply.model_validate_json(done)
            return replayed.model_copy(update={"rid": req.rid, "replayed": True})
        joined = task is not None  # an earlier request's run: its reply is a replay here
        if task is None:
            run = _KeyedRun(req, time.monotonic())
            if self.journal is not None and run.journaled:  # on disk first: never run twice
                try:
                    self.journal.started(key, run.asked)
                except OSError as e:  # not recorded, so not run: a retry may run it
                    return AgentReply(rid=req.rid, ok=False, key=key, retryable=True,
                                      error=f"the agent cannot record the key: {e}")  # fmt: skip
            task = asyncio.ensure_future(self._run(req))
            self._keyed[key] = task
            self._keyed_info[key] = run
            if not isinstance(req, AgentCall):
                self._keys_of.setdefault(req.trajectory, set()).add(key)
            task.add_done_callback(lambda t: self._keyed_done(key, t))
        self._tasks[req.rid] = task  # an explicit cancel request cancels the run itself
        try:
            reply = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # cancelled on request, or killed by the agent's stop
                if self._cut:  # (unanswered: see ``_cut``)
                    raise
                return AgentReply(rid=req.rid, ok=False, error="cancelled", key=key)
            if key in self._results:  # it finished just as the link dropped: report it
                self._deliver(AgentReply.model_validate_json(self._results[key]))
            else:  # running, or finished with its done-callback still to come: that one
                self._orphaned.add(key)  # reports it, unasked; the run goes on without us
            raise
        finally:
            self._tasks.pop(req.rid, None)
        again = joined or reply.replayed
        return reply.model_copy(update={"rid": req.rid, "key": key, "replayed": again})

    def _keyed_done(self, key: str, task: asyncio.Task[AgentReply]) -> None:
        run = self._keyed_info.pop(key, None)
        if task.cancelled() and self._cut:
            # Killed by the stop: no reply kept or sent. The journal, closed first, holds
            # it as started: the next agent answers its retry "unknown".
            self._keyed.pop(key, None)
            self._orphaned.discard(key)
            self._unkept.discard(key)
            return
        # the scheduler's digest of the request, so that a scheduler that did not place
        # the run (restarted, or its node was away) still refuses another request's key
        digest = run.request.digest if run is not None else None
        if task.cancelled():
            reply = AgentReply(rid=0, ok=False, error="cancelled", key=key, digest=digest)
        else:
            reply = task.result().model_copy(update={"rid": 0, "key": key, "digest": digest})
        self._keyed.pop(key, None)
        if key in self._unkept:  # its trajectory closed: the run is no one's to retry
            self._unkept.discard(key)
            self._unjournal(key)
            if key in self._orphaned:
                self._orphaned.discard(key)
                self._deliver(reply)
            return
        kept = self._keep(key, json_bytes(reply))
        if run is not None:
            self._ran[key] = run.asked
        if run is not None and not run.journaled:
            self._unjournaled.add(key)
            self._unjournaled_bytes += len(kept)
        elif self.journal is not None:
            try:
                self.journal.done(key, kept, self._ran.get(key, ""))
                if self.journal.due(self._result_bytes - self._unjournaled_bytes):
                    running = {k: r.asked for k, r in self._keyed_info.items() if r.journaled}
                    self.journal.rewrite(
                        {k: v for k, v in self._results.items() if k not in self._unjournaled},
                        set(running),
                        {**self._ran, **running},
                    )
            except OSError as e:  # the reply still goes out; a restart would say unknown
                log.error("the key journal %s: %s", self.journal.path, e)
        if key in self._orphaned:
            self._orphaned.discard(key)
            self._deliver(reply)

    def _keep(self, key: str, reply: bytes) -> bytes:
        """Remember a key's reply for its retries, within the bounds (oldest go first)."""
        self._results[key] = reply
        self._result_bytes += len(reply)
        while len(self._results) > MAX_REMEMBERED or self._result_bytes > MAX_REMEMBERED_BYTES:
            self._drop_result(next(iter(self._results)))
        return reply

    def _drop_result(self, key: str) -> None:
        old = self._results.pop(key, None)
        if old is None:
            return
        self._result_bytes -= len(old)
        trajectory = _trajectory_of(self._ran.pop(key, ""))
        if trajectory is not None:
            self._keys_of.get(trajectory, set()).discard(key)
        if key in self._unjournaled:
            self._unjournaled.remove(key)
            self._unjournaled_bytes -= len(old)

    def _deliver(self, reply: AgentReply) -> None:
        if self._sink is not None:
            self._sink(reply)
        else:
            self._unsent.append(reply)

    async def _run(self, req: AgentRequest) -> AgentReply:
        """Run one request; with -v (INFO) each one is logged as it ends, with its ids."""
        if not log.isEnabledFor(logging.INFO):
            return await self._run_op(req)
        started = time.monotonic()
        reply: AgentReply | None = None
        try:
            reply = await self._run_op(req)
            return reply
        finally:
            status = "cancelled" if reply is None else "ok" if reply.ok else "failed"
            log.info(
                "%s ran", req.op,
                extra={
                    "action": getattr(req, "key", None),
                    "trajectory": getattr(req, "trajectory", None),
                    "node": self.node, "kind": req.op, "status": status,
                    "ran_s": round(time.monotonic() - started, 6),
                },
            )  # fmt: skip

    async def _run_op(self, req: AgentRequest) -> AgentReply:
        try:
            match req:
                case AgentOpen():
                    seconds, warm = await self.open(req.trajectory, req.env)
                    if req.meta is not None:
                        try:
                            self._remember(req.meta)
                        except OSError:  # (a full disk) the open fails: not left behind
                            await asyncio.to_thread(self.close, req.trajectory)
                            raise
                    return AgentReply(rid=req.rid, ok=True, opened_s=seconds, warm=warm)
                case AgentClose():
                    await asyncio.to_thread(self.close, req.trajectory)
                    return AgentReply(rid=req.rid, ok=True)
                case AgentWarm():
                    await self.runtime.keep_warm(req.envs)
                    return AgentReply(rid=req.rid, ok=True)
                case AgentServices():
                    gpu = self._gpu()
                    loaded = await gpu.sync(req.services)
                    resident = await asyncio.to_thread(gpu.resident)  # takes a lock
                    return AgentReply(rid=req.rid, ok=True, loaded=loaded, resident=resident)
                case AgentCall(ahead=True):
                    out = await self._gpu().restore_ahead(req.service, req.gpus)
                    return AgentReply(rid=req.rid, ok=True, call=out)
                case AgentCall():
                    out = await self._gpu().call(req.service, req.gpus, req.inputs)
                    return AgentReply(rid=req.rid, ok=True, call=out)
                case AgentExec():
                    return await self._stoppable(req)
                case AgentSession():
                    result = await self.exec(req, self._streams.get(req.rid))
                    return AgentReply(rid=req.rid, ok=True, result=outcome(result),
                                      signal=result.signal, error=result.note or None)  # fmt: skip
                case AgentFiles():
                    files = await self.files(req, self._streams[req.rid])
                    return AgentReply(rid=req.rid, ok=True, files=files)
                case _:  # a cancel is answered by handle(), an input by input(): never run
                    raise ExecError(f"{req.op}: not a request to run")
        except ExecError as e:
            why = str(e)
            if e.ended and isinstance(req, AgentExec | AgentSession):
                why += await self.ended_why(req.trajectory)
            return AgentReply(rid=req.rid, ok=False, error=why, reason=e.reason or None,
                              retryable=e.retryable, errno=e.errno, ran_s=e.ran_s)  # fmt: skip
        except Exception as e:  # a request must always be answered: say what failed, stay up
            log.exception("%s %s failed", req.op, getattr(req, "trajectory", ""))
            return AgentReply(rid=req.rid, ok=False, error=f"{req.op}: {e}")

    async def _stoppable(self, req: AgentExec) -> AgentReply:
        """An exec that a cancel asking for its output stops (``STOP``): it is killed and
        answered as ``cancelled``, with what it wrote and how long it ran."""
        stop, task = asyncio.Event(), asyncio.current_task()
        STOP.set(stop)  # (this task's own context)
        if task is not None:
            self._stops[task] = stop
        try:
            result = await self.exec(req, self._streams.get(req.rid))
        finally:
            self._stops.pop(task, None)  # type: ignore[arg-type]
        # (timed_out stays: a scheduler that reads no ``cancelled`` says timeout, not ok)
        cancelled = stop.is_set() and result.timed_out
        return AgentReply(rid=req.rid, ok=True, result=outcome(result), signal=result.signal,
                          cancelled=cancelled, oom_killed=result.oom_killed)  # fmt: skip

    def _gpu(self) -> GpuRole:
        if self.gpu is None:
            raise ExecError(f"{self.node} has no GPU role (the agent runs without --gpus)")
        return self.gpu

    async def open(self, trajectory: str, spec: EnvSpec) -> tuple[float, bool]:
        self._ended.pop(trajectory, None)  # (an id opened again: another environment)
        return await self.runtime.open(trajectory, spec)

    def close(self, trajectory: str) -> None:
        self.runtime.close(trajectory)
        self._forget(trajectory)
        for key in self._keys_of.pop(trajectory, set()):
            if key in self._keyed:
                self._unkept.add(key)
            else:
                self._drop_result(key)
                self._unjournal(key)

    def _unjournal(self, key: str) -> None:
        """Write down that ``key`` is forgotten: a restarted agent must not take it back."""
        if self.journal is not None:
            try:
                self.journal.forget(key)
            except OSError as e:
                log.error("the key journal %s: %s", self.journal.path, e)

    def _forget(self, trajectory: str) -> None:
        self.meta.pop(trajectory, None)
        if self.meta_dir is not None:
            (self.meta_dir / f"{trajectory}.json").unlink(missing_ok=True)

    async def report_gone(self) -> int:
        """Tell the scheduler, unasked, of environments that ended by themselves (killed,
        evicted, deleted): their trajectories are lost, for the reason given. A notice
        that finds no link waits for the next one, like an orphaned result."""
        async with self._looking:  # (the watch's look and a failed request's, not both)
            ended = await self.runtime.gone()
        for g in ended:
            log.warning("trajectory %s: its environment ended: %s", g.trajectory, g.message)
            self._forget(g.trajectory)
            self._ended[g.trajectory] = g
            while len(self._ended) > MAX_ENDED:
                del self._ended[next(iter(self._ended))]
            self._deliver(AgentReply(rid=0, ok=False, lost=g.trajectory, reason=g.reason,
                                     error=g.message))  # fmt: skip
        return len(ended)

    def _warm_failed(self, env: str, e: ExecError) -> None:
        """A warm sandbox of ``env`` could not be made: the scheduler counts it as a failed
        open (the pool's and the TrajectoryEnv's SandboxesHealthy), unasked. Not kept for a
        later link: the next top-up says it again if it still fails."""
        if self._sink is not None:
            self._sink(AgentReply(rid=0, ok=False, warm_failed=env, error=str(e),
                                  reason=e.reason or None))  # fmt: skip

    async def ended_why(self, trajectory: str) -> str:
        """Why a request on ``trajectory`` found its exec server gone, looked for now
        rather than at the next watch (the scheduler hears of the loss first): the cause,
        as `` (SandboxDeleted: ...)``, or "" when its environment still runs."""
        # The engine may not show the end yet as the server's connection drops (a kill's
        # state lands after it): looked at again for a moment.
        deadline = time.monotonic() + ENDED_LOOK_S
        while trajectory not in self._ended and time.monotonic() < deadline:
            try:
                await self.report_gone()
            except Exception:  # (the watch looks again)
                log.exception("looking for ended environments failed")
                break
            if trajectory not in self._ended:
                await asyncio.sleep(ENDED_LOOK_EVERY_S)
        g = self._ended.get(trajectory)
        return "" if g is None else f" ({g.reason}: {g.message})"

    def _remember(self, meta: TrajectoryMeta) -> None:
        self.meta[meta.id] = meta
        if self.meta_dir is not None:
            # Atomic, never half a file; its tenant's name: this agent's alone to read.
            write_private(self.meta_dir / f"{meta.id}.json", meta.model_dump_json().encode())

    def use_journal(self, journal: KeyJournal) -> None:
        """Keep keyed runs in ``journal``, first taking up what a previous agent left in
        it: the replies of its runs, and for each key it started but never ended, an
        "unknown" reply (the run may have gone to its end: it is not run again)."""
        done, cut_off = journal.load()
        for key, reply in done.items():
            self._keep(key, reply)
        for key in cut_off:
            self._keep(key, json_bytes(AgentReply(rid=0, ok=False, key=key, unknown=True,
                                                  error=CUT_OFF)))  # fmt: skip
        # What each key ran: a reuse of it for another request is still refused.
        self._ran.update((k, a) for k, a in journal.asked.items() if k in self._results)
        for key, asked in self._ran.items():
            if (trajectory := _trajectory_of(asked)) is not None:
                self._keys_of.setdefault(trajectory, set()).add(key)
        journal.rewrite(self._results, set(), self._ran)
        self.journal = journal

    def load_meta(self, meta_dir: Path) -> None:
        """Metadata of the environments this agent holds, as a previous agent wrote it."""
        self.meta_dir = meta_dir
        held = set(self._held())
        for path in sorted(meta_dir.glob("*.json")) if meta_dir.is_dir() else []:
            try:
                meta = TrajectoryMeta.model_validate_json(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if meta.id in held:
                self.meta[meta.id] = meta
            else:
                path.unlink(missing_ok=True)  # its environment is gone

    async def exec(self, req: AgentExec | AgentSession, stream: Stream | None = None) -> ExecResult:
        if isinstance(req, AgentSession):
            return await self.runtime.session(
                req.trajectory,
                req.session.kind,
                req.code,
                req.cores,
                name=req.session.name,
                timeout_s=req.timeout_s,
                env=req.environ,
                output_cap=req.output_cap,
            )
        return await self.runtime.exec(
            req.trajectory,
            req.argv,
            req.cores,
            timeout_s=req.timeout_s,
            env=req.environ,
            output_cap=req.output_cap,
            io=exec_io(req, stream),
        )

    async def files(self, req: AgentFiles, stream: Stream) -> FilesOutcome:
        """A file operation in the trajectory's environment; a read's entry goes ahead of
        its data, a write's data comes in on ``stream``."""
        files = self.runtime.files(req.trajectory)
        match req.action:
            case "read" | "tar":
                entry, data = await (files.read if req.action == "read" else files.tar)(req.path)
                stream.head(FilesOutcome(entry=entry))
                async with contextlib.aclosing(data):  # (it holds the exec server's channel)
                    async for chunk in data:
                        await stream.send(1, chunk)
            case "write":
                written = await files.write(req.path, stream.received(), req.mode)
                return FilesOutcome(written=written)
            case "untar":
                members, size = await files.untar(req.path, stream.received())
                return FilesOutcome(written=size, members=members)
            case "list":
                return FilesOutcome(entries=await files.list(req.path))
            case "stat":
                return FilesOutcome(entry=await files.stat(req.path))
            case "mkdir":
                return FilesOutcome(created=await files.mkdir(req.path))
            case "remove":
                await files.remove(req.path)
            case "rename":
                await files.rename(req.path, req.to or "")
        return FilesOutcome()

    def running(self) -> set[asyncio.Future[AgentReply]]:
        """The requests in flight: commands, calls, opens (keyed runs whose link went too)."""
        return {t for t in (*self._tasks.values(), *self._keyed.values()) if not t.done()}

    def note_stop(self, at: float | None = None) -> None:
        """A stop on purpose began ``at`` (monotonic; default now): requests that come
        from now on are not taken (answered ``not_taken``), and the grace of what runs counts from
        here. The first call counts: the signal handler's, ahead of a link still
        connecting or a loop busy elsewhere (the pod's 30 s run from the signal)."""
        if self.stop_began is None:
            self.stop_began = time.monotonic() if at is None else at

    async def wind_down(self, grace_s: float, hurry: asyncio.Event | None = None) -> int:
        """Stop on purpose: take no new request, let what runs finish within ``grace_s``
        of the stop's start (``note_stop``; or until ``hurry`` is set), then kill what is
        left, unanswered. Returns how many were killed. One wind-down, however often
        called (the link's leave, then ``link.run`` once the link is gone): a later call
        waits for the same one, which goes on if a caller is cancelled."""
        if self._winding is None:
            self._winding = asyncio.ensure_future(self._wind_down(grace_s, hurry))
        return await asyncio.shield(self._winding)

    async def _wind_down(self, grace_s: float, hurry: asyncio.Event | None) -> int:
        self.note_stop()
        assert self.stop_began is not None
        left_s = grace_s - (time.monotonic() - self.stop_began)
        # (WARNING: an agent logs no INFO without -v, and its stop must show in its log)
        log.warning("stopping: %d request(s) in flight get up to %g s to finish; new requests "
                    "are not taken", len(self.running()), max(0.0, left_s))  # fmt: skip
        await self._grace(left_s, hurry)
        left = self.running()
        if not left:
            return 0
        when = (
            f"at a second stop signal, within its {grace_s:g} s grace"
            if hurry is not None and hurry.is_set()
            else f"at the end of its {grace_s:g} s grace"
        )
        log.warning("stopping: %d request(s) still running killed %s, unanswered: the "
                    "scheduler ends them as outcome_unknown", len(left), when)  # fmt: skip
        self._cut = True
        if self.journal is not None:  # (cut-off keyed runs read "unknown" to the next agent,
            self.journal.close()  # as for any stop: the journal holds them as started)
            self.journal = None
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=STOP_GRACE_S)  # (a kill that cannot end it: bounded)
        return len(left)

    async def _grace(self, left_s: float, hurry: asyncio.Event | None) -> None:
        """Until nothing started before the stop runs, ``left_s`` pass, or ``hurry``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + left_s
        hurried = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
        try:
            while (left := self.running()) and (timeout := deadline - loop.time()) > 0:
                if hurried is not None and hurried.done():
                    break
                waits: set[asyncio.Future[Any]] = {*left}
                if hurried is not None:
                    waits.add(hurried)
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if hurried is not None:
                hurried.cancel()

    async def shutdown(self) -> None:
        """Cancel what runs (on the loop: tasks are not thread-safe), then let the runtime
        release what is no trajectory's (warm environments). The journal is closed first:
        keyed runs cut off by the stop stay "started" in it, so the next agent answers
        them as unknown, not as cancelled on request."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        for task in self._tasks.values():
            task.cancel()
        if self.gpu is not None:
            self.gpu.close()
        await self.runtime.shutdown()
        if self._state_lock is not None:
            state_lock.release(self._state_lock)
            self._state_lock = None


def exec_io(req: AgentExec, stream: Stream | None) -> ExecIO | None:
    """What streams while the command runs: None for a plain exec (the common case, which
    every runtime takes as it always has)."""
    if req.stdin is None and not req.pty and stream is None:
        return None
    stdin = given(req.stdin.encode()) if req.stdin is not None else None
    if stream is not None and req.interactive:
        stdin = _then(stdin, stream.received())
    return ExecIO(
        output=stream.send if stream is not None and req.stream else None,
        stdin=stdin,
        signals=stream.signals if stream is not None else None,
        pty=req.pty,
        stop_output=stream.stop_output if stream is not None and req.stream else None,
    )


async def _then(
    first: AsyncIterator[bytes] | None, rest: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    if first is not None:
        async for data in first:
            yield data
    async for data in rest:
        yield data


def outcome(r: ExecResult) -> ExecOutcome:
    """The result as sent, each stream cut to what its encoding lets the link carry."""
    stdout, out_cut = fit_output(r.stdout)
    stderr, err_cut = fit_output(r.stderr)
    sent = ExecOutcome.model_validate(r, from_attributes=True)  # the same fields on the wire
    if not (out_cut or err_cut):
        return sent
    return sent.model_copy(update={
        "stdout": stdout, "stdout_truncated": r.stdout_truncated or out_cut,
        "stderr": stderr, "stderr_truncated": r.stderr_truncated or err_cut,
    })  # fmt: skip
