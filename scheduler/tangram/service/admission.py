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
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tangram.api.action import ActionSpec
from tangram.api.field_errors import error_message, field_path
from tangram.api.wire import (
    ActionResult,
    ApiCallRequest,
    ApiLeaseRequest,
    BatchItem,
    ExecRequest,
    ServiceCallRequest,
    exec_server_problem,
)
from tangram.scheduler.core.scheduler import SchedulingError
from tangram.service.api_calls import ApiCalls
from tangram.service.config import EnvConfig
from tangram.service.gpu_calls import GROUP, GpuCalls, call_target
from tangram.service.keys import Remembered, exec_target, request_digest
from tangram.service.live import LiveExec
from tangram.service.outcomes import Outcomes
from tangram.service.records import (
    ActionKind,
    ActionRecord,
    EngineError,
    Request,
    TrajectoryRecord,
)
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
        return self._admit(tenant, self._exec_ask(tenant, tid, req, live), live)

    def lease_api(
        self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest
    ) -> ActionRecord:
        """Queue a lease of ``req.units`` of an API quota (the result carries the lease
        id), or a call the service makes for the caller once the quota admits it."""
        return self._admit(tenant, self._api_ask(tenant, api, req))

    def submit_service(self, tenant: str, service: str, req: ServiceCallRequest) -> ActionRecord:
        """Queue one call of a RewardService; ``await record.done`` for its result."""
        return self._admit(tenant, self._service_ask(tenant, service, req))

    def _admit(self, tenant: str, ask: _Ask, live: LiveExec | None = None) -> ActionRecord:
        """The action ``ask``'s idempotency key already names, or a new one (checked,
        then queued) once the scheduler takes work and the queue has room."""
        req = ask.req
        digest = ask.digest()
        again = self._repeat(tenant, req.idempotency_key, ask.target, req, digest)
        if again is not None:
            return again
        self.s.admitting(tenant)
        new = ask.check()
        rec = self._queue(tenant, new, ask.target)
        rec.digest = digest
        self._commit(tenant, rec, new, live)
        return rec

    def submit_batch(
        self, tenant: str, items: Sequence[BatchItem], numbers: Sequence[int] | None = None
    ) -> list[ActionRecord]:
        """Admit every item or none. Every item is checked (its key, trajectory, quota or
        service, its spec) before any is queued, and the queue's bound counts only the
        items that add an action: an item whose key is known gets that key's action (as a
        single request would), and items repeating a key within the batch share one. An
        item the core refuses withdraws the ones queued before it, unseen: nothing ended,
        nothing counted, no key kept. A refusal names its item: field ``actions.<n>.…``,
        ``n`` from ``numbers`` (the items' places in the request; default: in ``items``)."""
        plan: list[ActionRecord | int] = []  # per item: a known key's action, or a new one's
        new: list[_New] = []
        seen: dict[str, int] = {}  # a key new in this batch -> its action in ``new``
        for i, item in enumerate(items):
            ask = self._item(tenant, item)
            req, key, digest = ask.req, ask.req.idempotency_key, ask.digest()
            try:
                if key is not None and key in seen:
                    earlier = new[seen[key]]
                    was = (earlier.ask.target, earlier.digest)
                    _same(key, ask.target, req, digest, was=was, first=earlier.checked.request)
                    plan.append(seen[key])
                    continue
                again = self._repeat(tenant, key, ask.target, req, digest)
                if again is not None:
                    plan.append(again)
                    continue
                checked = ask.check()
            except EngineError as e:
                raise _of_item(e, _number(numbers, i), ask.what) from None
            if key is not None:
                seen[key] = len(new)
            plan.append(len(new))
            new.append(_New(ask, checked, digest, i))
        if new:
            self.s.admitting(tenant, extra=len(new))
        queued: list[ActionRecord] = []
        for n in new:
            try:
                queued.append(self._queue(tenant, n.checked, n.ask.target))
            except EngineError as e:
                for rec in queued:  # taken back before anyone saw them
                    self.s.core.cancel(rec.id)
                raise _of_item(e, _number(numbers, n.item), n.ask.what) from None
        for rec, n in zip(queued, new, strict=True):
            rec.digest = n.digest
            self._commit(tenant, rec, n.checked)
        return [queued[p] if isinstance(p, int) else p for p in plan]

    def _item(self, tenant: str, item: BatchItem) -> _Ask:
        """A batch item's request, as its own route would ask it."""
        if item.exec is not None:
            assert item.trajectory is not None
            return self._exec_ask(tenant, item.trajectory, item.exec)
        if item.score is not None:
            assert item.service is not None
            return self._service_ask(tenant, item.service, item.score)
        req = item.lease if item.lease is not None else item.call
        assert item.api is not None and req is not None
        return self._api_ask(tenant, item.api, req)

    def _exec_ask(
        self, tenant: str, tid: str, req: ExecRequest, live: LiveExec | None = None
    ) -> _Ask:
        return _Ask("exec", req, exec_target(tid), lambda: self._exec(tenant, tid, req, live))

    def _service_ask(self, tenant: str, service: str, req: ServiceCallRequest) -> _Ask:
        target = call_target(service)
        return _Ask("score", req, target, lambda: self._service(tenant, service, req))

    def _api_ask(self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest) -> _Ask:
        what = "lease" if isinstance(req, ApiLeaseRequest) else "call"
        return _Ask(what, req, f"{what} of {api}", lambda: self._api(tenant, api, req))

    def _exec(self, tenant: str, tid: str, req: ExecRequest, live: LiveExec | None) -> _Checked:
        traj = self.s.usable(tenant, tid)
        streamed = live is not None and live.output is not None
        interactive = live is not None and live.interactive
        if (refused := self.s.unservable(traj.node, req, streamed, interactive)) is not None:
            raise refused  # now, not once run
        argv, spec, timeout = self._exec_spec(self.s.env_of(traj), req)
        if argv is not None:  # (refused before it takes a core: it could never start)
            bad = exec_server_problem(argv, {**traj.env_vars, **req.env})
            if bad is not None:
                field = "args" if bad[0] == "argv" and req.profile is not None else bad[0]
                raise EngineError("invalid", field, bad[1])
        return _Checked(req, spec, traj.key, traj.key, "exec", argv, traj, *timeout)

    def _api(self, tenant: str, api: str, req: ApiLeaseRequest | ApiCallRequest) -> _Checked:
        return self._detached(tenant, req, self.api.spec(api, req), group="leases", kind="api")

    def _service(self, tenant: str, service: str, req: ServiceCallRequest) -> _Checked:
        spec = self.gpu.call_spec(service, req)
        return self._detached(tenant, req, spec, group=GROUP, kind="service")

    def _detached(
        self,
        tenant: str,
        req: ApiLeaseRequest | ApiCallRequest | ServiceCallRequest,
        spec: ActionSpec,
        *,
        group: str,
        kind: ActionKind,
    ) -> _Checked:
        """An action that belongs to no trajectory (API leases and calls, service calls):
        the core counts it under the tenant's holder, ``~group/tenant``."""
        return _Checked(req, spec, None, self.s.holder(tenant, group), kind, None, None)

    def _queue(self, tenant: str, new: _Checked, target: str) -> ActionRecord:
        """Into the core's queue: ``new``'s spec under its trajectory's holder (the
        action's own, or its tenant's holder of detached actions). Nothing else knows of
        it until :meth:`_commit` (a batch may take it back: ``core.cancel``)."""
        rec = self.s.record(tenant, new.tid, new.kind, new.req, new.argv, target=target)
        rec.timeout_s, rec.timeout_from = new.timeout_s, new.timeout_from
        try:
            self.s.core.submit(rec.id, new.holder, new.spec, rec.submitted)
        except SchedulingError as e:
            raise EngineError("invalid", e.field, e.message) from None
        return rec

    def _commit(
        self, tenant: str, rec: ActionRecord, new: _Checked, live: LiveExec | None = None
    ) -> None:
        """A queued action is in: it is known, its key remembered, its queue timeout set,
        its trajectory's count up, and a round is due."""
        s = self.s
        s.actions[rec.id] = rec
        req = new.req
        if req.idempotency_key is not None:
            s.idempotent.remember(tenant, req.idempotency_key, rec)
        if req.queue_timeout_s is not None:
            rec.expiry = asyncio.get_running_loop().call_later(
                req.queue_timeout_s, self.outcomes.queue_timeout, rec
            )
        if new.traj is not None:
            rec.live = live
            new.traj.actions += 1
            if req.idempotency_key is not None:
                new.traj.action_keys.add(req.idempotency_key)
        s.wake.set()

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

        def first() -> Request | None:
            request = again.request if isinstance(again, ActionRecord) else None
            if request is not None and request_digest(request) != again.digest:
                return None  # an adopted run's stand-in: its request is not at hand
            return request

        _same(key, target, req, digest, was=(again.target, again.digest), first=first)
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

    def _exec_spec(
        self, env: EnvConfig, req: ExecRequest
    ) -> tuple[list[str] | None, ActionSpec, tuple[float | None, str]]:
        """Its command, spec and time limit (with whose it is), its profile's where the
        request gives none, its environment's ``maxCommandSeconds`` where neither does."""
        cpu, t1, eff, argv, timeout = req.cpu, req.t1_s, req.efficiency, req.argv, req.timeout_s
        whose = "timeout_s"
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
            if timeout is None:
                timeout, whose = prof.timeout_s, f"profile {req.profile}'s timeoutSeconds"
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
        return argv, spec, _time_limit(env, timeout, whose)


