"""What the operator does when a pool or one of its members changes (no kopf in here).

The kopf handlers (:mod:`tangram.operator.handlers`) only translate events into calls of
:class:`Reconciler`, and :class:`RetryError` into kopf's temporary errors. Everything
is level-based: each call reads the current objects, builds the desired children with the
pure builders and applies them, so a missed or repeated event is harmless.

- A pool: apply its children; push its documents (pool + members) to the running
  scheduler, which reconfigures without a restart; write the members' and its own status.
- A member (TrajectoryEnv, RewardService): write its status (Ready, or why not, with a
  Warning Event when that changes), then reconcile the pool it names.
- A deleted pool: the scheduler stops admitting trajectories; the finalizer holds the pool
  until the open ones are closed or ``spec.scheduler.drainSeconds`` passed; then the
  cluster-scoped RBAC goes and the garbage collector takes the rest (owner references).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import logging
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from tangram.api.documents import yaml_path
from tangram.api.resources import (
    ActionPool,
    ObjectKey,
    RewardService,
    TrajectoryEnv,
    resolve_pool_ref,
)
from tangram.api.status import (
    READY,
    Condition,
    MemberStatus,
    PoolStatus,
    parse_conditions,
    ready,
)
from tangram.api.wire import PoolFigures
from tangram.operator.builders import (
    AGENT_TENANT,
    OPERATOR_TENANT,
    SCHEDULER_TOKENS_KEY,
    Loopback,
    Manifest,
    build_pool,
    child_name,
    parse_tokens,
)
from tangram.operator.kube import Cluster, RefusedError
from tangram.operator.scheduler_link import (
    Endpoints,
    SchedulerError,
    SchedulerLink,
    SchedulerRefusedError,
)
from tangram.operator.status import (
    SANDBOXES_HEALTHY,
    PoolObservation,
    invalid_member_status,
    last_figures,
    member_status,
    pool_status,
)

log = logging.getLogger("tangram.operator")

Member = TrajectoryEnv | RewardService
MEMBER_KINDS: dict[str, type[TrajectoryEnv] | type[RewardService]] = {
    "TrajectoryEnv": TrajectoryEnv,
    "RewardService": RewardService,
}
DRAIN_POLL_S = 5.0
# The children that carry fields of the spec to the API server unchecked by the models.
_PASSED_THROUGH = ("Deployment", "DaemonSet")
# What only node agents need (builders.build_pool makes them with spec.cpu or spec.gpu).
_AGENT_GRANTS = (
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "agent"),
    ("rbac.authorization.k8s.io/v1", "Role", "agent"),
    ("networking.k8s.io/v1", "NetworkPolicy", "sandboxes"),
)
# The periodic refresh only reads the scheduler's figures and pushes what changed; this
# often it applies the pool's children again too, so that one deleted or edited by hand
# (a DaemonSet, the Service) comes back without waiting for a change of the spec.
FULL_PASS_S = 300.0


class RetryError(Exception):
    """Not done yet: call again after ``delay_s``."""

    def __init__(self, message: str, delay_s: float = DRAIN_POLL_S) -> None:
        super().__init__(message)
        self.delay_s = delay_s


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def validation_message(e: ValidationError, body: dict[str, Any]) -> str:
    """The first problems of a spec, in YAML spelling (``spec.apis[0].rate: ...``)."""
    parts = [f"{yaml_path(err['loc'], body)}: {err['msg']}" for err in e.errors()[:5]]
    return "; ".join(parts)


class Reconciler:
    def __init__(
        self,
        cluster: Cluster,
        *,
        image: str,
        gpu_image: str | None = None,
        loopback: Loopback | None = None,
        endpoints: Endpoints | None = None,
        link: SchedulerLink | None = None,
        clock: Callable[[], dt.datetime] = _utcnow,
    ) -> None:
        self.cluster = cluster
        self.image = image
        self.gpu_image = gpu_image  # GPU agents' image (with PyTorch); None: ``image``
        self.loopback = loopback  # a single-node test cluster's host network
        self.endpoints = endpoints or Endpoints(loopback=loopback is not None)
        self.link = link or SchedulerLink()
        self.clock = clock
        # pool uid -> (scheduler epoch, digest of the documents it was last given): a
        # restarted scheduler (new epoch) or changed documents get a push, nothing else.
        self._pushed: dict[str, tuple[str, str]] = {}
        # pool uid -> (documents, operator token) of its last full pass: what the periodic
        # refresh pushes, without reading the ConfigMap and the Secret back every 10 s.
        self._built: dict[str, tuple[str, str]] = {}
        self._full_at: dict[str, dt.datetime] = {}  # pool uid -> its last full pass
        self._valid: dict[str, ActionPool] = {}  # pool uid -> its last valid spec (to drain)
        # pool uid -> (generation, why) of a spec whose children the API server refused
        self._rejected: dict[str, tuple[int, str]] = {}
        self._written: dict[str, dict[str, Any]] = {}  # pool uid -> the status it last wrote
        # Ticks order member events against pool passes (``_pool_pass_since``).
        self._ticks = itertools.count()
        # pool -> the tick at which its last pass that ran to its end began
        self._pass_done: dict[ObjectKey, int] = {}
        # pool uid -> why its scheduler refused the documents last pushed (said once).
        self._refused: dict[str, str] = {}
        # One pass at a time per pool (kopf runs handlers of different objects in threads);
        # a lock lives while a pass holds it, so poolRefs to no pool leave nothing behind.
        self._locks: weakref.WeakValueDictionary[ObjectKey, threading.RLock] = (
            weakref.WeakValueDictionary()
        )
        self._locks_guard = threading.Lock()

    def _lock(self, key: ObjectKey) -> threading.RLock:
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.RLock()
            return lock

    # ---- pools -----------------------------------------------------------------------
    def reconcile_pool(self, namespace: str, name: str) -> bool:
        """Children, config push, member statuses and pool status of one pool; False when
        there is no pool to answer for its members (gone or being deleted). An invalid
        pool's status says why, and its members' status that it is invalid."""
        with self._lock((namespace, name)):
            begun = next(self._ticks)
            live = self._live_pool(namespace, name)
            if live is None:
                self._pass_done.pop((namespace, name), None)
                return False
            body, pool = live
            if isinstance(pool, str):
                self._member_statuses((namespace, name), None, pool_invalid=pool)
                self._pass_done[namespace, name] = begun
                return True
            members = self._member_statuses(pool.key, pool)
            tokens = self._tokens(pool)
            objects = build_pool(
                pool,
                image=self.image,
                gpu_image=self.gpu_image,
                loopback=self.loopback,
                envs=[m for m in members if isinstance(m, TrajectoryEnv)],
                services=[m for m in members if isinstance(m, RewardService)],
                uid=body["metadata"]["uid"],
                agent_token=tokens[AGENT_TENANT],
                operator_token=tokens[OPERATOR_TENANT],
            )
            uid = body["metadata"]["uid"]
            try:
                # The workloads carry what the user's spec passes through to the API
                # server (resources, nodeSelector): tried first, so that a refusal leaves
                # every child, the ConfigMap of definitions too, as the spec before made it.
                for manifest in objects:
                    if manifest["kind"] in _PASSED_THROUGH:
                        self.cluster.apply(manifest, dry_run=True)
                for manifest in objects:
                    self.cluster.apply(manifest)
            except RefusedError as e:
                why = f"the API server refused the spec's {e}"
                self._rejected[uid] = (body["metadata"].get("generation", 0), why)
                self._full_at[uid] = self.clock()
                before, valid = self._built.get(uid), self._valid.get(uid)
                if before is not None and valid is not None:
                    self._refresh(self._serving(uid, pool), body, *before)
                else:
                    self._invalid(body, why)
                self._pass_done[namespace, name] = begun
                return True
            self._rejected.pop(uid, None)
            self._valid[uid] = pool
            self._remove_dropped_agents(pool)
            built = self._built[uid] = (_documents(objects), tokens[OPERATOR_TENANT])
            self._full_at[uid] = self.clock()
            self._refresh(pool, body, *built)
            self._pass_done[namespace, name] = begun
            return True

    def refresh_pool(self, namespace: str, name: str, body: dict[str, Any] | None = None) -> None:
        """The periodic pass: status from the scheduler, and a push if it missed one.
        ``body``: the pool as the caller just read it (kopf's timer)."""
        with self._lock((namespace, name)):
            if body is not None:
                written = self._written.get(body["metadata"].get("uid", ""))
                if written is not None and body.get("status") != written:
                    body = None  # read before a pass wrote its status (the lock): read anew
            live = self._live_pool(namespace, name, body)
            if live is None:
                return
            body, pool = live
            if isinstance(pool, str):  # invalid: its status says why
                return
            uid = body["metadata"]["uid"]
            built, full_at = self._built.get(uid), self._full_at.get(uid)
            # No full pass in this process yet, or none for a while: do it whole.
            if full_at is None or (self.clock() - full_at).total_seconds() >= FULL_PASS_S:
                self.reconcile_pool(namespace, name)  # the lock is reentrant
                return
            if built is not None:  # (None: its children were refused; the status says so)
                self._refresh(self._serving(uid, pool), body, *built)

    def _live_pool(
        self, namespace: str, name: str, body: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], ActionPool | str] | None:
        """The pool's object and model (or why it is invalid, which its status now says),
        unless it is gone or being deleted."""
        if body is None:
            body = self.cluster.get_custom("ActionPool", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        return body, self._parse_pool(body)

    def _parse_pool(self, body: dict[str, Any]) -> ActionPool | str:
        """The pool model, or why its spec is invalid after writing that into its status."""
        try:
            return ActionPool.model_validate(body)
        except ValidationError as e:
            message = validation_message(e, body)
            self._invalid(body, message)
            return message

    def _invalid(self, body: dict[str, Any], message: str) -> None:
        """Write that the pool's spec is invalid, for ``message``."""
        meta = body["metadata"]
        shown = body.get("status") or {}
        previous = parse_conditions(shown.get("conditions"))
        seen = PoolObservation(
            generation=meta.get("generation", 0),
            previous=previous,
            # A spec edited invalid leaves its scheduler running the one before: what the
            # status showed of it stays until the spec is fixed.
            endpoint=str(shown.get("endpoint") or ""),
            last=last_figures(shown),
            invalid=message,
        )
        self._write_status(body, pool_status(None, seen, rfc3339(self.clock())), previous)

    def _member_statuses(
        self, key: ObjectKey, pool: ActionPool | None, pool_invalid: str | None = None
    ) -> list[Member]:
        """Write the status of every member naming the pool ``key`` (``pool`` None: there
        is none, or it is invalid for ``pool_invalid``); the members it can serve (the
        others' status says why they are left out of its config)."""
        usable: list[Member] = []
        for kind in MEMBER_KINDS:
            for body in self.cluster.list_custom(kind):
                if self._member_pool_key(body) != key:
                    continue
                member = self._member_status(kind, body, pool, pool_invalid)
                if member is not None:
                    usable.append(member)
        return usable

    def _live_tokens(self, pool: ActionPool) -> dict[str, str]:
        """tenant -> token in the pool's live tokens Secret (empty before the first pass)."""
        live = self.cluster.secret_data(pool.metadata.namespace, child_name(pool, "tokens")) or {}
        return parse_tokens(live.get(SCHEDULER_TOKENS_KEY, ""))

    def _tokens(self, pool: ActionPool) -> dict[str, str]:
        """The agent and operator tokens: the live Secret's, else new ones."""
        tokens = self._live_tokens(pool)
        for tenant in (AGENT_TENANT, OPERATOR_TENANT):
            tokens.setdefault(tenant, secrets.token_urlsafe(32))
        return tokens

    def _remove_dropped_agents(self, pool: ActionPool) -> None:
        ns = pool.metadata.namespace
        for role, section in (("cpu", pool.spec.cpu), ("gpu", pool.spec.gpu)):
            if section is None:
                name = child_name(pool, f"{role}-agent")
                if self.cluster.delete("apps/v1", "DaemonSet", ns, name):
                    log.info("removed DaemonSet %s (no spec.%s)", name, role)
        if pool.spec.cpu is None and pool.spec.gpu is None:  # no agents: nor their grants
            for api, kind, suffix in _AGENT_GRANTS:
                if self.cluster.delete(api, kind, ns, child_name(pool, suffix)):
                    log.info("removed %s %s (no node agents)", kind, child_name(pool, suffix))

    def _refresh(self, pool: ActionPool, body: dict[str, Any], documents: str, token: str) -> None:
        meta = body["metadata"]
        base = self.endpoints.url(pool)
        figures, unreachable, refused = None, None, None
        try:
            figures = self.link.figures(base, token)
            taken, refused = self._push(pool, meta["uid"], figures, documents, base=base,
                                        token=token)  # fmt: skip
            if taken:  # the figures of what it runs now (new quotas, say)
                figures = self.link.figures(base, token)
        except SchedulerError as e:
            unreachable = str(e)
        previous = parse_conditions((body.get("status") or {}).get("conditions"))
        generation = meta.get("generation", 0)
        rejected = self._rejected.get(meta["uid"])
        seen = PoolObservation(
            generation=generation,
            previous=previous,
            invalid=rejected[1] if rejected is not None and rejected[0] == generation else None,
            endpoint=self.endpoints.cluster_url(pool),
            scheduler_available=self._scheduler_available(pool),
            figures=figures,
            unreachable=unreachable,
            last=last_figures(body.get("status")),
            refused=refused,
        )
        self._write_status(body, pool_status(pool, seen, rfc3339(self.clock())), previous)

    def _push(
        self,
        pool: ActionPool,
        uid: str,
        figures: PoolFigures,
        documents: str,
        *,
        base: str,
        token: str,
    ) -> tuple[bool, str | None]:
        """Push the documents unless this scheduler run has them: whether it took them
        now, and why it refused them (it keeps running the ones before). Refused ones are
        pushed again on each pass: what was wrong may be outside the spec (a Secret not
        created yet)."""
        digest = hashlib.sha256(documents.encode())
        # The scheduler reads its API credentials when it loads the documents, which only
        # name their Secrets: a changed Secret is a change to push.
        for version in self._credential_versions(pool):
            digest.update(f"\0{version}".encode())
        given = (figures.epoch, digest.hexdigest())
        if self._pushed.get(uid) == given:
            return False, None
        try:
            changes = self.link.reload(base, token, documents)
        except SchedulerRefusedError as e:
            if self._refused.get(uid) != str(e):
                log.warning("pool %s/%s: the scheduler refused its config: %s",
                            pool.metadata.namespace, pool.metadata.name, e)  # fmt: skip
            self._refused[uid] = str(e)
            return False, str(e)
        self._pushed[uid] = given
        self._refused.pop(uid, None)
        log.info("pushed config to %s: %s", base, "; ".join(changes) or "no changes")
        return True, None

    def _credential_versions(self, pool: ActionPool) -> list[str]:
        """The resourceVersion of each Secret the pool's API quotas name ("-": none)."""
        versions = []
        for quota in pool.spec.apis:
            if quota.secret_ref is None:
                continue
            secret = self.cluster.get("v1", "Secret", pool.metadata.namespace,
                                      quota.secret_ref.name)  # fmt: skip
            meta = (secret or {}).get("metadata") or {}
            versions.append(f"{quota.secret_ref.name}={meta.get('resourceVersion', '-')}")
        return versions

    def _scheduler_available(self, pool: ActionPool) -> bool:
        deployment = self.cluster.get(
            "apps/v1", "Deployment", pool.metadata.namespace, child_name(pool, "scheduler")
        )
        status = (deployment or {}).get("status") or {}
        return int(status.get("availableReplicas") or 0) >= 1

    # ---- deletion --------------------------------------------------------------------
    def drain_pool(self, body: dict[str, Any]) -> None:
        """The finalizer's work; :class:`RetryError` while trajectories may still finish."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        with self._lock((namespace, name)):
            pool = self._drainable(body)
            if pool is not None:
                self._drain(pool, body)
            deleted = self.cluster.delete_cluster_children(namespace, name)
            self._member_statuses((namespace, name), None)  # they now name no pool
            log.info("pool %s/%s removed; also %s", namespace, name, ", ".join(deleted) or "-")
            memos = (self._pushed, self._built, self._full_at, self._refused, self._valid,
                     self._written, self._rejected)  # fmt: skip
            for memo in memos:
                memo.pop(meta.get("uid", ""), None)

    def _serving(self, uid: str, pool: ActionPool) -> ActionPool:
        """The spec the pool's scheduler runs: the last valid one while the API server
        refuses the children of ``pool`` (they are as that one made them)."""
        return self._valid.get(uid, pool) if uid in self._rejected else pool

    def _drainable(self, body: dict[str, Any]) -> ActionPool | None:
        """The pool whose scheduler to drain. A spec edited invalid, or whose children the
        API server refused, leaves its scheduler running the one before: then the last
        valid spec this operator saw, or, after an operator restart, the body with only
        its scheduler's port and drain time (defaults where those are what is invalid)."""
        uid = body["metadata"].get("uid", "")
        try:
            return self._serving(uid, ActionPool.model_validate(body))
        except ValidationError:
            pass
        last = self._valid.get(uid)
        if last is not None:
            return last
        raw = (body.get("spec") or {}).get("scheduler") or {}
        kept = {k: raw[k] for k in ("port", "drainSeconds") if isinstance(raw, dict) and k in raw}
        for scheduler in (kept, {}):
            try:
                return ActionPool.model_validate(
                    {**body, "spec": {"cpu": {}, "scheduler": scheduler}}
                )
            except ValidationError:
                continue
        return None  # its name itself is invalid: the API server made no children of it

    def _drain(self, pool: ActionPool, body: dict[str, Any]) -> None:
        token = self._live_tokens(pool).get(OPERATOR_TENANT)
        if token is None:
            return
        since = body["metadata"].get("deletionTimestamp") or rfc3339(self.clock())
        started = dt.datetime.fromisoformat(since.replace("Z", "+00:00"))
        left = pool.spec.scheduler.drain_seconds - (self.clock() - started).total_seconds()
        last = last_figures(body.get("status"))
        figures, unreachable = None, None
        try:
            figures = self.link.drain(self.endpoints.url(pool), token)
        except SchedulerError as e:
            # A scheduler restarting (its pod rescheduled, a timeout) comes back with the
            # trajectories its agents hold: wait for it within the drain time if it last
            # said some were open. One that never ran, or had none, has nothing to drain.
            unreachable = str(e)
            if not last.get("trajectories"):
                log.info("pool %s: no scheduler to drain (%s)", pool.metadata.name, e)
                return
        if left <= 0 or (figures is not None and figures.trajectories == 0):
            if figures is None:
                log.warning("pool %s: its scheduler did not answer within drainSeconds (%s); "
                            "removing it", pool.metadata.name, unreachable)  # fmt: skip
            return
        previous = parse_conditions((body.get("status") or {}).get("conditions"))
        seen = PoolObservation(
            generation=body["metadata"].get("generation", 0),
            previous=previous,
            endpoint=self.endpoints.cluster_url(pool),
            scheduler_available=figures is not None,
            figures=figures,
            unreachable=unreachable,
            last=last,
            deleting=True,
            drain_left_s=left,
        )
        self._write_status(body, pool_status(pool, seen, rfc3339(self.clock())), previous)
        what = f"{figures.trajectories} trajectories open" if figures else unreachable
        raise RetryError(f"{what}; {left:.0f} s left")

    # ---- members ---------------------------------------------------------------------
    def reconcile_member(self, kind: str, namespace: str, name: str) -> None:
        seen = next(self._ticks)  # before the member is read
        body = self.cluster.get_custom(kind, namespace, name)
        if body is None:
            return
        pool_key = self._member_pool_key(body)
        # The pool's pass writes this member's status along with the others'.
        if pool_key is None or not self._pool_pass_since(pool_key, seen):
            self._member_status(kind, body, None)

    def member_deleted(self, body: dict[str, Any]) -> None:
        """Take a deleted member out of its pool's config."""
        seen = next(self._ticks)
        pool_key = self._member_pool_key(body)
        if pool_key is not None:
            self._pool_pass_since(pool_key, seen)

    def _pool_pass_since(self, key: ObjectKey, seen: int) -> bool:
        """A pass of pool ``key`` that began after tick ``seen``: this call's, unless one
        began since and ran to its end (it listed the members as they are now). On an
        operator's start, or ``kubectl apply -f envs/``, each of M members' events would
        run a pass of its own (two lists of every member, a dozen applies); they share
        one. False when there is no pool to answer for its members."""
        with self._lock(key):
            begun = self._pass_done.get(key)  # (a pass that failed midway is not done)
            if begun is not None and begun > seen:
                return True
            return self.reconcile_pool(*key)

    @staticmethod
    def _member_pool_key(body: dict[str, Any]) -> ObjectKey | None:
        ref = (body.get("spec") or {}).get("poolRef")
        namespace = body.get("metadata", {}).get("namespace", "")
        return resolve_pool_ref(ref, namespace) if isinstance(ref, str) and ref else None

    def _member_status(
        self,
        kind: str,
        body: dict[str, Any],
        pool: ActionPool | None,
        pool_invalid: str | None = None,
    ) -> Member | None:
        """Write the member's status; the member when its pool can serve it."""
        meta = body["metadata"]
        previous = parse_conditions((body.get("status") or {}).get("conditions"))
        now = rfc3339(self.clock())
        member: Member | None = None
        try:
            member = MEMBER_KINDS[kind].model_validate(body)
        except ValidationError as e:
            ref = str((body.get("spec") or {}).get("poolRef", ""))
            status = invalid_member_status(
                meta.get("generation", 0), ref, previous, validation_message(e, body), now
            )
        else:
            status = member_status(member, pool, previous, now, pool_invalid)
        self._write_status(body, status, previous)
        cond = ready(status.conditions)
        return member if cond is not None and cond.status == "True" else None

    # ---- status ----------------------------------------------------------------------
    def _write_status(
        self,
        body: dict[str, Any],
        status: PoolStatus | MemberStatus,
        previous: list[Any],
    ) -> None:
        """Patch the status when it changed, and post an Event for each condition that
        changed (not on every pass): Ready when its status or reason changes;
        SandboxesHealthy also when its message does, which counts each new failure."""
        new = status.model_dump(by_alias=True, mode="json")
        if (body.get("status") or {}) == new:
            return
        meta = body["metadata"]
        self.cluster.patch_status(body["kind"], meta["namespace"], meta["name"], new)
        if body["kind"] == "ActionPool":  # (what the timer's refresh compares against)
            self._written[meta.get("uid", "")] = new
        before = {c.type: c for c in previous}
        for cond in status.conditions:
            news = _NEWS.get(cond.type)
            old = before.get(cond.type)
            if news is None or (old is not None and news(old) == news(cond)):
                continue
            if old is None and cond.type != READY and cond.status == "True":
                continue  # a first "all is well" is no news
            type_ = "Normal" if cond.status == "True" else "Warning"
            self.cluster.event(body, type_, cond.reason, cond.message, self.clock())


# Conditions that post Events, by what of them is news when it changes.
_NEWS: dict[str, Callable[[Condition], tuple[str, ...]]] = {
    READY: lambda c: (c.status, c.reason),
    SANDBOXES_HEALTHY: lambda c: (c.status, c.reason, c.message),
}


def _documents(objects: list[Manifest]) -> str:
    # The pool's config ConfigMap, by what it holds (the learned-state one holds no data).
    text: str = next(o["data"]["pool.yaml"] for o in objects if "pool.yaml" in o.get("data", {}))
    return text


__all__ = ["MEMBER_KINDS", "READY", "Reconciler", "RetryError"]
