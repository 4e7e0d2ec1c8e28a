"""How ``Cluster.apply`` sorts what the API server answers a server-side apply into the
operator's errors, against an HTTP server on 127.0.0.1 that answers discovery as an API
server does and each apply with a chosen status: 422 is an invalid child
(``RefusedError``), 400/403 a denial (``DeniedError``: a webhook, a ResourceQuota),
anything else, or no answer at all, the API server failing (``ApiServerError``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram import kube
from tangram.operator.kube import (
    ApiServerError,
    ApplyError,
    Cluster,
    DeniedError,
    RefusedError,
    api_client,
)

CONFIGMAP = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "tangram-p-config", "namespace": "rl"}, "data": {}}  # fmt: skip
DISCOVERY: dict[str, Any] = {
    "/version": {"major": "1", "minor": "34", "gitVersion": "v1.34.10"},
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": "configmaps",
                "singularName": "configmap",
                "namespaced": True,
                "kind": "ConfigMap",
                "verbs": ["get", "list", "patch", "create"],
            }
        ],
    },
}


class ApiServer(ThreadingHTTPServer):
    """Discovery, and each PATCH answered with ``status`` (None: the request is read and
    the connection closed unanswered)."""

    status: int | None = 200
    message = ""


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in DISCOVERY:
            self._answer(200, DISCOVERY[path])
        else:
            self._answer(404, {"kind": "Status", "status": "Failure", "code": 404})

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = self.server.status
        if status is None:
            self.close_connection = True
            return
        if status == 200:
            self._answer(200, CONFIGMAP)
            return
        self._answer(status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "message": self.server.message, "code": status})  # fmt: skip

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ApiServer, Cluster]]:
    monkeypatch.setattr(kube, "REQUEST_TIMEOUT", (1.0, 2.0))
    httpd = ApiServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{httpd.server_port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    try:
        yield httpd, Cluster(api_client(str(kubeconfig)))
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    ("status", "message", "error"),
    [
        (422, 'ConfigMap "tangram-p-config" is invalid: data: Invalid value', RefusedError),
        (400, 'admission webhook "policy.example" denied the request: no', DeniedError),
        (403, 'configmaps "tangram-p-config" is forbidden: exceeded quota: q', DeniedError),
        (500, "etcdserver: request timed out", ApiServerError),
        (429, "too many requests", ApiServerError),
        (None, "", ApiServerError),
    ],
    ids=["invalid", "webhook", "quota", "5xx", "429", "no answer"],
)
def test_each_failure_of_an_apply_is_sorted_and_names_the_child(
    server: tuple[ApiServer, Cluster], status: int | None, message: str, error: type[Exception]
) -> None:
    httpd, cluster = server
    httpd.status, httpd.message = status, message
    with pytest.raises(ApplyError) as e:
        cluster.apply(CONFIGMAP)
    assert type(e.value) is error
    assert str(e.value).startswith("ConfigMap tangram-p-config: ")
    assert message in str(e.value)
    if status not in (None, 422):
        assert f"HTTP {status}" in str(e.value)


def test_an_apply_the_api_server_takes_raises_nothing(server: tuple[ApiServer, Cluster]) -> None:
    _, cluster = server
    cluster.apply(CONFIGMAP)
