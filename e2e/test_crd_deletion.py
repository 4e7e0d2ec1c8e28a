"""A pool whose CRD is deleted under it (``helm uninstall`` with ``crds.keep=false``,
``kubectl delete crd``), on a real kube-apiserver: while the CRD terminates the API
server stops offering patch on pools, kopf stops serving them and the pool's finalizer
never runs, so the pool, the CRD and its namespace stayed stuck for good. The operator
lets such a pool go itself (``Reconciler.finish_unserved_deletions``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness.controlplane import ControlPlane
from harness.pods import wait_for

from tangram.operator.handlers import FINALIZER
from tangram.operator.kube import Cluster, api_client
from tangram.operator.reconciler import Reconciler
from tangram.operator.scheduler_link import SchedulerError

pytestmark = pytest.mark.e2e

CRDS = Path(__file__).resolve().parents[1] / "crds"
NS = "crd-gone"


class _NoScheduler:
    """The pool's scheduler never ran (nothing to drain)."""

    def figures(self, base: str, token: str) -> Any:
        raise SchedulerError("connection refused")

    def drain(self, base: str, token: str, *, end: bool = False) -> Any:
        raise SchedulerError("connection refused")


def _gone(cp: ControlPlane, *args: str) -> bool:
    return cp.kubectl("get", *args, check=False).returncode != 0


def test_a_pool_whose_crd_is_deleted_is_let_go(control_plane: ControlPlane) -> None:
    cp = control_plane
    for crd in sorted(CRDS.glob("*.yaml")):
        cp.kubectl("apply", "-f", str(crd))
    cp.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    cp.kubectl("create", "namespace", NS)
    pool = {"apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool",
            "metadata": {"name": "stuck", "namespace": NS, "finalizers": [FINALIZER]},
            "spec": {"apis": [{"name": "q", "concurrency": 1}]}}  # fmt: skip
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    try:
        cp.kubectl("delete", "crd", "actionpools.tangram.dev", "--wait=false")
        cluster = Cluster(api_client(str(cp.admin_kubeconfig)))
        wait_for("the CRD to be terminating", lambda: cluster.crd_deleting("ActionPool"))
        reconciler = Reconciler(cluster, image="unused", link=_NoScheduler())  # type: ignore[arg-type]
        assert reconciler.finish_unserved_deletions(FINALIZER) == 1
        wait_for("the CRD to go", lambda: _gone(cp, "crd", "actionpools.tangram.dev"))
        assert reconciler.finish_unserved_deletions(FINALIZER) == 0  # (no CRD: nothing to do)
    finally:
        cp.kubectl("delete", "namespace", NS, "--wait=false")
        for crd in sorted(CRDS.glob("*.yaml")):  # as found: none (a later module installs them)
            cp.kubectl("delete", "-f", str(crd), "--ignore-not-found", "--wait=true")
