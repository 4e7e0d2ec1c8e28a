"""Every Kubernetes API call the operator, the scheduler and the node agent make is bounded
(``tangram.kube``): an API server that takes a request and never answers fails the call
after one try, instead of holding the caller's thread forever (the client's default) or
for four read timeouts (urllib3's default retries)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client, config

from tangram import kube
from tangram.node_agent.execution import ExecError
from tangram.node_agent.kube_pods import kube_pod_api
from tangram.operator import kube as operator_kube
from tangram.service import kube as service_kube


class Silent:
    """An API server on 127.0.0.1 that reads each request and never answers."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.requests: list[bytes] = []
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self._held.append(conn)
            self.requests.append(conn.recv(65536))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def close(self) -> None:
        self.server.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def silent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Silent, str]]:
    """The silent server and a kubeconfig naming it; calls time out after 0.5 s."""
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1.0, 0.5))
    server = Silent()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    try:
        yield server, str(kubeconfig)
    finally:
        server.close()


def _pod_read(kubeconfig: str) -> None:
    kube_pod_api("ns", kubeconfig).get("p")


def _pool_read(kubeconfig: str) -> None:
    operator_kube.Cluster(operator_kube.api_client(kubeconfig)).get_custom("ActionPool", "rl", "p")


def _learned_read(kubeconfig: str) -> None:
    service_kube.LearnedConfigMap(service_kube.api_client(kubeconfig), "rl", "m").read()


def _token_review(kubeconfig: str) -> None:
    service_kube.KubeApi(service_kube.api_client(kubeconfig)).review_sync("token")


@pytest.mark.parametrize(
    ("call", "error", "request_line"),
    [
        (_pod_read, ExecError, b"GET /api/v1/namespaces/ns/pods/p "),
        (_pool_read, urllib3.exceptions.HTTPError, b"GET /apis/tangram.dev/"),
        (_learned_read, OSError, b"GET /api/v1/namespaces/rl/configmaps/m "),
        (_token_review, service_kube.KubeError, b"POST /apis/authentication.k8s.io/v1/"),
    ],
    ids=["node agent: a pod", "operator: a pool", "scheduler: learned state", "scheduler: a token"],
)
def test_a_call_the_api_server_never_answers_fails_after_one_try(
    silent: tuple[Silent, str],
    call: Callable[[str], None],
    error: type[Exception],
    request_line: bytes,
) -> None:
    server, kubeconfig = silent
    with pytest.raises(error):
        call(kubeconfig)
    assert len(server.requests) == 1 and server.requests[0].startswith(request_line)


def test_a_call_that_names_its_own_timeout_keeps_it(silent: tuple[Silent, str]) -> None:
    """The default fills in only a missing timeout (a long watch may set a longer one)."""
    server, kubeconfig = silent
    core = client.CoreV1Api(kube.api_client(kubeconfig))
    seen: list[Any] = []
    plain = urllib3.PoolManager.request

    def recording(self: urllib3.PoolManager, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("timeout"))
        return plain(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(urllib3.PoolManager, "request", recording)
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.read_namespace("rl", _request_timeout=(1.0, 0.2))
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.read_namespace("rl")
    assert [(t.connect_timeout, t.read_timeout) for t in seen] == [(1.0, 0.2), (1.0, 0.5)]
    assert len(server.requests) == 2


def test_in_a_pod_the_service_account_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kubeconfig given, in a pod: the in-cluster loader fills in the client's settings
    (and its token refresh), not the process-wide default configuration."""
    filled: list[Any] = []

    def in_cluster(client_configuration: Any = None) -> None:
        client_configuration.host = "https://127.0.0.1:6443"
        filled.append(client_configuration)

    def no_kubeconfig(**_: Any) -> None:
        raise AssertionError("a kubeconfig was read in a pod")

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setattr(config, "load_incluster_config", in_cluster)
    monkeypatch.setattr(config, "load_kube_config", no_kubeconfig)
    api = kube.api_client()
    assert filled == [api.configuration] and api.configuration.host == "https://127.0.0.1:6443"


def test_a_kubeconfig_that_is_not_there_is_named(tmp_path: Path) -> None:
    """The client says "Invalid kube-config file. No configuration found." for a path
    that does not exist, as for an empty file: which it is was left to guess."""
    missing = tmp_path / "nope"
    with pytest.raises(config.ConfigException, match=f"kubeconfig {missing}: no such file"):
        kube.api_client(str(missing))
    with pytest.raises(service_kube.KubeError, match="no such file"):
        service_kube.api_client(str(missing))
