"""RewardService calls: the GPU manager's side of the engine.

A GPU node's worker joins with its devices; it is told which services to hold (it loads
each once into host memory); each call runs on the chunk of GPUs the round gave it, and
the worker's residency reports keep the core's view of what is in GPU memory true.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence

from tangram.api.action import ActionSpec
from tangram.api.cluster import ServiceSpec
from tangram.api.demand import ChoicesDemand, TableEfficiency, allowed_units
from tangram.api.wire import (
    ActionStatus,
    AgentCall,
    AgentReply,
    AgentServices,
    ErrorInfo,
    GpuWorkerInfo,
    ResidentInstance,
    RunningCall,
    ServiceCallRequest,
    ServiceLoad,
    ServiceOutcome,
    json_bytes,
)
from tangram.scheduler.core.decisions import Ahead
from tangram.scheduler.core.dp import CHUNK_SIZES
from tangram.scheduler.core.scheduler import Assignment, SchedulingError
from tangram.service.agents import ACTION
from tangram.service.config import ServiceConfig
from tangram.service.outcomes import Outcomes
from tangram.service.records import KEY_SEP, ActionRecord, EngineError, err
from tangram.service.state import PoolState

log = logging.getLogger("tangram.service")
GROUP = "services"  # the core's holder of a tenant's service calls is "~services/<tenant>"


def call_target(service: str) -> str:
    """What a service call's idempotency key names (a retry must name the same)."""
    return f"call of service {service}"


