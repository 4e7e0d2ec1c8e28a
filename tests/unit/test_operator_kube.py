"""The operator's Kubernetes adapter against a stand-in API server on 127.0.0.1 that applies
patches to a custom object's status the way kube-apiserver does (merge patch: RFC 7386;
JSON patch: RFC 6902, the operations the operator may send)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tangram.operator.kube import Cluster
from tests.integration.http_stub import JsonHandler, http_serving

PATH = "/apis/tangram.dev/v1alpha1/namespaces/rl/actionpools/coding"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: a null removes the key, a map merges into a map, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902's add, replace and remove on object members."""
    out = copy.deepcopy(target)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node = out
        for p in parents:
            node = node[p]
        if op["op"] == "add":
            node[last] = op["value"]
        elif op["op"] == "replace":
            if last not in node:
                raise KeyError(last)  # replace needs the member to exist
            node[last] = op["value"]
        elif op["op"] == "remove":
            del node[last]
        else:
            raise ValueError(op["op"])
    return out


class FakeApiServer:
    """One ActionPool (or none)."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = obj

    def handler(self) -> type[JsonHandler]:
        server = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server names it)
                if self.path != PATH or server.obj is None:
                    self.answer(404, {"kind": "Status", "code": 404})
                    return
                self.answer(200, server.obj)

            def do_PATCH(self) -> None:  # noqa: N802 (http.server names it)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind = self.headers["Content-Type"]
                if self.path != f"{PATH}/status" or server.obj is None:
                    self.answer(404, {"kind": "Status", "code": 404})
                    return
                if kind == "application/merge-patch+json":
                    patched = merge_patch(server.obj, body)
                elif kind == "application/json-patch+json":
                    try:
                        patched = json_patch(server.obj, body)
                    except (KeyError, TypeError):
                        self.answer(422, {"kind": "Status", "code": 422})
                        return
                else:  # custom resources take no strategic merge patch
                    self.answer(415, {"kind": "Status", "code": 415})
                    return
                # The status subresource: only the status of the patched object is kept.
                server.obj = {**server.obj, "status": patched.get("status")}
                self.answer(200, server.obj)

        return Handler


def _pool() -> dict[str, Any]:
    """An ActionPool as stored before the operator wrote its status."""
    return {
        "apiVersion": "tangram.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "coding", "namespace": "rl", "generation": 2},
        "spec": {"apis": [{"name": "openai"}]},
    }


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """The operator's adapter, talking to a stand-in API server holding ``_pool()``."""
    with http_serving(FakeApiServer(_pool()).handler()) as base:
        api = client.ApiClient(client.Configuration(host=base))
        try:
            yield Cluster(api)
        finally:
            api.close()  # type: ignore[no-untyped-call]


def test_a_new_status_replaces_the_stored_one_whole(cluster: Cluster) -> None:
    """A quota removed from spec.apis leaves status.apis; anything else the new status
    leaves out goes too. A merge patch would keep the stale keys, and the reconciler,
    finding the stored status unlike the one it computed, would patch again every pass."""
    first = {
        "observedGeneration": 1,
        "nodes": 2,
        "apis": {"openai": 0, "anthropic": 1},
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}],
    }
    cluster.patch_status("ActionPool", "rl", "coding", first)  # no status yet
    assert (cluster.get_custom("ActionPool", "rl", "coding") or {}).get("status") == first
    new = {"observedGeneration": 2, "nodes": 2, "apis": {"openai": 0}, "conditions": []}
    cluster.patch_status("ActionPool", "rl", "coding", new)
    stored = cluster.get_custom("ActionPool", "rl", "coding")
    assert stored is not None
    assert stored["status"] == new
    assert stored["spec"] == _pool()["spec"]  # the status subresource touches no spec
