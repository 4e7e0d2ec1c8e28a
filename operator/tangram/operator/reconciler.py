"""What the operator does when a pool or one of its members changes (no kopf in here).

The kopf handlers (:mod:`tangram.operator.handlers`) only translate events into calls of
:class:`Reconciler`, and :class:`RetryError` into kopf's temporary errors. Everything
is level-based: each call reads the current objects, builds the desired children with the
pure builders and applies them, so a missed or repeated event is harmless.

- A pool: apply its children; push its documents (pool + members) to the running
  scheduler, which reconfigures without a restart; write the members' and its own status.
- A member (TrajectoryEnv, RewardService): write its status (Ready, or why not, with a
  Warning Event when that changes), then reconcile the pool it names.
- Each periodic refresh also deletes the pool's sandbox pods on nodes that have had no
  agent of the pool for ``agentGraceSeconds`` (:mod:`tangram.operator.orphans`).
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
from typing import Any, NamedTuple

from pydantic import ValidationError

from tangram.api.documents import problem
from tangram.api.reasons import Reason
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
from tangram.api.wire import PoolFigures, ProblemFigure
from tangram.operator.builders import (
    AGENT_TENANT,
    OPERATOR_TENANT,
    SCHEDULER_TOKENS_KEY,
    Loopback,
    Manifest,
    build_pool,
    child_name,
    cpu_agent_pods_selector,
    parse_tokens,
    sandbox_pods_selector,
)
from tangram.operator.kube import ApiServerError, Cluster, DeniedError, RefusedError
from tangram.operator.orphans import agent_nodes, sandbox_nodes, sweep
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
# What the API server's NamespaceLifecycle admission says of a namespace being deleted.
_NAMESPACE_ENDING = "because it is being terminated"

Member = TrajectoryEnv | RewardService
MEMBER_KINDS: dict[str, type[TrajectoryEnv] | type[RewardService]] = {
    "TrajectoryEnv": TrajectoryEnv,
    "RewardService": RewardService,
}
DRAIN_POLL_S = 5.0
FOREGROUND = "foregroundDeletion"  # the finalizer of a foreground deletion
DRAIN_SKIPPED = "DrainSkipped"  # the Event of a drain a foreground deletion cut short
# The Event of sandbox pods deleted on a node no agent of their pool runs on any more.
ORPHANS_DELETED = "OrphanedSandboxesDeleted"
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
# A pass whose apply the API server failed (5xx, no answer) is tried again this soon.
APPLY_RETRY_S = 15.0
# A member of a pool: its kind, its object as last read, its model.
MemberSeen = tuple[str, dict[str, Any], Member]
# What identifies a member's definition in the documents pushed: kind, ns, name, generation.
MemberKey = tuple[str, str, str, int]


class _Build:
    """The documents of a pool's last full pass: what the periodic refresh pushes, without
    reading the ConfigMap and the Secret back every 10 s."""

    def __init__(self, documents: str, token: str, generation: int,
                 members: frozenset[MemberKey]) -> None:  # fmt: skip
        self.documents, self.token = documents, token
        self.generation = generation  # the pool's, whose spec made them
        self.members = members  # the members they define


class _Rejected(NamedTuple):
    """A spec whose children the API server refused as invalid (422) or denied (400,
    403: ``denied``)."""

    generation: int
    why: str
    denied: bool


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
    parts = [problem(err, body) for err in e.errors()[:5]]
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
        # pool uid -> the documents of its last full pass whose children were applied
        self._built: dict[str, _Build] = {}
        # pool uid -> the members its scheduler was last given, and the members of its last
        # pass that it can serve (their statuses say whether it does: ``_members_served``)
        self._served: dict[str, frozenset[MemberKey]] = {}
        self._members: dict[str, list[MemberSeen]] = {}
        self._full_at: dict[str, dt.datetime] = {}  # pool uid -> its last full pass
        self._valid: dict[str, ActionPool] = {}  # pool uid -> its last valid spec (to drain)
        self._rejected: dict[str, _Rejected] = {}  # pool uid -> its spec refused, if it is
        self._written: dict[str, dict[str, Any]] = {}  # pool uid -> the status it last wrote
        # pool uid -> node -> since when it has had sandboxes of the pool and no agent
        self._orphans: dict[str, dict[str, dt.datetime]] = {}
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
            served = self._served.get(body["metadata"]["uid"], frozenset())
            seen = self._member_statuses(pool.key, pool, served=served)
            members = [m for _, _, m in seen]
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
            generation = body["metadata"].get("generation", 0)
            self._members[uid] = seen
            try:
                # The workloads carry what the user's spec passes through to the API
                # server (resources, nodeSelector): tried first, so that a refusal leaves
                # every child, the ConfigMap of definitions too, as the spec before made it.
                for manifest in objects:
                    if manifest["kind"] in _PASSED_THROUGH:
                        self.cluster.apply(manifest, dry_run=True)
                for manifest in objects:
                    self.cluster.apply(manifest)
            except (RefusedError, DeniedError) as e:
                if isinstance(e, DeniedError) and _NAMESPACE_ENDING in str(e):
                    # The namespace is being deleted, the pool with it (its drain says so):
                    # not a denial of the spec's to show as the pool's state.
                    log.info("pool %s/%s: its namespace is being deleted; nothing applied",
                             namespace, name)  # fmt: skip
                    self._pass_done[namespace, name] = begun
                    return True
                # Not retried before the spec changes or the next full pass: what a denial
                # needs (a webhook's policy, a ResourceQuota) is outside the spec.
                denied = isinstance(e, DeniedError)
                why = str(e) if denied else f"the API server refused the spec's {e}"
                self._rejected[uid] = _Rejected(generation, why, denied)
                self._full_at[uid] = self.clock()
                self._unapplied(uid, pool, body)
                self._pass_done[namespace, name] = begun
                return True
            except ApiServerError as e:  # (kopf's retry; the timer's full pass too)
                self._rejected.pop(uid, None)
                self._unapplied(uid, pool, body, failed=str(e))
                raise RetryError(f"applying the spec failed: {e}", APPLY_RETRY_S) from None
            self._rejected.pop(uid, None)
            self._valid[uid] = pool
            self._remove_dropped_agents(pool)
            built = self._built[uid] = _Build(
                _documents(objects), tokens[OPERATOR_TENANT], generation,
                frozenset(_member_key(kind, b) for kind, b, _ in seen),
            )  # fmt: skip
            self._full_at[uid] = self.clock()
            self._refresh(pool, body, built)
            self._pass_done[namespace, name] = begun
            return True

    def _unapplied(
        self, uid: str, pool: ActionPool, body: dict[str, Any], failed: str | None = None
    ) -> None:
        """The status of a pass whose children the API server did not take (refused or
        denied: ``_rejected``; ``failed``: it failed): the scheduler runs on with what the
        spec before made, if one did; status.observedGeneration stays that spec's, except
        for a spec refused as invalid (judged, if not applied)."""
        before, valid = self._built.get(uid), self._valid.get(uid)
        if before is not None and valid is not None:
            self._refresh(valid, body, before, failed=failed)
            return
        rejected = self._rejected.get(uid)
        if rejected is not None and not rejected.denied:
            self._invalid(body, rejected.why)
        else:
            denied = rejected.why if rejected is not None else None
            self._invalid(body, None, pool=pool, denied=denied, failed=failed)
        self._members_served(uid, pool, _not_applied(rejected, failed))

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
            generation = body["metadata"].get("generation", 0)
            rejected = self._rejected.get(uid)
            # A spec whose pass did not get through (the API server failed it): not
            # claimed with the documents of the spec before, but tried again whole.
            unhandled = (built is None or built.generation != generation) and (
                rejected is None or rejected.generation != generation
            )
            serving = self._serving(uid, pool)
            # No full pass in this process yet, or none for a while: do it whole.
            try:
                if (
                    full_at is None
                    or unhandled
                    or (self.clock() - full_at).total_seconds() >= FULL_PASS_S
                ):
                    self.reconcile_pool(namespace, name)  # the lock is reentrant
                elif built is not None:  # (None: its children were refused; status says so)
                    self._refresh(serving, body, built)
            finally:  # (also when a pass failed: a pool whose applies fail still sweeps)
                self._sweep_orphans(serving, body)

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

    def _invalid(
        self,
        body: dict[str, Any],
        message: str | None,
        *,
        pool: ActionPool | None = None,
        denied: str | None = None,
        failed: str | None = None,
    ) -> None:
        """Write that the pool's spec is invalid, for ``message``; or (``message`` None)
        that the API server denied or failed the children of ``pool``, which has none yet."""
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
            denied=denied,
            apply_failed=failed,
            applied_generation=None if message else int(shown.get("observedGeneration") or 0),
        )
        self._write_status(body, pool_status(pool, seen, rfc3339(self.clock())), previous)

    def _member_statuses(
        self,
        key: ObjectKey,
        pool: ActionPool | None,
        pool_invalid: str | None = None,
        *,
        served: frozenset[MemberKey] = frozenset(),
    ) -> list[MemberSeen]:
        """The members naming the pool ``key`` that it can serve (``pool`` None: there is
        none, or it is invalid for ``pool_invalid``). The others' status is written here,
        saying why they are left out of its config; theirs once the push is done
        (``_members_served``)."""
        usable: list[MemberSeen] = []
        for kind in MEMBER_KINDS:
            for body in self.cluster.list_custom(kind):
                if self._member_pool_key(body) != key:
                    continue
                member = self._member_status(kind, body, pool, pool_invalid, write=False)
                if member is not None:
                    usable.append((kind, body, member))
        return self._one_per_name(key, pool, usable, served)

    def _one_per_name(
        self,
        key: ObjectKey,
        pool: ActionPool | None,
        usable: list[MemberSeen],
        served: frozenset[MemberKey],
    ) -> list[MemberSeen]:
        """Clients name a pool's environments and services by name alone: of members of
        one kind and name (from namespaces the pool admits), the one its scheduler serves
        keeps it (``served``: its last push), else the one in the pool's own namespace,
        else the oldest; the others are told so and left out, so that a newcomer in
        another namespace refuses no one's config but its own, and takes no one's name."""
        by_name: dict[tuple[str, str], list[MemberSeen]] = {}
        for seen in usable:
            by_name.setdefault((seen[0], seen[2].metadata.name), []).append(seen)
        kept: list[MemberSeen] = []
        for (kind, name), same in by_name.items():
            same.sort(key=lambda s: (_member_key(s[0], s[1]) not in served,
                                     s[2].metadata.namespace != key[0],
                                     s[1]["metadata"].get("creationTimestamp") or "",
                                     s[2].metadata.namespace))  # fmt: skip
            kept.append(same[0])
            holder = f"{kind} {same[0][2].metadata.namespace}/{name}"
            for _, body, member in same[1:]:
                previous = parse_conditions((body.get("status") or {}).get("conditions"))
                why = (Reason.NAME_TAKEN, f"{holder} serves the name {name!r} in ActionPool "
                       f"{key[0]}/{key[1]}, whose clients name its {kind}s by name alone (the "
                       "one served keeps it; else the one in the pool's namespace, else the "
                       "oldest): rename this one")  # fmt: skip
                status = member_status(member, pool, previous, rfc3339(self.clock()),
                                       not_served=why)  # fmt: skip
                self._write_status(body, status, previous)
        return kept

    def _members_served(
        self,
        uid: str,
        pool: ActionPool,
        not_served: str | None,
        problems: list[ProblemFigure] | None = None,
    ) -> None:
        """Write the status of the pool's members its pass can serve: Accepted when the
        scheduler took the definitions that include them, else why not (``not_served``:
        why it has not the current ones; a refusal of the scheduler's own is named as
        such); a TrajectoryEnv's recent sandbox failures from ``problems`` (the
        scheduler's). Written only when it changes (``_write_status``)."""
        served = self._served.get(uid, frozenset())
        refused = self._refused.get(uid)
        ns, name = pool.key
        now = rfc3339(self.clock())
        for kind, body, member in self._members.get(uid, []):
            why: tuple[str, str] | None = None
            if _member_key(kind, body) not in served:
                scheduler = f"the scheduler of ActionPool {ns}/{name}"
                if refused is not None:
                    why = (Reason.POOL_CONFIG_REFUSED,
                           f"{scheduler} refused the current definitions: {refused}")  # fmt: skip
                else:
                    why = (Reason.NOT_SERVED, f"not given to {scheduler} yet: "
                           f"{not_served or 'it has not answered yet'}")  # fmt: skip
            previous = parse_conditions((body.get("status") or {}).get("conditions"))
            status = member_status(member, pool, previous, now, not_served=why,
                                   problems=problems)  # fmt: skip
            body["status"] = self._write_status(body, status, previous)  # (ours: a copy)

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

    def _refresh(
        self, pool: ActionPool, body: dict[str, Any], built: _Build, failed: str | None = None
    ) -> None:
        """Figures, a push if the scheduler misses ``built``, the pool's status and its
        members'. ``failed``: the API server failed this pass's apply (the spec before
        runs on)."""
        meta = body["metadata"]
        uid, token = meta["uid"], built.token
        base = self.endpoints.url(pool)
        figures, unreachable, push = None, None, _Pushed()
        try:
            figures = self.link.figures(base, token)
            push = self._push(pool, uid, figures, built, base=base)
            if push.changed:  # the figures of what it runs now (new quotas, say)
                figures = self.link.figures(base, token)
        except SchedulerError as e:
            unreachable = str(e)
        previous = parse_conditions((body.get("status") or {}).get("conditions"))
        generation = meta.get("generation", 0)
        rejected = self._rejected.get(uid)
        if rejected is not None and rejected.generation != generation:
            rejected = None
        unapplied = failed is not None or (rejected is not None and rejected.denied)
        seen = PoolObservation(
            generation=generation,
            previous=previous,
            invalid=rejected.why if rejected is not None and not rejected.denied else None,
            denied=rejected.why if rejected is not None and rejected.denied else None,
            apply_failed=failed,
            applied_generation=built.generation if unapplied else None,
            endpoint=self.endpoints.cluster_url(pool),
            scheduler_available=self._scheduler_available(pool),
            figures=figures,
            unreachable=unreachable,
            last=last_figures(body.get("status")),
            refused=push.refused,
            push_failed=push.failed,
            agents=self._agents(pool, figures),
        )
        self._write_status(body, pool_status(pool, seen, rfc3339(self.clock())), previous)
        not_served = push.failed or unreachable
        if rejected is not None or failed is not None:
            not_served = _not_applied(rejected, failed)
        self._members_served(uid, pool, not_served,
                             figures.problems if figures is not None else None)  # fmt: skip

    def _agents(
        self, pool: ActionPool, figures: PoolFigures | None
    ) -> dict[str, dict[str, Any] | None]:
        """The status of the agent DaemonSets whose agents are missing (none read while
        all are there): why they are, for the status to say."""
        if figures is None:
            return {}
        missing = [r for r, s in (("cpu", pool.spec.cpu), ("gpu", pool.spec.gpu))
                   if s is not None and figures.nodes == 0]  # fmt: skip
        if pool.spec.gpu is not None and figures.gpus == 0 and "gpu" not in missing:
            missing.append("gpu")
        found: dict[str, dict[str, Any] | None] = {}
        for role in missing:
            ds = self.cluster.get("apps/v1", "DaemonSet", pool.metadata.namespace,
                                  child_name(pool, f"{role}-agent"))  # fmt: skip
            found[role] = None if ds is None else dict(ds.get("status") or {})
        return found

    def _push(
        self, pool: ActionPool, uid: str, figures: PoolFigures, built: _Build, *, base: str
    ) -> _Pushed:
        """Push the documents unless this scheduler run has them all applied. Refused or
        failed ones are pushed again on each pass: what was wrong may be outside the spec
        (a Secret not created yet, a scheduler restarting)."""
        digest = hashlib.sha256(built.documents.encode())
        # The scheduler reads its API credentials when it loads the documents, which only
        # name their Secrets: a changed Secret is a change to push.
        for version in self._credential_versions(pool):
            digest.update(f"\0{version}".encode())
        given = (figures.epoch, digest.hexdigest())
        if self._pushed.get(uid) == given:
            return _Pushed()
        where = f"pool {pool.metadata.namespace}/{pool.metadata.name}"
        try:
            changes = self.link.reload(base, built.token, built.documents)
        except SchedulerRefusedError as e:
            if self._refused.get(uid) != str(e):
                log.warning("%s: the scheduler refused its config: %s", where, e)
            self._refused[uid] = str(e)
            return _Pushed(refused=str(e))
        except SchedulerError as e:  # 413, 5xx, no answer: it may run the ones before
            log.warning("%s: pushing its config failed: %s", where, e)
            self._refused.pop(uid, None)
            return _Pushed(failed=str(e))
        self._served[uid] = built.members
        self._refused.pop(uid, None)
        self._pushed[uid] = given
        log.info("pushed config to %s: %s", base, "; ".join(changes) or "no changes")
        return _Pushed(changed=bool(changes))

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
                     self._written, self._rejected, self._served, self._members,
                     self._orphans)  # fmt: skip
            for memo in memos:
                memo.pop(meta.get("uid", ""), None)

    def finish_unserved_deletions(self, finalizer: str) -> int:
        """While the ActionPool CRD is being deleted (``helm uninstall`` with
        ``crds.keep=false``, ``kubectl delete crd``) the API server stops offering patch
        on pools, so kopf stops serving them and their finalizer never runs: pools, the
        CRD and their namespaces stay stuck, their agents running. Its work is done here
        instead: each pool being deleted is drained as the finalizer would (within its
        drainSeconds) and let go. Returns how many were let go."""
        if not self.cluster.crd_deleting("ActionPool"):
            return 0
        let_go = 0
        for body in self.cluster.list_custom("ActionPool"):
            meta = body["metadata"]
            if not meta.get("deletionTimestamp") or finalizer not in (meta.get("finalizers") or []):
                continue
            where = f"{meta['namespace']}/{meta['name']}"
            try:
                self.drain_pool(body)
            except RetryError as e:
                log.info("pool %s (its CRD is being deleted): %s", where, e)
                continue
            except Exception:  # nothing else will run it: let go, undrained, rather than stick
                log.exception("pool %s (its CRD is being deleted): the drain failed", where)
            if self.cluster.remove_finalizer("ActionPool", meta["namespace"], meta["name"],
                                             finalizer):  # fmt: skip
                log.warning("pool %s let go: its CRD is being deleted", where)
                let_go += 1
        return let_go

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
        # (first: a foreground deletion may have collected the tokens Secret too)
        if self._scheduler_collected(pool, body):
            return
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
        if figures is not None and figures.nodes == 0 and last.get("trajectories"):
            # A scheduler that has just restarted learns of the trajectories its agents
            # hold from their hellos: with none connected yet its 0 is no answer (it ended
            # the drain, and collected the pool's objects, a second before the agent came).
            unreachable = "its scheduler has no node agent connected yet"
            figures = None
        if left <= 0 or (figures is not None and figures.trajectories == 0):
            if figures is None:
                log.warning("pool %s: its scheduler did not answer within drainSeconds (%s); "
                            "removing it", pool.metadata.name, unreachable)  # fmt: skip
            elif figures.trajectories or figures.running or figures.queue_depth:
                # Its actions end saying why, before the sandboxes (and agents) go.
                try:
                    self.link.drain(self.endpoints.url(pool), token, end=True)
                except SchedulerError as e:
                    log.warning("pool %s: ending its scheduler's actions: %s",
                                pool.metadata.name, e)  # fmt: skip
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

    def _scheduler_collected(self, pool: ActionPool, body: dict[str, Any]) -> bool:
        """Whether a foreground deletion (``kubectl delete --cascade=foreground``, Argo
        CD) has the garbage collector delete the scheduler while the finalizer waits:
        the children block their owner's deletion, so they go first, and there is no
        scheduler left to drain. Said in an Event and the log."""
        if FOREGROUND not in (body["metadata"].get("finalizers") or []):
            return False
        scheduler = child_name(pool, "scheduler")
        deployment = self.cluster.get("apps/v1", "Deployment", pool.metadata.namespace, scheduler)
        if deployment is not None and not (deployment.get("metadata") or {}).get(
            "deletionTimestamp"
        ):
            return False
        message = (f"foreground deletion: Deployment {scheduler} is deleted with the pool, so "
                   "open trajectories are not drained (delete with the default background "
                   "propagation to drain them)")  # fmt: skip
        log.warning("pool %s/%s: %s", pool.metadata.namespace, pool.metadata.name, message)
        self.cluster.event(body, "Warning", DRAIN_SKIPPED, message, self.clock())
        return True

    # ---- sandboxes no agent will take back --------------------------------------------
    def _sweep_orphans(self, pool: ActionPool, body: dict[str, Any]) -> None:
        """Delete the pool's sandbox pods on nodes without an agent of the pool for its
        ``agentGraceSeconds`` (:mod:`tangram.operator.orphans`), with a Warning Event per
        node. A failed read or delete is tried again on the next refresh."""
        ns, uid = pool.metadata.namespace, body["metadata"]["uid"]
        grace = pool.spec.scheduler.agent_grace_seconds
        try:
            sandboxes = sandbox_nodes(self.cluster.list_pods(ns, sandbox_pods_selector(pool)), uid)
            attended = set()
            if sandboxes:  # (no sandbox: no need to read the agents)
                attended = agent_nodes(self.cluster.list_pods(ns, cpu_agent_pods_selector(pool)))
        except ApiServerError as e:
            log.warning("pool %s/%s: sandbox pods not checked for an agent: %s", ns,
                        pool.metadata.name, e)  # fmt: skip
            return
        found = sweep(sandboxes, attended, self._orphans.get(uid, {}), self.clock(), grace)
        self._orphans[uid] = found.waiting
        for node, pods in found.delete.items():
            deleted = []
            for pod in pods:
                try:
                    if self.cluster.delete_pod(ns, pod):
                        deleted.append(pod)
                except ApiServerError as e:  # (the next sweep tries it again)
                    log.warning("pool %s/%s: sandbox pod %s on node %s not deleted: %s", ns,
                                pool.metadata.name, pod, node, e)  # fmt: skip
            if not deleted:
                continue
            message = (
                f"deleted {len(deleted)} sandbox pod(s) on node {node} ({', '.join(deleted)}): "
                f"no node agent of the pool has run there for {grace} s "
                "(agentGraceSeconds), so none would take them back; the trajectories open "
                "in them are lost. The node left spec.cpu.nodeSelector, or the agent "
                "DaemonSet went."
            )
            log.warning("pool %s/%s: %s", ns, pool.metadata.name, message)
            self.cluster.event(body, "Warning", ORPHANS_DELETED, message, self.clock())

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
        *,
        write: bool = True,
    ) -> Member | None:
        """Write the member's status; the member when its pool can serve it. With
        ``write`` False, a member its pool can serve is returned unwritten: its status
        waits for the push (``_members_served``)."""
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
        cond = ready(status.conditions)
        usable = member is not None and cond is not None and cond.status == "True"
        if write or not usable:
            self._write_status(body, status, previous)
        return member if usable else None

    # ---- status ----------------------------------------------------------------------
    def _write_status(
        self,
        body: dict[str, Any],
        status: PoolStatus | MemberStatus,
        previous: list[Any],
    ) -> dict[str, Any]:
        """Patch the status when it changed (the status as written, returned), and post an
        Event for each condition that changed (not on every pass): Ready when its status or
        reason changes; SandboxesHealthy also when its message does, which counts each new
        failure."""
        new: dict[str, Any] = status.model_dump(by_alias=True, mode="json")
        if (body.get("status") or {}) == new:
            return new
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
        return new