class GpuCalls:
    def __init__(self, state: PoolState, outcomes: Outcomes) -> None:
        self.s = state
        self.outcomes = outcomes
        self.h2d_gbps: dict[str, float] = {}  # measured by each GPU node's agent
        self.loads: dict[str, dict[str, ServiceLoad]] = {}  # node -> service -> load
        # node -> service -> the definition (``revision``) its worker's last answer was
        # for. Until it answers for the current one, it is loading it (or has unloaded it
        # to reload it) and refuses its calls: none is placed there meanwhile.
        self.synced: dict[str, dict[str, str]] = {}
        self.revisions: dict[str, str] = {}  # service -> its current definition's revision
        self._syncs: dict[str, int] = {}  # node -> syncs sent to it
        self._applied: dict[str, int] = {}  # node -> the latest sync whose answer counted

    # ---- nodes and their services --------------------------------------------------
    def join(self, node: str, gpu: GpuWorkerInfo) -> None:
        """A node's GPU worker joins: its devices (as many as the pool's gpusPerNode allows,
        a power of two for buddy chunks) become a GPU node of the core, and it is told
        which services to load."""
        s = self.s
        limit = min(len(gpu.devices), s.config.gpus_per_node or 8)
        count = max(k for k in CHUNK_SIZES if k <= limit)
        if count < len(gpu.devices):
            log.warning(
                "node %s: %d GPUs, buddy chunks use the first %d", node, len(gpu.devices), count
            )
        memory_gb = min(gpu.memory_bytes[:count]) / 2**30
        try:
            s.core.add_gpu_node(node, count, memory_gb)
        except SchedulingError as e:
            log.warning("the GPUs of %s cannot join: %s", node, e)
            return
        s.node_gpus[node] = list(gpu.devices[:count])
        self.h2d_gbps[node] = gpu.h2d_gbps
        self.synced.pop(node, None)
        self._hosted(node)  # nothing yet: its worker loads every service first
        log.info(
            "node %s: %d %s GPUs join, %.1f GiB each for services, host-to-device %.1f GB/s",
            node,
            count,
            gpu.backend,
            memory_gb,
            gpu.h2d_gbps,
        )
        s.background(self.sync_services(node))

    def leave(self, node: str) -> None:
        self.s.node_gpus.pop(node, None)
        self.h2d_gbps.pop(node, None)
        self.loads.pop(node, None)
        self.synced.pop(node, None)

    def services_changed(self) -> None:
        """The pool's RewardServices changed: the core's view, and every worker's set. A
        worker unloads an edited service before it loads the new one and refuses its calls
        meanwhile, so no call of it is placed there until its answer comes (they wait)."""
        self.s.core.set_services(self.service_specs())
        self._forget_removed()  # (those with no call running are dropped at once)
        for node in self.s.node_gpus:
            self._hosted(node)
            self.s.background(self.sync_services(node))

    async def sync_services(self, node: str) -> None:
        """Have ``node``'s worker hold exactly the pool's services (it loads each once into
        host memory); their measured sizes feed the restore estimates. Not a worker whose
        agent said it stops: its node takes no new call, so it would load them for
        nothing while it winds down; the worker its next agent brings is synced as it
        joins."""
        s = self.s
        if s.core.is_cordoned(node):
            return
        configs = list(s.config.services.values())
        sent = {c.spec.name: revision(c) for c in configs}
        seq = self._syncs[node] = self._syncs.get(node, 0) + 1
        try:
            reply = await s.ask(node, AgentServices(services=[c.spec for c in configs]))
        except EngineError as e:
            log.warning("services not synced to %s: %s", node, e.message)
            return
        if not reply.ok:
            log.warning("services not synced to %s: %s", node, reply.error)
            return
        if node in s.node_gpus and seq >= self._applied.get(node, 0):
            self._applied[node] = seq  # (an earlier sync's answer coming later is older)
            self._sync_resident(node, reply.resident)
            self.loads[node] = dict(reply.loaded)
            self.synced[node] = {n: sent[n] for n in reply.loaded if n in sent}
            for name, load in sorted(reply.loaded.items()):
                if not load.ok:
                    log.warning("RewardService %s cannot load on %s: %s", name, node, load.error)
            s.core.set_services(self.service_specs())
            self._hosted(node)
            self.fail_unloadable()
            s.wake.set()

    def _hosted(self, node: str) -> None:
        """Tell the core which services ``node``'s worker cannot take calls of: those it
        could not load, and those it has not answered for in their current definition."""
        synced = self.synced.get(node, {})
        loads = self.loads.get(node, {})
        loading = {n for n, rev in self.revisions.items() if synced.get(n) != rev}
        failed = {n for n, load in loads.items() if not load.ok and n not in loading}
        self.s.core.set_unloadable(node, failed, loading=loading)

    def _load_failures(self, service: str) -> dict[str, str] | None:
        """The load error of ``service`` on each GPU node, when every one of them has
        answered for its current definition and none could load it; else None (one holds
        it, or is still loading it, or no GPU node is connected). A node whose agent said
        it stops and has not answered for it counts as gone: it is not asked
        (``sync_services``), and would take no call of it."""
        rev = self.revisions.get(service)
        failures: dict[str, str] = {}
        for node in self.s.node_gpus:
            load = self.loads.get(node, {}).get(service)
            if self._unasked(node, service):
                continue
            if load is None or load.ok or self.synced.get(node, {}).get(service) != rev:
                return None
            failures[node] = load.error or "not loaded"
        return failures or None

    def _unasked(self, node: str, service: str) -> bool:
        """Whether ``node``'s agent said it stops and its worker has not answered for the
        current definition of ``service``: no sync goes to it now (``sync_services``),
        so what it said of an earlier one stands for nothing (and its node takes no call
        anyway)."""
        rev = self.revisions.get(service)
        return self.s.core.is_cordoned(node) and self.synced.get(node, {}).get(service) != rev

    def fail_unloadable(self) -> None:
        """Queued calls of a service that every GPU node has now failed to load (its
        definition was edited and the new one fails) end now, with the load errors: no
        node would take them until the service is edited again. Asked when a load is
        answered, and when a node that had not answered stops or leaves (the rest may
        all have failed by then)."""
        s = self.s
        queued: dict[str, list[ActionRecord]] = {}
        for rec in s.actions.values():
            a = s.core.actions.get(rec.id) if rec.kind == "service" else None
            if a is not None and a.service is not None and rec.started is None:
                queued.setdefault(a.service, []).append(rec)
        for service, recs in queued.items():
            failures = self._load_failures(service)
            if failures is None:
                continue
            error = err("service_failed", _cannot_load(service, failures))
            for rec in recs:
                s.core.cancel(rec.id)
                self.outcomes.finish(rec, ActionStatus.REJECTED, error=error)

    def service_specs(self) -> list[ServiceSpec]:
        specs = [self._service_spec(c) for c in self.s.config.services.values()]
        self.revisions = {spec.name: spec.revision for spec in specs}
        return specs

    def _service_spec(self, cfg: ServiceConfig) -> ServiceSpec:
        """The core's view of a service. Its restore cost is the declared one, or the
        model's bytes over the slowest measured host-to-device bandwidth."""
        restore = cfg.restore_s
        if restore is None:
            restore = max(
                (
                    loads[cfg.spec.name].bytes / (self.h2d_gbps[node] * 1e9)
                    for node, loads in self.loads.items()
                    if cfg.spec.name in loads and node in self.h2d_gbps
                ),
                default=0.0,
            )
        return ServiceSpec(
            name=cfg.spec.name,
            gpu_memory_gb=cfg.spec.gpu_memory_gb,
            dop_choices=list(cfg.dop_choices),
            restore_s=restore,
            replicated=cfg.spec.replicated,
            max_calls=cfg.max_calls,
            batch_slowdown=cfg.batch_slowdown,
            revision=revision(cfg),
        )

    def _sync_resident(self, node: str, resident: list[ResidentInstance]) -> None:
        """The core's residency view of ``node`` from its worker's report: the device
        indexes become the node's GPU positions; instances off the pool's GPUs are left out."""
        found: list[tuple[str, int, int]] = []
        for r in resident:
            start = self._first_gpu(node, r.devices)
            if start is not None:
                found.append((r.service, start, len(r.devices)))
        self.s.core.sync_resident(node, found)

    def _first_gpu(self, node: str, devices: Sequence[int]) -> int | None:
        """The pool's position on ``node`` of the first of ``devices`` (a worker's device
        indexes), or None unless they are consecutive positions of the pool's GPUs."""
        position = {d: i for i, d in enumerate(self.s.node_gpus.get(node, []))}
        at = sorted(position.get(d, -1) for d in devices)
        if at and at[0] >= 0 and at == list(range(at[0], at[0] + len(at))):
            return at[0]
        return None

    # ---- calls ---------------------------------------------------------------------
    def call_spec(self, service: str, req: ServiceCallRequest) -> ActionSpec:
        """A call of ``service`` as the elastic algorithm sees it, once a worker can take
        it: the DoPs it may get, and from the profiles measured for its input size a
        duration for each (as t1 and an efficiency table that reproduce them exactly)."""
        s = self.s
        cfg = s.config.services.get(service)
        if cfg is None:
            known = ", ".join(sorted(s.config.services)) or "none"
            raise EngineError(
                "not_found", "service", f"unknown RewardService {service!r} (known: {known})"
            )
        if not s.node_gpus:
            raise EngineError("unavailable", "service", "no GPU node agent is connected")
        states = {
            n: loads[service]
            for n, loads in self.loads.items()
            if service in loads and not self._unasked(n, service)
        }
        if not any(st.ok for st in states.values()):
            failures = self._load_failures(service)
            if failures is not None:  # a retry would fail the same way until an edit
                raise EngineError("conflict", "service", _cannot_load(service, failures))
            why = "; ".join(f"{n}: {st.error}" for n, st in sorted(states.items()))
            raise EngineError(  # no worker has answered yet, or one is still loading it
                "unavailable",
                "service",
                f"{service} is loaded on no GPU node{': ' if why else ''}{why}",
            )
        gpu = s.core.gpu
        return elastic_call_spec(cfg, req, fits=lambda k: gpu.fits(service, k, soon=True))

    async def call(self, rec: ActionRecord, asg: Assignment) -> None:
        s = self.s
        assert asg.node is not None and asg.chunk is not None
        assert isinstance(rec.request, ServiceCallRequest)
        req = rec.request
        gpus = self.outcomes.devices(asg)
        service = s.core.running[rec.id].action.service or ""
        if asg.sharing:
            s.metrics.joined(service)
        t0 = s.clock()
        status, reply, error = ActionStatus.ERROR, None, None
        # Keyed, the agent runs it at most once and goes on with it if the link drops; a
        # scheduler that starts meanwhile adopts it (``adopt``).
        key = rec.agent_key
        op = AgentCall(service=service, gpus=gpus, inputs=req.inputs, key=key, digest=rec.digest)
        sent = self.revisions.get(service)  # the definition the call was placed for
        # The call's thread cannot be stopped once it runs: its chunk stays held until the
        # agent answers, even when the caller stops waiting (timeout, cancel).
        ACTION.set(rec.id)  # (its ask's task takes it along: ``AgentLink.answered``)
        ask = asyncio.ensure_future(s.ask(asg.node, op))
        rec.sent = True  # (by its ask's first step: the call may run from there)
        try:
            reply = await asyncio.wait_for(asyncio.shield(ask), req.timeout_s)
            if reply.ok and reply.call is not None:
                status = ActionStatus.OK
            else:
                error = self._failed(service, sent, reply.error, reply.retryable)
        except asyncio.CancelledError:
            status, error = ActionStatus.CANCELLED, s.stop_ended(rec, killed=False)
        except TimeoutError:
            status = ActionStatus.TIMEOUT
            error = err("timeout", f"no answer within {req.timeout_s or 0:g} s (timeout_s); the "
                        "call runs on, and holds its GPUs, until it ends: a running call "
                        "cannot be stopped")  # fmt: skip
        except EngineError as e:
            error = self.outcomes.ask_failed(rec, e)
        now = s.clock()
        call = reply.call if reply is not None else None
        if key is not None and reply is not None:
            s.cancelled_keys.pop(key, None)  # its run ended: a cancel of it is moot
        if ask.done():
            # A replayed reply (its key's earlier run) ran nothing now: its time is not the
            # call's, and an instance it was to restore was not restored.
            replayed = reply is not None and reply.replayed
            self._complete(
                rec.id,
                ok=status is ActionStatus.OK,
                restore_s=_restore_s(call),
                resident=False if replayed and asg.restore else None,
                learn=not replayed,
            )
        else:
            s.background(ask)

            def late(done: asyncio.Future[AgentReply]) -> None:
                """The call ended after its caller stopped waiting: not learned from, but
                if it ran, its instance is resident."""
                answer = None if done.cancelled() or done.exception() else done.result()
                if key is not None and answer is not None:
                    s.cancelled_keys.pop(key, None)
                ran = answer is not None and answer.ok and not answer.replayed
                self._complete(rec.id, ok=False, resident=ran or None)
                self._forget_removed()

            ask.add_done_callback(late)
        self._end(rec, status, call, error, now - t0)

    def _failed(
        self, service: str, sent: str | None, why: str | None, retryable: bool = False
    ) -> ErrorInfo:
        """The error of a call of ``service`` placed for its definition ``sent`` that its
        agent answered with ``why``. Removed or edited since, the agent may have refused it
        for that (it unloads the old definition first): said so, and an edited one's call
        is retryable (the new definition takes it once loaded); else as the agent said."""
        why = why or "the agent refused the call"
        if service not in self.s.config.services:
            return err(
                "service_failed", f"RewardService {service} was removed from the pool ({why})"
            )
        if self.revisions.get(service) != sent:
            return err(
                "service_failed",
                f"RewardService {service} was edited meanwhile ({why}); a retry "
                "runs it on the new definition",
                retryable=True,
            )
        return err("service_failed", why, retryable)

    def _end(
        self,
        rec: ActionRecord,
        status: ActionStatus,
        call: ServiceOutcome | None,
        error: ErrorInfo | None,
        spent_s: float,
    ) -> None:
        """Give a call's result to its waiter; ``spent_s``: from its start to its reply.
        A call timed out or cancelled while it ran had no reply: its time was its run's,
        as far as anyone knows (as an exec's that is cancelled)."""
        exec_s = call.exec_s if call is not None else 0.0
        if call is None and status in (ActionStatus.TIMEOUT, ActionStatus.CANCELLED):
            exec_s = spent_s
        restore_s = _restore_s(call)
        self.outcomes.end(
            rec,
            status,
            complete=False,  # the core hears of it apart, with what the call measured
            error=error,
            exec_s=exec_s,
            restore_s=restore_s,
            overhead_s=max(0.0, spent_s - exec_s - restore_s),
            output=call.outputs if call is not None else None,
            service=call.stats if call is not None else None,
        )
        self._forget_removed()

    def _forget_removed(self) -> None:
        """The metric series of services removed from the pool go once the scheduler has
        dropped them (their last call ended), as gpu.md says."""
        s = self.s
        s.metrics.forget_services({*s.config.services, *s.core.services})

    # ---- calls from before a restart -----------------------------------------------
    def adopt(self, node: str, calls: Sequence[RunningCall]) -> int:
        """Keyed calls that ``node``'s worker still runs for a previous scheduler (or for
        this one, before the node's link dropped): each keeps its chunk (calls of one
        instance share it, as batched calls do), a retry of its key waits for it, and its
        reply comes unasked (``ended_unasked``). A call whose key already has an action
        here (its answer, or a retry) still holds its GPUs until it ends, but answers
        nobody (``PoolState.adopted_as``). Returns how many were adopted."""
        first: dict[tuple[str, int], str] = {}  # (service, first GPU) -> its adopted call
        adopted = 0
        for run in sorted(calls, key=lambda r: -r.running_s):  # the oldest started first
            start = self._first_gpu(node, run.gpus)
            if start is None:
                log.warning("cannot adopt call %s on %s: GPUs %s are not a chunk of the pool",
                            run.key, node, run.gpus)  # fmt: skip
                continue
            aid = self._adopt_call(run, node, start, first.get((run.service, start)))
            if aid:
                first.setdefault((run.service, start), aid)
                adopted += 1
        return adopted

    def _adopt_call(self, run: RunningCall, node: str, start: int, joins: str | None) -> str:
        """One call of ``adopt``: its record's id, or "" when it is not adopted."""
        s = self.s
        tenant, _, key = run.key.partition(KEY_SEP)
        cfg = s.config.services.get(run.service)
        if cfg is None or not tenant or not key:
            return ""  # its service is gone: no call can be placed on it, nothing waits
        req = ServiceCallRequest(inputs=["(adopted)"], idempotency_key=key)
        rec = s.record(tenant, None, "service", req, None, target=call_target(run.service))
        rec.digest = run.digest  # another request under its key is refused, as before
        rec.submitted -= run.running_s
        try:
            asg = s.core.adopt(
                rec.id,
                s.holder(tenant, GROUP),
                elastic_call_spec(cfg, req),
                units=len(run.gpus),  # DoPs are powers of two: a call's fills its chunk
                started_at=s.clock() - run.running_s,
                node=node,
                gpu_start=None if joins else start,
                joins=joins,
            )
        except SchedulingError as e:
            log.warning("cannot adopt call %s on %s: %s", run.key, node, e)
            return ""
        s.adopted_as(rec, asg)
        return rec.id

    def ended_unasked(self, rec: ActionRecord, reply: AgentReply) -> None:
        """The reply of an adopted call, sent by its agent when the call ended."""
        call = reply.call if reply.ok else None
        status, error = ActionStatus.OK, None
        if call is None:
            status = ActionStatus.CANCELLED if reply.error == "cancelled" else ActionStatus.ERROR
            if status is ActionStatus.ERROR:
                error = err("service_failed", reply.error or "the agent refused the call")
        self._complete(rec.id, ok=call is not None, restore_s=_restore_s(call))
        now = self.s.clock()
        self._end(rec, status, call, error, now - (rec.started if rec.started else now))

    def answer(self, reply: AgentReply, call: ServiceOutcome) -> None:
        """Keep the outputs of a call that ended while nobody held it (its node was away)
        as its key's answer, for the retry to come, unless the key has one."""
        s = self.s
        tenant, _, key = (reply.key or "").partition(KEY_SEP)
        if not tenant or not key or (tenant, key) in s.idempotent:
            return
        req = ServiceCallRequest(inputs=["(ended)"], idempotency_key=key)
        rec = s.record(tenant, None, "service", req, None, target=call_target(call.stats.service))
        rec.digest = reply.digest  # another request under its key is refused, as before
        s.idempotent.remember(tenant, key, rec)
        self._end(rec, ActionStatus.OK, call, None, 0.0)

    async def restore_ahead(self, ahead: Ahead) -> None:
        """A round's restore ahead: the node's worker makes the instance resident while the
        chunk stays free for calls; the core hears when it ended, and whether it worked."""
        s = self.s
        node, chunk = ahead.chunk.node, ahead.chunk
        gpus = s.devices(chunk)
        stats = None
        try:
            reply = await s.ask(node, AgentCall(service=ahead.service, gpus=gpus, ahead=True))
            if reply.ok and reply.call is not None:
                stats = reply.call.stats
            else:
                log.warning(
                    "restoring %s ahead on %s GPUs %s failed: %s",
                    ahead.service,
                    node,
                    gpus,
                    reply.error,
                )
        except EngineError as e:
            log.warning("restoring %s ahead on %s: %s", ahead.service, node, e.message)
        finally:
            s.core.ahead_done(ahead.service, chunk, ok=stats is not None)
            s.metrics.restored_ahead(ahead.service, stats)
            self._forget_removed()
            s.wake.set()

    def _complete(
        self,
        aid: str,
        *,
        ok: bool,
        restore_s: float | None = None,
        resident: bool | None = None,
        learn: bool = True,
    ) -> None:
        s = self.s
        if aid in s.core.running:
            s.core.complete(
                aid, s.clock(), ok=ok, restore_s=restore_s, resident=resident, learn=learn
            )
            s.wake.set()


