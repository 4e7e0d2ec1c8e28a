"""Smoke tests of the e2e harness: the control plane is real and complete enough.

Scheduling onto a kwok node, the deployment/replicaset controllers, the
garbage collector, RBAC for a ServiceAccount and the TokenRequest API all work,
and the binaries are the pinned release.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness.controlplane import ControlPlane
from harness.tools import BUILD_TOOLS

pytestmark = pytest.mark.e2e


def _pinned_kubernetes_version() -> str:
    match = re.search(r"^K8S_VERSION=(v\d+\.\d+\.\d+)", BUILD_TOOLS.read_text(), re.MULTILINE)
    assert match, f"no K8S_VERSION= line in {BUILD_TOOLS}"
    return match.group(1)


def _eventually(what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _items(cp: ControlPlane, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cp.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def _is_running_and_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    )
    return status.get("phase") == "Running" and ready


def test_kube_apiserver_reports_the_pinned_version(e2e_bin_dir: Path) -> None:
    version = _pinned_kubernetes_version()
    for binary in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        out = subprocess.run(
            [str(e2e_bin_dir / binary), "--version"], capture_output=True, text=True, check=True
        ).stdout
        assert version in out, f"{binary} --version: {out!r}"


def test_deployment_runs_on_a_fake_node_and_gc_removes_its_children(
    control_plane: ControlPlane,
) -> None:
    cp = control_plane
    cp.add_fake_node("smoke-node", labels={"tangram.e2e/pool": "smoke"}, cpu="8", memory="32Gi")
    cp.kubectl("create", "namespace", "smoke")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "smoke"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "nodeSelector": {"tangram.e2e/pool": "smoke"},
                    "containers": [
                        {
                            "name": "web",
                            "image": "registry.invalid/never-pulled:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                        }
                    ],
                },
            },
        },
    }
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(deployment))

    def two_pods_running_on_the_fake_node() -> bool:
        pods = _items(cp, "pods", "smoke", "app=web")
        return len(pods) == 2 and all(
            _is_running_and_ready(p) and p["spec"].get("nodeName") == "smoke-node" for p in pods
        )

    _eventually("2 Running and Ready pods on smoke-node", two_pods_running_on_the_fake_node)
    cp.kubectl("rollout", "status", "deployment/web", "-n", "smoke", "--timeout=60s")
    assert len(_items(cp, "replicasets", "smoke", "app=web")) == 1

    # Background cascading deletion: the Deployment goes at once, the garbage
    # collector then deletes its ReplicaSet and, through it, the pods.
    cp.kubectl("delete", "deployment", "web", "-n", "smoke", "--cascade=background")
    _eventually(
        "the garbage collector to delete the ReplicaSet and its pods",
        lambda: (
            not _items(cp, "replicasets", "smoke", "app=web")
            and not _items(cp, "pods", "smoke", "app=web")
        ),
    )


def test_service_account_without_rbac_is_authenticated_but_forbidden(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    cp.kubectl("create", "namespace", "robots")
    cp.kubectl("create", "serviceaccount", "robot", "-n", "robots")
    kubeconfig = cp.service_account_kubeconfig("robots", "robot", tmp_path / "robot.kubeconfig")

    denied = cp.kubectl("get", "secrets", kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower(), denied.stderr
    assert "system:serviceaccount:robots:robot" in denied.stderr

    whoami = cp.kubectl(
        "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", kubeconfig=kubeconfig
    )
    assert whoami.stdout.strip() == "system:serviceaccount:robots:robot"
