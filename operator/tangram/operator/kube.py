"""The operator's Kubernetes API adapter (the only operator module importing ``kubernetes``).

Children are written with server-side apply under one field manager, so a reconcile sends
the whole desired object and the API server merges it: fields that other controllers own
(a Deployment's replicas under an autoscaler, defaults the API server filled in) are left
alone, and a field the operator stops setting is removed.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import logging
from typing import Any, cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from tangram import kube
from tangram.api.resources import API_VERSION, GROUP, PLURALS, VERSION
from tangram.operator.builders import POOL_NAMESPACE_LABEL, Manifest

log = logging.getLogger("tangram.operator")

FIELD_MANAGER = "tangram-operator"
JSON_PATCH = "application/json-patch+json"
LIST_TIMEOUT_S = 30  # lists also ask the API server to end the call by then


class ApplyError(RuntimeError):
    """The API server did not take a child: the message names the child, the HTTP
    status and the API server's reason."""


class RefusedError(ApplyError, ValueError):
    """The API server refused a child as invalid (422), saying which of its fields."""


class DeniedError(ApplyError):
    """The API server denied a child (400 or 403: an admission webhook, a policy, a
    ResourceQuota, missing RBAC): valid, but not admitted until something outside the
    spec changes, so not worth retrying at once."""


class ApiServerError(ApplyError):
    """The API server failed (5xx, 429, a timeout, no answer): worth retrying soon."""


def api_client(kubeconfig: str | None = None) -> Any:
    """In a pod: its ServiceAccount; elsewhere ``kubeconfig`` or ``$KUBECONFIG`` (e2e runs
    the operator as a process with the chart's ServiceAccount token in a kubeconfig). Its
    calls are bounded (``tangram.kube``): a handler's thread is never held by an API server
    that stopped answering."""
    return kube.api_client(kubeconfig)