def revision(cfg: ServiceConfig) -> str:
    """What the workers load of a service: any change to it makes them reload it."""
    return hashlib.sha256(json_bytes(cfg.spec)).hexdigest()[:16]


def _cannot_load(service: str, failures: dict[str, str]) -> str:
    why = "; ".join(f"{n}: {e}" for n, e in sorted(failures.items()))
    return (
        f"RewardService {service} cannot load on any GPU node ({why}); "
        "fix its definition or its files (an edit, or a reload, makes the nodes load it again)"
    )


def _restore_s(call: ServiceOutcome | None) -> float:
    """What making the call's instance resident cost it (evictions included)."""
    return call.stats.restore_s + call.stats.evict_s if call is not None else 0.0


def elastic_call_spec(
    cfg: ServiceConfig, req: ServiceCallRequest, fits: Callable[[int], bool] | None = None
) -> ActionSpec:
    """A call of the service ``cfg`` as the elastic algorithm sees it (see ``call_spec``).
    ``fits``: whether a DoP can fit the pool's GPUs; the DoPs that cannot are left out
    first, and only then those without a profile when some of the others have one (if
    none that fits has a profile, the call is learned online at those that fit)."""
    name = cfg.spec.name
    allowed = set(cfg.dop_choices)
    if req.gpu is not None:
        allowed &= set(allowed_units(req.gpu))
        if not allowed:
            raise EngineError(
                "invalid",
                "gpu",
                f"no DoP in {list(allowed_units(req.gpu))} is one of {name}'s dopChoices "
                f"{list(cfg.dop_choices)}",
            )
    if fits is not None:
        fitting = {k for k in allowed if fits(k)}
        if fitting:  # (none: the core refuses the call, naming the DoPs it asked for)
            allowed = fitting
    durations = {k: d for k, d in cfg.durations(req.input_size).items() if k in allowed}
    kind = f"service:{name}"
    if not durations:  # unprofiled: the request's t1, else learned online
        return ActionSpec(
            kind="service",
            service=name,
            gpu=ChoicesDemand(choices=sorted(allowed)),
            t1_s=req.t1_s,
            type=kind,
        )
    if len(durations) == 1:  # one DoP: not elastic, and its duration is the estimate
        ((k, d),) = durations.items()
        return ActionSpec(
            kind="service", service=name, gpu=ChoicesDemand(choices=[k]), t1_s=d, type=kind
        )
    t1 = min(k * d for k, d in durations.items())
    table = {k: min(1.0, t1 / (k * d)) for k, d in durations.items()}
    return ActionSpec(
        kind="service",
        service=name,
        gpu=ChoicesDemand(choices=sorted(durations)),
        t1_s=t1,
        efficiency=TableEfficiency(table=table),
        type=kind,
    )
