"""``tangram bench exec --runtime pod`` on a real node made here: the control plane and a
kubelet + containerd node of the e2e harness, the busybox and exec-server images
imported, then the benchmark run as the node agent would run it (root, host PID
namespace). ``make bench-pods``; writes docs/bench/exec_pod.json.

    .venv/bin/python e2e/bench_pods.py [--out FILE] [--actions N] [--opens N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

E2E = Path(__file__).resolve().parent
ROOT = E2E.parent
sys.path[:0] = [str(E2E), str(ROOT)]

from harness.controlplane import ControlPlane  # noqa: E402
from harness.kubelet import RealNode  # noqa: E402
from harness.tools import tools_dir  # noqa: E402
from tests.integration.docker_engine import busybox_image, engine  # noqa: E402

from tangram.node_agent.exec_server import build  # noqa: E402
from tangram.node_agent.pod_runtime import DEFAULT_EXECD_PATH  # noqa: E402

EXECD_IMAGE = "docker.io/tangram-bench/execd:1"
NS = "bench"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "exec_pod.json"))
    parser.add_argument("--actions", type=int, default=500)
    parser.add_argument("--opens", type=int, default=30)
    args = parser.parse_args()
    tools = tools_dir()
    work = Path(tempfile.mkdtemp(prefix="tangram-bench-pods-"))
    docker = engine()
    client = next(docker)
    if client is None:
        sys.exit("bench_pods: no Docker Engine to make the busybox image with")
    cp = ControlPlane(tools, work / "cp")
    cp.start()
    node = RealNode(cp, work / "node", name="node-0")
    try:
        node.start()
        image = busybox_image(client)
        if image is None:
            sys.exit("bench_pods: busybox-static is not installed")
        image = node.import_image(client, image, f"docker.io/{image}")
        built = build(work / "execd")
        if built.path is None:
            sys.exit(f"bench_pods: {built.reason}")
        node.import_execd_image(built.path, EXECD_IMAGE, DEFAULT_EXECD_PATH)
        cp.kubectl("create", "namespace", NS)
        done = subprocess.run(
            [str(Path(sys.executable).parent / "tangram"), "bench", "exec", "--runtime", "pod",
             "--namespace", NS, "--node", node.name, "--kubeconfig", str(cp.admin_kubeconfig),
             "--image", image, "--execd-image", EXECD_IMAGE, "--actions", str(args.actions),
             "--opens", str(args.opens), "--out", args.out],
            check=False,
        )  # fmt: skip
        return done.returncode
    finally:
        node.stop()
        cp.stop()
        for _ in docker:
            pass


if __name__ == "__main__":
    sys.exit(main())
