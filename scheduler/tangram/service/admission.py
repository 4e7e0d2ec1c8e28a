"""Admission: every action enters the queue here, whatever carried it (an HTTP request, a
batch, a message on the action stream).

Each kind checks its own request and builds its core action; one path then admits it
(:meth:`Admission._enter`): a retried idempotency key gets the action it already names,
the queue's bound and the scheduler's state are checked, and the action is queued with
its key remembered and its queue timeout set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from tangram.api.action import ActionSpec
from tangram.api.field_errors import field_path
from tangram.api.wire import (
    ActionResult,
    ApiCallRequest,
    ApiLeaseRequest,
    BatchItem,
    ExecRequest,
    ServiceCallRequest,
)
from tangram.scheduler.core.scheduler import SchedulingError
from tangram.service.api_calls import ApiCalls
from tangram.service.config import EnvConfig
from tangram.service.gpu_calls import GROUP, GpuCalls, call_target
from tangram.service.keys import Remembered, request_digest
from tangram.service.live import LiveExec
from tangram.service.outcomes import Outcomes
from tangram.service.records import ActionKind, ActionRecord, EngineError, Request
from tangram.service.state import PoolState

MAX_SHAPES = 10_000  # validated exec shapes kept


class Admission:
    def __init__(self, state: PoolState, outcomes: Outcomes, gpu: GpuCalls, api: ApiCalls) -> None:
        self.s = state
        self.outcomes = outcomes
        self.gpu = gpu
        self.api = api
        self._specs: dict[tuple[Any, ...], ActionSpec] = {}  # validated exec shapes

    def submit_exec(
        self, tenant: str, tid: str, req: ExecRequest, live: LiveExec | None = None
    ) -> ActionRecord:
        """Queue an exec action; ``await record.done`` for its result. ``live``: its
        streamed side, taken by a new action only (a repeat keeps the first's)."""

        def new(target: str) -> ActionRecord:
            traj = self.s.usable(tenant, tid)
            argv, spec = self._exec_spec(self.s.env_of(traj), req)
            rec = self._enter(tenant, req, spec, tid=traj.key, holder=traj.key, kind="exec",
                              argv=argv, target=target)  # fmt: skip
            rec.live = live
            traj.actions += 1
            return rec

        return self._admit(tenant, req, f"exec on {tid}", new)

    def lease_api(
        self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest
    ) -> ActionRecord:
        """Queue a lease of ``req.units`` of an API quota (the result carries the lease
        id), or a call the service makes for the caller once the quota admits it."""
        what = f"{'lease' if isinstance(req, ApiLeaseRequest) else 'call'} of {api}"
        return self._admit(tenant, req, what, lambda target: self._detached(
            tenant, req, self.api.spec(api, req), group="leases", kind="api", target=target
        ))  # fmt: skip

    def submit_service(self, tenant: str, service: str, req: ServiceCallRequest) -> ActionRecord:
        """Queue one call of a RewardService; ``await record.done`` for its result."""
        return self._admit(tenant, req, call_target(service), lambda target: self._detached(
            tenant, req, self.gpu.call_spec(service, req), group=GROUP, kind="service",
            target=target,
        ))  # fmt: skip

    def _admit(
        self, tenant: str, req: Request, target: str, new: Callable[[str], ActionRecord]
    ) -> ActionRecord:
        """The action ``req``'s idempotency key already names, or a new one (``new``) once
        the scheduler takes work and the queue has room."""
        key = req.idempotency_key
        digest = None if key is None else request_digest(req)
        again = self._repeat(tenant, key, target, req, digest)
        if again is not None:
            return again
        self.s.admitting(tenant)
        rec = new(target)
        rec.digest = digest
        return rec

    def submit_batch(self, tenant: str, items: Sequence[BatchItem]) -> list[ActionRecord]:
        """Admit every item or none: an item refused withdraws the ones this call admitted
        before it (their keys too, so a retry runs them)."""
        self.s.admitting(tenant, extra=len(items))
        admitted: list[ActionRecord] = []
        fresh: list[ActionRecord] = []  # created here, not earlier actions found by key
        try:
            for item in items:
                before = len(self.s.actions)
                if item.exec is not None:
                    assert item.trajectory is not None
                    rec = self.submit_exec(tenant, item.trajectory, item.exec)
                elif item.score is not None:
                    assert item.service is not None
                    rec = self.submit_service(tenant, item.service, item.score)
                else:
                    assert item.api is not None
                    req = item.lease if item.lease is not None else item.call
                    assert req is not None
                    rec = self.lease_api(tenant, item.api, req)
                admitted.append(rec)
                if len(self.s.actions) > before:
                    fresh.append(rec)
        except EngineError:
            for rec in fresh:
                if rec.key is not None:  # first: a cancelled action's key would keep its answer
                    self.s.idempotent.forget(tenant, rec.key, rec)
                self.outcomes.cancel(tenant, rec.id)
            raise
        return admitted

    def _detached(
        self,
        tenant: str,
        req: ApiLeaseRequest | ApiCallRequest | ServiceCallRequest,
        spec: ActionSpec,
        *,
        group: str,
        kind: ActionKind,
        target: str,
    ) -> ActionRecord:
        """An action that belongs to no trajectory (API leases and calls, service calls):
        the core counts it under the tenant's holder, ``~group/tenant``."""
        holder = self.s.holder(tenant, group)
        return self._enter(tenant, req, spec, tid=None, holder=holder, kind=kind, argv=None,
                           target=target)  # fmt: skip

    def _enter(
        self,
        tenant: str,
        req: Request,
        spec: ActionSpec,
        *,
        tid: str | None,
        holder: str,
        kind: ActionKind,
        argv: list[str] | None,
        target: str,
    ) -> ActionRecord:
        """The one way into the queue: ``spec`` under the core's trajectory ``holder``
        (the action's own, or its tenant's holder of detached actions)."""
        s = self.s
        rec = s.record(tenant, tid, kind, req, argv, target=target)
        try:
            s.core.submit(rec.id, holder, spec, rec.submitted)
        except SchedulingError as e:
            raise EngineError("invalid", e.field, e.message) from None
        s.actions[rec.id] = rec
        if req.idempotency_key is not None:
            s.idempotent.remember(tenant, req.idempotency_key, rec)
        if req.queue_timeout_s is not None:
            rec.expiry = asyncio.get_running_loop().call_later(
                req.queue_timeout_s, self.outcomes.queue_timeout, rec
            )
        s.wake.set()
        return rec

    def _repeat(
        self, tenant: str, key: str | None, target: str, req: Request, digest: str | None
    ) -> ActionRecord | None:
        """The action an idempotency key already names; a key reused for another
        operation, target or request is a conflict, not a replay."""
        if key is None:
            return None
        again = self.s.idempotent.get(tenant, key)
        if again is None:
            return None
        if again.target != target:
            raise EngineError(
                "conflict", "idempotency_key", f"{key!r} was used for {again.target}, not {target}"
            )
        if again.digest is not None and again.digest != digest:
            first = again.request if isinstance(again, ActionRecord) else None
            if first is not None and request_digest(first) != again.digest:
                first = None  # an adopted run's stand-in: its request is not at hand
            raise EngineError(
                "conflict",
                "idempotency_key",
                f"{key!r} was used for {target} with another request{_differing(first, req)};"
                " a retry must send the same request, and another request a new key",
            )
        if isinstance(again, Remembered):
            return self._replay(tenant, again)
        return again

    def _replay(self, tenant: str, kept: Remembered) -> ActionRecord:
        """A stand-in for an ended keyed action: its answer, ready."""
        result = ActionResult.model_validate_json(kept.result)
        fut: asyncio.Future[ActionResult] = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return ActionRecord(
            kept.id,
            tenant,
            result.trajectory,
            result.kind,
            None,
            None,
            kept.target,
            self.s.clock(),
            fut,
            answer=kept.result,
            digest=kept.digest,
        )

    def _exec_spec(self, env: EnvConfig, req: ExecRequest) -> tuple[list[str] | None, ActionSpec]:
        cpu, t1, eff, argv = req.cpu, req.t1_s, req.efficiency, req.argv
        kind = req.type
        if req.profile is not None:
            prof = env.profiles.get(req.profile)
            if prof is None:
                known = ", ".join(sorted(env.profiles)) or "none"
                raise EngineError(
                    "invalid",
                    "profile",
                    f"{env.spec.name} has no profile {req.profile!r} (known: {known})",
                )
            argv = [*prof.command, *req.args]
            cpu = cpu if cpu is not None else prof.cpu
            t1 = t1 if t1 is not None else prof.t1_s
            eff = eff if eff is not None else prof.efficiency
            kind = kind or f"exec:{env.spec.name}/{req.profile}"
        cores = cpu if cpu is not None else env.cpu
        shape: tuple[Any, ...] = (cores, t1, eff, kind)
        try:
            spec = self._specs.get(shape)
        except TypeError:  # an unhashable part (an efficiency table): no caching
            shape, spec = (), None
        if spec is None:  # a handful of shapes recur: validate each once
            try:
                spec = ActionSpec(kind="exec", cpu=cores, t1_s=t1, efficiency=eff, type=kind)
            except ValidationError as e:
                raise EngineError("invalid", *_named(e)) from None
            if shape and len(self._specs) < MAX_SHAPES:
                self._specs[shape] = spec
        return argv, spec


def _named(e: ValidationError) -> tuple[str, str]:
    """(field, message) of an action's first problem: its location, else the field its
    model's check names first ("efficiency: given, but ..."), else ``cpu``."""
    err = e.errors(include_url=False)[0]
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["loc"]:
        return field_path(err["loc"]), message
    field, sep, rest = message.partition(": ")
    if sep and field.isidentifier():
        return field, rest
    return "cpu", message


def _differing(first: Request | None, again: Request) -> str:
    """' (argv, env differ)': the fields where a request differs from its key's first,
    where that one is still at hand (an action in flight); else nothing."""
    if first is None or type(first) is not type(again):
        return ""
    a, b = (
        first.model_dump(exclude={"idempotency_key"}),
        again.model_dump(exclude={"idempotency_key"}),
    )
    names = [name for name in a if a[name] != b.get(name)]
    return f" ({', '.join(names)} {'differs' if len(names) == 1 else 'differ'})" if names else ""
