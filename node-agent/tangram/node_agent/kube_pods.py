"""The pod runtime's Kubernetes adapter (the only node-agent module importing
``kubernetes``): create, read, list, label and delete the pods of one namespace."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tangram.node_agent.execution import ExecError
from tangram.node_agent.pod_runtime import PodApi

__all__ = ["LIST_TIMEOUT_S", "kube_pod_api"]

# Lists also ask the API server to end the call by then (server-side timeoutSeconds).
LIST_TIMEOUT_S = 30


def kube_pod_api(namespace: str, kubeconfig: str | None = None) -> PodApi:
    """The Kubernetes API as the runtime uses it: ``kubeconfig`` if given, else in-cluster
    credentials (the agent's ServiceAccount), else ``KUBECONFIG``."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from tangram.kube import api_client as make_client

    # Calls are bounded (tangram.kube): what fails is an ExecError worth retrying, which
    # the runtime's callers do.
    api_client: Any = make_client(kubeconfig)
    core = client.CoreV1Api(api_client)

    def to_dict(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = api_client.sanitize_for_serialization(obj)
        return out

    def fail(e: Exception, what: str) -> ExecError:
        """The API server's own message (it names the field or object at fault); any
        other failure (no connection, a timeout) says so, as one worth retrying."""
        if not isinstance(e, ApiException):
            return ExecError(f"{what}: the API server is not reachable: {e}", retryable=True)
        try:
            message = json.loads(e.body or "{}").get("message") or ""
        except (ValueError, AttributeError):
            message = ""
        said = f": {message}" if message else ""
        # The RuntimeClass admission plugin refuses a pod naming no RuntimeClass.
        missing = e.status == 403 and "RuntimeClass" in message and "not found" in message
        return ExecError(
            f"{what}: the API server answered {e.status} {e.reason}{said}",
            reason="RuntimeClassNotFound" if missing else "",
            retryable=e.status in (429, 500, 502, 503, 504),
        )

    class Api:
        def create(self, manifest: dict[str, Any]) -> None:
            try:
                core.create_namespaced_pod(namespace, manifest)  # type: ignore[arg-type]
            except Exception as e:
                raise fail(e, f"creating pod {namespace}/{manifest['metadata']['name']}") from None

        def get(self, name: str) -> dict[str, Any] | None:
            try:
                return to_dict(core.read_namespaced_pod(name, namespace))
            except Exception as e:
                if isinstance(e, ApiException) and e.status == 404:
                    return None
                raise fail(e, f"reading pod {namespace}/{name}") from None

        def events(self, name: str) -> list[dict[str, Any]]:
            try:
                found = core.list_namespaced_event(
                    namespace,
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={name}",
                    timeout_seconds=LIST_TIMEOUT_S,
                )
            except Exception:
                return []  # events only add detail to an error: never fail for them
            return [to_dict(e) for e in found.items]

        def list(self, selector: str) -> list[dict[str, Any]]:
            try:
                pods = core.list_namespaced_pod(
                    namespace,
                    label_selector=selector,
                    timeout_seconds=LIST_TIMEOUT_S,
                )
            except Exception as e:
                raise fail(e, f"listing pods {selector}") from None
            return [to_dict(p) for p in pods.items]

        def label(
            self, name: str, labels: Mapping[str, str], annotations: Mapping[str, str]
        ) -> None:
            meta = {"labels": dict(labels), "annotations": dict(annotations)}
            try:
                core.patch_namespaced_pod(name, namespace, {"metadata": meta})
            except Exception as e:
                raise fail(e, f"labelling pod {namespace}/{name}") from None

        def delete(self, name: str) -> None:
            try:
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            except Exception as e:
                if not (isinstance(e, ApiException) and e.status == 404):
                    raise fail(e, f"deleting pod {namespace}/{name}") from None

    return Api()