def _time_limit(env: EnvConfig, seconds: float | None, whose: str) -> tuple[float | None, str]:
    """A command's time limit, ``seconds`` from ``whose`` (None: none given), and whose it
    is: its environment's ``maxCommandSeconds`` when that is shorter. A longer request
    is cut, not refused: clients send a default of their own (E2B's SDK, 60 s)."""
    most = env.max_command_s
    if most is None or (seconds is not None and seconds <= most):
        return seconds, whose if seconds is not None else ""
    owner = f"TrajectoryEnv {env.spec.name}'s maxCommandSeconds"
    return most, owner if seconds is None else f"{owner}; {whose} asked {seconds:g} s"


@dataclass(slots=True)
class _Checked:
    """An action checked as its route checks it, not queued yet: its request, its spec,
    its trajectory's key (None: detached), the core's trajectory that holds it, and its
    trajectory's record (exec)."""

    req: Request
    spec: ActionSpec
    tid: str | None
    holder: str
    kind: ActionKind
    argv: list[str] | None
    traj: TrajectoryRecord | None
    timeout_s: float | None = None  # an exec's (``_exec_spec``)
    timeout_from: str = ""  # whose limit it is

    def request(self) -> Request:
        return self.req


@dataclass(frozen=True, slots=True)
class _Ask:
    """A request to admit, as its route asks it: its name in a batch item (``exec``,
    ``score``, ``lease``, ``call``), the request, what its idempotency key is for, and
    its check (which makes the action, not queued yet)."""

    what: str
    req: Request
    target: str
    check: Callable[[], _Checked]

    def digest(self) -> str | None:
        """What a retry under its key must repeat; None without a key."""
        return None if self.req.idempotency_key is None else request_digest(self.req)


