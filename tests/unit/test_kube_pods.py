"""The Kubernetes adapter of the pod runtime bounds every call: an API server that stops
answering fails the call instead of holding an agent thread forever."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tangram.kube import REQUEST_TIMEOUT
from tangram.node_agent.execution import ExecError
from tangram.node_agent.kube_pods import LIST_TIMEOUT_S, kube_pod_api


class FakeCore:
    """CoreV1Api's calls the adapter makes, recorded with their keyword arguments."""

    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    status = 0  # answer every call with this error (0: none)

    def __init__(self, api_client: Any) -> None:
        pass

    def _call(self, method: str, kwargs: dict[str, Any], answer: Any = None) -> Any:
        self.calls.append((method, kwargs))
        if self.status:
            raise ApiException(status=self.status, reason="Bad Gateway")
        return answer

    def create_namespaced_pod(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self._call("create", kw)

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        return self._call("read", kw, client.V1Pod(metadata=client.V1ObjectMeta(name=name)))

    def list_namespaced_pod(self, namespace: str, **kw: Any) -> Any:
        return self._call("list", kw, client.V1PodList(items=[]))

    def list_namespaced_event(self, namespace: str, **kw: Any) -> Any:
        return self._call("events", kw, client.CoreV1EventList(items=[]))

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any, **kw: Any) -> Any:
        return self._call("patch", kw)

    def delete_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        return self._call("delete", kw)


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[FakeCore]:
    def not_in_a_cluster() -> None:
        raise config.ConfigException("not in a cluster")

    monkeypatch.chdir(tmp_path)
    Path("kubeconfig").touch()  # (read by no one: load_kube_config is replaced)

    monkeypatch.setattr(config, "load_incluster_config", not_in_a_cluster)
    monkeypatch.setattr(config, "load_kube_config", lambda **kw: None)
    monkeypatch.setattr(client, "CoreV1Api", FakeCore)
    monkeypatch.setattr(FakeCore, "calls", [])
    return FakeCore


def _every_call(namespace: str = "ns") -> None:
    api = kube_pod_api(namespace, "kubeconfig")
    api.create({"metadata": {"name": "p"}})
    api.get("p")
    api.events("p")
    api.list("a=b")
    api.label("p", {"a": "b"}, {})
    api.delete("p")


def test_lists_ask_the_api_server_to_end_them_before_the_client_gives_up(
    core: type[FakeCore],
) -> None:
    """Every call has a client timeout (tests/unit/test_kube.py); a list also has a
    server-side one, shorter, so that a slow list ends with an answer, not a timeout."""
    _every_call()
    assert [m for m, _ in core.calls] == ["create", "read", "events", "list", "patch", "delete"]
    for method, kw in core.calls:
        if method in ("list", "events"):
            assert kw.get("timeout_seconds") == LIST_TIMEOUT_S, method
    connect, read = REQUEST_TIMEOUT
    assert connect > 0 and read > LIST_TIMEOUT_S  # the server ends it first


def test_a_bad_gateway_is_worth_retrying(
    core: type[FakeCore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core, "status", 502)
    with pytest.raises(ExecError) as failed:
        kube_pod_api("ns", "kubeconfig").create({"metadata": {"name": "p"}})
    assert failed.value.retryable and "502" in str(failed.value)