class Cluster:
    """Reads and writes of one operator; ``namespaces`` None means every namespace."""

    def __init__(self, api: Any, namespaces: list[str] | None = None) -> None:
        self.api = api
        self.namespaces = namespaces
        self._custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)
        self._dynamic: DynamicClient | None = None

    @property
    def dynamic(self) -> DynamicClient:
        if self._dynamic is None:  # discovery on first use, not at import
            self._dynamic = DynamicClient(self.api)  # type: ignore[no-untyped-call]
        return self._dynamic

    # ---- the custom resources --------------------------------------------------------
    def get_custom(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURALS[kind], name
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return cast(dict[str, Any], obj)

    def list_custom(self, kind: str) -> list[dict[str, Any]]:
        """Every object of ``kind`` in the watched namespaces."""
        plural = PLURALS[kind]
        if self.namespaces is None:
            found = self._custom.list_cluster_custom_object(GROUP, VERSION, plural)
            return list(cast(dict[str, Any], found).get("items", []))
        items: list[dict[str, Any]] = []
        for ns in self.namespaces:
            found = self._custom.list_namespaced_custom_object(GROUP, VERSION, ns, plural)
            items.extend(cast(dict[str, Any], found).get("items", []))
        return items

    def crd_deleting(self, kind: str) -> bool:
        """Whether the CustomResourceDefinition of ``kind`` is being deleted."""
        try:
            crd = client.ApiextensionsV1Api(self.api).read_custom_resource_definition(
                f"{PLURALS[kind]}.{GROUP}"
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return crd.metadata is not None and crd.metadata.deletion_timestamp is not None

    def remove_finalizer(self, kind: str, namespace: str, name: str, finalizer: str) -> bool:
        """Take ``finalizer`` off the object (a JSON patch that tests it is still where it
        was read); False when it is gone or has none."""
        obj = self.get_custom(kind, namespace, name)
        finalizers = list(((obj or {}).get("metadata") or {}).get("finalizers") or [])
        if finalizer not in finalizers:
            return False
        at = f"/metadata/finalizers/{finalizers.index(finalizer)}"
        patch = [{"op": "test", "path": at, "value": finalizer}, {"op": "remove", "path": at}]
        try:
            self._custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURALS[kind], name, patch, _content_type=JSON_PATCH
            )
        except ApiException as e:
            if e.status in (404, 422):  # gone, or changed meanwhile: the next look decides
                return False
            raise
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace ``status`` whole. A JSON patch, not a merge patch: a merge patch keeps
        every map key it does not name (a quota dropped from ``status.apis`` would stay,
        and the reconciler, seeing the status differ, would patch it again every pass)."""
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURALS[kind],
                name,
                # "add" sets /status whether or not it exists ("replace" needs it to)
                [{"op": "add", "path": "/status", "value": status}],
                _content_type=JSON_PATCH,
            )
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to report on
                raise

    # ---- children ----------------------------------------------------------------------
    def _resource(self, manifest: Manifest) -> Any:
        return self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])

    def apply(self, manifest: Manifest, *, dry_run: bool = False) -> None:
        """Server-side apply (``dry_run``: validated and admitted, not stored). Every
        failure is an :class:`ApplyError`: :class:`RefusedError` when the object is
        invalid, :class:`DeniedError` when it is denied, else :class:`ApiServerError`."""
        meta = manifest["metadata"]
        try:
            self._resource(manifest).server_side_apply(
                body=manifest,
                name=meta["name"],
                namespace=meta.get("namespace"),
                field_manager=FIELD_MANAGER,
                force_conflicts=True,  # the operator owns its children's fields
                dry_run="All" if dry_run else None,
            )
        except ApiException as e:
            what = f"{manifest['kind']} {meta['name']}"
            if e.status == 422:
                raise RefusedError(f"{what}: {_message(e)}") from None
            if e.status in (400, 403):
                raise DeniedError(f"{what}: HTTP {e.status}: {_message(e)}") from None
            raise ApiServerError(f"{what}: HTTP {e.status}: {_message(e)}") from None
        except (urllib3.exceptions.HTTPError, OSError) as e:  # no answer (timeouts too)
            raise ApiServerError(f"{manifest['kind']} {meta['name']}: {e}") from None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        res = self.dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            obj: dict[str, Any] = res.get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None
        return obj

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        res = self.dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            res.delete(name=name, namespace=namespace)
        except NotFoundError:
            return False
        return True

    # ---- pods (the node agents' sandboxes, read and deleted by the orphan sweep) ----------
    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The pods of ``namespace`` that ``selector`` (a label selector) matches."""
        try:
            found = self._core.list_namespaced_pod(
                namespace,
                label_selector=selector,
                timeout_seconds=LIST_TIMEOUT_S,
                resource_version="0",  # the API server's cache, not etcd: every 10 s a pool
            )
        except _NOT_DONE as e:
            raise _failed(f"listing pods {selector}", e) from None
        pods: list[dict[str, Any]] = self.api.sanitize_for_serialization(found.items)
        return pods

    def delete_pod(self, namespace: str, name: str) -> bool:
        """False when there is no such pod (any more)."""
        try:
            self._core.delete_namespaced_pod(name, namespace)
        except _NOT_DONE as e:
            if isinstance(e, ApiException) and e.status == 404:
                return False
            raise _failed(f"deleting pod {name}", e) from None
        return True

    def delete_cluster_children(self, namespace: str, pool: str) -> list[str]:
        """The pool's cluster-scoped children (found by labels: they have no owner)."""
        selector = f"app.kubernetes.io/instance={pool},{POOL_NAMESPACE_LABEL}={namespace}"
        deleted = []
        for kind in ("ClusterRoleBinding", "ClusterRole"):
            res = self.dynamic.resources.get(api_version="rbac.authorization.k8s.io/v1", kind=kind)
            for item in res.get(label_selector=selector).items:
                name = item.metadata.name
                if self.delete("rbac.authorization.k8s.io/v1", kind, None, name):
                    deleted.append(f"{kind}/{name}")
        return deleted

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data decoded, or None when there is no such Secret."""
        try:
            obj = self._core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        out = {}
        for key, encoded in (obj.data or {}).items():
            try:
                out[key] = base64.b64decode(encoded, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                continue  # not ours to read: the operator rewrites what it needs
        return out

    def event(
        self, obj: dict[str, Any], type_: str, reason: str, message: str, now: dt.datetime
    ) -> None:
        """A core Event on ``obj`` (``kubectl describe`` shows it)."""
        meta = obj["metadata"]
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                api_version=obj.get("apiVersion", API_VERSION),
                kind=obj["kind"],
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta.get("uid"),
                resource_version=meta.get("resourceVersion"),
            ),
            type=type_,
            reason=reason,
            message=message[:1024],
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component=FIELD_MANAGER),
            reporting_component=FIELD_MANAGER,
        )
        try:
            self._core.create_namespaced_event(meta["namespace"], body)
        except ApiException as e:  # an Event is a courtesy: never fail a reconcile on it
            log.warning("event not posted: %s %s", e.status, e.reason)
        except _NO_ANSWER as e:
            log.warning("event not posted: %s", e)


__all__ = [
    "FIELD_MANAGER",
    "ApiServerError",
    "ApplyError",
    "Cluster",
    "DeniedError",
    "RefusedError",
    "api_client",
]


# What a call that got no answer raises (timeouts too).
_NO_ANSWER = (urllib3.exceptions.HTTPError, OSError)
# ... and what one the API server failed or refused raises too.
_NOT_DONE = (*_NO_ANSWER, ApiException)


def _failed(what: str, e: Exception) -> ApiServerError:
    """A read or delete the API server failed, or that got no answer."""
    if isinstance(e, ApiException):
        return ApiServerError(f"{what}: HTTP {e.status}: {_message(e)}")
    return ApiServerError(f"{what}: {e}")


def _message(e: ApiException) -> str:
    """The API server's own message of a refusal (its Status object's), else the body."""
    try:
        found = json.loads(e.body or "").get("message")
    except (ValueError, AttributeError):
        found = None
    return str(found or e.body or e.reason)[:1000]