@dataclass(frozen=True, slots=True)
class _New:
    """A batch item that adds an action: its ask, the action checked, its request's
    digest and its place among the items."""

    ask: _Ask
    checked: _Checked
    digest: str | None
    item: int


def _same(
    key: str,
    target: str,
    req: Request,
    digest: str | None,
    *,
    was: tuple[str, str | None],
    first: Callable[[], Request | None],
) -> None:
    """Refuse a key reused for another operation, target or request: ``was``, the target
    and digest of the key's first request, and ``first()`` that request where at hand (to
    name the fields that differ)."""
    first_target, first_digest = was
    if first_target != target:
        raise EngineError(
            "conflict", "idempotency_key", f"{key!r} was used for {first_target}, not {target}"
        )
    if first_digest is not None and first_digest != digest:
        raise EngineError(
            "conflict",
            "idempotency_key",
            f"{key!r} was used for {target} with another request{_differing(first(), req)};"
            " a retry must send the same request, and another request a new key",
        )


ITEM_FIELDS = frozenset({"trajectory", "api", "service"})  # the item's own, not its request's


def _number(numbers: Sequence[int] | None, i: int) -> int:
    return numbers[i] if numbers is not None else i


def _of_item(e: EngineError, n: int, what: str) -> EngineError:
    """``e`` as the batch's refusal: its field under item ``n`` (``actions.3.api``, or
    ``actions.3.exec.profile`` for a field of the item's ``what`` request)."""
    field = e.field if e.field in ITEM_FIELDS else f"{what}.{e.field}"
    return EngineError(e.kind, f"actions.{n}.{field}", e.message)


def _named(e: ValidationError) -> tuple[str, str]:
    """(field, message) of an action's first problem: its location, else the field its
    model's check names first ("efficiency: given, but ..."), else ``cpu``."""
    err = e.errors(include_url=False)[0]
    said = error_message(err)
    if err["loc"]:
        return field_path(err["loc"]), said
    field, sep, rest = said.partition(": ")
    head, _, parts = field.partition(".")  # (a part may name a quota: ``quotas.web-x``)
    if sep and head.isidentifier() and (not parts or " " not in parts):
        return field, rest
    return "cpu", said


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
