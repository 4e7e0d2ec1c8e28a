"""The kopf handlers: each translates one kind of event into a :class:`Reconciler` call.

Handlers are sync (kopf runs them in its thread pool: the Kubernetes client and the
scheduler link block). kopf keeps its progress and diff base in annotations under
``kopf.tangram.dev``, since the status schema is typed and the API server prunes anything
else there; the status itself is patched by the reconciler.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import kopf

from tangram.api.resources import GROUP, PLURALS, VERSION
from tangram.operator.reconciler import Reconciler, RetryError

FINALIZER = "tangram.dev/drain"
REFRESH_S = 10.0  # status refresh, and a config push to a scheduler that missed one

_state: dict[str, Reconciler] = {}
log = logging.getLogger("tangram.operator")


def install(reconciler: Reconciler) -> None:
    """Set the reconciler the handlers use (before ``kopf.run``)."""
    _state["reconciler"] = reconciler


def _r() -> Reconciler:
    return _state["reconciler"]


def _retrying(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except RetryError as e:
        raise kopf.TemporaryError(str(e), delay=e.delay_s) from None


class _NotDoneYet(logging.Filter):
    """kopf logs a handler's temporary error (our :class:`RetryError`: a drain waiting for
    open trajectories) as an error on every retry, and kopf releases from before its
    ``posting.loggers`` setting (2026) post such records as Events: 120 for a 10-minute
    drain. It is progress, which the pool's status shows: logged at INFO, never posted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and " failed temporarily: " in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.k8s_skip = True  # kopf's mark for a record not to post
        return True


_NOT_DONE_YET = _NotDoneYet()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    prefix = "kopf.tangram.dev"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # our own Events say what matters
    logging.getLogger("kopf.objects").addFilter(_NOT_DONE_YET)  # (a set: added once)
    settings.peering.standalone = True  # one replica (the chart's Deployment is Recreate)


@kopf.on.startup()
def watch_crd_deletion(**_: Any) -> None:
    """kopf serves no pool while their CRD is being deleted, finalizer included: a thread
    of its own does that part (``Reconciler.finish_unserved_deletions``)."""

    def watch() -> None:
        while True:
            time.sleep(REFRESH_S)
            try:
                _r().finish_unserved_deletions(FINALIZER)
            except Exception:  # (tried again at the next look)
                log.exception("finishing the deletions of pools whose CRD is going")

    threading.Thread(target=watch, name="crd-deletion", daemon=True).start()


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf talks to the API server with the same credentials as the reconciler's client
    (in-cluster ServiceAccount, or the kubeconfig given on the command line). kopf calls
    this again on a 401, and the client's hook re-reads a rotated ServiceAccount token."""
    c = _r().cluster.api.configuration
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization")
    scheme, _sep, token = (header or "").partition(" ")
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )


_POOLS = (GROUP, VERSION, PLURALS["ActionPool"])


@kopf.on.resume(*_POOLS)
@kopf.on.create(*_POOLS)
@kopf.on.update(*_POOLS, field="spec")
def pool_changed(namespace: str | None, name: str, **_: Any) -> None:
    _retrying(_r().reconcile_pool, namespace or "", name)


@kopf.timer(*_POOLS, interval=REFRESH_S, initial_delay=REFRESH_S)
def pool_refresh(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
    _retrying(_r().refresh_pool, namespace or "", name, dict(body))


@kopf.on.delete(*_POOLS)
def pool_deleted(body: kopf.Body, **_: Any) -> None:
    _retrying(_r().drain_pool, dict(body))


def _member(kind: str) -> None:
    resource = (GROUP, VERSION, PLURALS[kind])

    @kopf.on.resume(*resource, id="changed")
    @kopf.on.create(*resource, id="changed")
    @kopf.on.update(*resource, field="spec", id="changed")
    def changed(namespace: str | None, name: str, **_: Any) -> None:
        _retrying(_r().reconcile_member, kind, namespace or "", name)

    # A member has no finalizer, so its deletion reaches kopf only as the watch's DELETED
    # event, for which kopf runs no on.delete handler: watched here instead. A pass that
    # fails is logged, and the pool's next full pass takes the member out.
    @kopf.on.event(*resource, id="gone")
    def gone(type: str, body: kopf.Body, **_: Any) -> None:  # (kopf names it ``type``)
        if type == "DELETED":
            _r().member_deleted(dict(body))


_member("TrajectoryEnv")
_member("RewardService")
