"""The chart as helm renders it (the unit tests read its files without helm): what its
templates compute from the values."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[1] / "charts" / "arl-tangram"


def _render(helm: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), "template", "x", str(CHART), "-n", "sys",
            "--api-versions", "monitoring.coreos.com/v1"]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def _docs(out: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(out) if d}


def test_a_scrape_timeout_longer_than_its_interval_is_refused(e2e_bin_dir: Path) -> None:
    """Prometheus refuses such a ServiceMonitor: said at install, not found in its log."""
    helm = e2e_bin_dir / "helm"
    on = "serviceMonitor.enabled=true"
    refused = _render(helm, on, "serviceMonitor.interval=1m30s", "serviceMonitor.scrapeTimeout=2m")
    assert refused.returncode != 0
    assert "serviceMonitor.scrapeTimeout (2m) is longer than serviceMonitor.interval (1m30s)" in (
        refused.stderr
    )
    taken = _render(helm, on, "serviceMonitor.interval=1m30s", "serviceMonitor.scrapeTimeout=90s")
    assert taken.returncode == 0, taken.stderr
    (endpoint,) = _docs(taken.stdout)["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["scrapeTimeout"] == "90s"


def test_cluster_objects_are_the_namespaces_and_the_probe_port_is_admitted(
    e2e_bin_dir: Path,
) -> None:
    out = _render(e2e_bin_dir / "helm", "networkPolicy.enabled=true", "loopback.enabled=true",
                  "loopback.livenessPort=9808")  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = _docs(out.stdout)
    assert docs["ClusterRole"]["metadata"]["name"] == "sys.x-arl-tangram"
    assert docs["ClusterRoleBinding"]["roleRef"]["name"] == "sys.x-arl-tangram"
    (rule,) = docs["NetworkPolicy"]["spec"]["ingress"]
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    ports = [p["containerPort"] for p in container["ports"]]
    assert rule["ports"] == [{"port": 9808, "protocol": "TCP"}] and ports == [9808]
