"""Fixtures of the end-to-end tests: one real control plane per test session.

The toolchain comes from ``TANGRAM_E2E_BIN`` when set (a directory with etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kwok and kubectl), or
else from ``e2e/build-tools.sh``, which builds it once into its cache and
prints the bin dir (a first build takes ~20 minutes; later runs ~1 s).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.controlplane import ControlPlane
from harness.kubelet import RealNode, node_prerequisites
from harness.tools import ToolsError, tools_dir

REAL_NODE = "node-0"
SANDBOX_LABELS = {"tangram.dev/role": "sandbox"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: runs against a real Kubernetes control plane (e2e/harness)"
    )


def _bin_dir() -> Path:
    try:
        return tools_dir()
    except ToolsError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def e2e_bin_dir() -> Path:
    """The directory holding the pinned control-plane binaries, kwok, kubectl and helm."""
    return _bin_dir()


@pytest.fixture(scope="session")
def control_plane(
    e2e_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A started control plane shared by the whole session; logs under its work dir."""
    plane = ControlPlane(e2e_bin_dir, tmp_path_factory.mktemp("controlplane"))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def real_node(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    """A kubelet + containerd node (``node-0``, labelled as a sandbox node) joined to the
    control plane for one test module; stopped, and its host changes undone, after it.
    (Per module: a module whose pods must stay on kwok's nodes never sees it.)"""
    missing = node_prerequisites()
    if missing:
        pytest.skip(f"a real node needs {', '.join(missing)} (apt-get install containerd ...)")
    node = RealNode(control_plane, tmp_path_factory.mktemp("node"), name=REAL_NODE,
                    labels=SANDBOX_LABELS)  # fmt: skip
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def busybox_on_node(real_node: RealNode, docker_client: Any) -> str:
    """The busybox test image, in the real node's containerd under its full name."""
    from tests.integration.docker_engine import busybox_image

    image = busybox_image(docker_client)
    if image is None:
        pytest.skip("busybox-static is not installed: no test image can be built")
    return real_node.import_image(docker_client, image, f"docker.io/{image}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Point a failed e2e test at the component logs."""
    report: pytest.TestReport = yield
    plane = getattr(item, "funcargs", {}).get("control_plane")
    if report.failed and isinstance(plane, ControlPlane):
        report.sections.append(("control plane logs", f"{plane.log_dir}/<component>.log"))
    return report