# Conditions that post Events, by what of them is news when it changes.
_NEWS: dict[str, Callable[[Condition], tuple[str, ...]]] = {
    READY: lambda c: (c.status, c.reason),
    SANDBOXES_HEALTHY: lambda c: (c.status, c.reason, c.message),
}


class _Pushed:
    """How a push went: whether the scheduler changed something, or why not."""

    def __init__(self, *, changed: bool = False, refused: str | None = None,
                 failed: str | None = None) -> None:  # fmt: skip
        self.changed, self.refused, self.failed = changed, refused, failed


def _not_applied(rejected: _Rejected | None, failed: str | None) -> str:
    """What a member hears of its pool's spec that the API server did not take."""
    why = rejected.why if rejected is not None else f"applying it failed: {failed}"
    return f"the spec of its ActionPool was not applied: {why}"


def _member_key(kind: str, body: dict[str, Any]) -> MemberKey:
    meta = body.get("metadata") or {}
    return kind, meta.get("namespace", ""), meta.get("name", ""), meta.get("generation", 0)


def _documents(objects: list[Manifest]) -> str:
    # The pool's config ConfigMap, by what it holds (the learned-state one holds no data).
    text: str = next(o["data"]["pool.yaml"] for o in objects if "pool.yaml" in o.get("data", {}))
    return text


__all__ = ["MEMBER_KINDS", "READY", "Reconciler", "RetryError"]
