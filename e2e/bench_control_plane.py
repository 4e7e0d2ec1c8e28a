"""How fast a real control plane binds a batch of trajectory pods: the rate the simulator's
``k8s-static-cp`` baseline takes for its kube-scheduler (``make bench-control-plane``;
writes docs/bench/control_plane.json).

The e2e harness's kube-apiserver, kube-scheduler (v1.34, default settings: its client
may send 50 requests a second, 100 at once) and kwok's fake nodes, sized as the coding
replays' cluster: 5 nodes × 256 cores. A trainer opening a batch creates one pod per
trajectory at once (0.5 CPU requested, 4 the limit, as the paper's baseline); each pod's
create, bind (``spec.nodeName`` set) and Running are timed from a watch. kwok starts
pods at once, so what is measured is the API server and the kube-scheduler alone, not a
kubelet's start (the simulator keeps its own start latency for that).

    .venv/bin/python e2e/bench_control_plane.py [--batches 256,1280,1536] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

E2E = Path(__file__).resolve().parent
ROOT = E2E.parent
sys.path[:0] = [str(E2E), str(ROOT)]

from harness.controlplane import ControlPlane  # noqa: E402
from harness.tools import tools_dir  # noqa: E402
from kubernetes import client, config, watch  # noqa: E402

NODES, CORES = 5, 256  # the coding replays' cluster (scenario_cluster("coding"))
CREATORS = 32  # the trainer's concurrent creates


def _pod(name: str) -> dict[str, Any]:
    resources = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "4"}}
    container = {"name": "env", "image": "docker.io/library/busybox:1", "resources": resources}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "trajectory"}},
        "spec": {"containers": [container]},
    }


def _client(kubeconfig: Path) -> client.ApiClient:
    settings = client.Configuration()
    config.load_kube_config(str(kubeconfig), client_configuration=settings)  # type: ignore[no-untyped-call]
    settings.connection_pool_maxsize = CREATORS
    return client.ApiClient(settings)


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    p50, p99, most = np.percentile(values, [50, 99, 100])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3), "max": round(float(most), 3)}


def measure(core: client.CoreV1Api, namespace: str, batch: int) -> dict[str, Any]:
    """Create ``batch`` pods at once; when each was created, bound and Running (seconds
    from the first create), and the binding rate over the burst."""
    bound: dict[str, float] = {}
    running: dict[str, float] = {}
    t0 = time.monotonic()

    def follow() -> None:
        # A watch the server ends (its timeout, a dropped connection) goes on from the
        # last version seen.
        version = ""
        while len(running) < batch and time.monotonic() - t0 < 600:
            stream = watch.Watch()  # type: ignore[no-untyped-call]
            events = stream.stream(  # type: ignore[no-untyped-call]
                core.list_namespaced_pod, namespace, resource_version=version, timeout_seconds=60
            )
            for event in events:
                pod = event["object"]
                version = pod.metadata.resource_version
                now = time.monotonic() - t0
                if pod.spec.node_name and pod.metadata.name not in bound:
                    bound[pod.metadata.name] = now
                if pod.status.phase == "Running" and pod.metadata.name not in running:
                    running[pod.metadata.name] = now
                if len(running) == batch:
                    stream.stop()  # type: ignore[no-untyped-call]

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    created: dict[str, float] = {}

    def create(i: int) -> None:
        name = f"traj-{i:05d}"
        core.create_namespaced_pod(namespace, _pod(name))  # type: ignore[arg-type]
        created[name] = time.monotonic() - t0

    with ThreadPoolExecutor(CREATORS) as pool:
        list(pool.map(create, range(batch)))
    watcher.join(600)
    if len(running) < batch:
        raise SystemExit(
            f"bench_control_plane: {batch - len(running)} pods never ran "
            f"({len(bound)} bound, {time.monotonic() - t0:.1f} s)"
        )
    first_bind, last_bind = min(bound.values()), max(bound.values())
    return {
        "pods": batch,
        "created_s": round(max(created.values()), 3),
        "all_bound_s": round(last_bind, 3),
        "all_running_s": round(max(running.values()), 3),
        "create_per_s": round(batch / max(created.values()), 1),
        "bind_per_s": round((batch - 1) / max(last_bind - first_bind, 1e-9), 1),
        "create_to_bound_s": _quantiles([bound[n] - created[n] for n in created]),
        "create_to_running_s": _quantiles([running[n] - created[n] for n in created]),
    }


def _clear(core: client.CoreV1Api, namespace: str) -> None:
    """Delete the burst's pods (one collection delete; kwok removes each at once) and wait
    until they are gone, so the next burst finds every core unrequested."""
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    deadline = time.monotonic() + 600
    while core.list_namespaced_pod(namespace, limit=1).items:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_control_plane: the pods of {namespace} were not deleted")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "control_plane.json"))
    parser.add_argument("--batches", default="256,1280,1536")
    parser.add_argument("--repeats", type=int, default=3, help="bursts of each batch")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    tools = tools_dir()
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="tangram-bench-cp-") as work,
        ControlPlane(tools, Path(work) / "cp") as cp,
    ):
        for i in range(NODES):
            cp.add_fake_node(f"node-{i}", cpu=str(CORES), memory="4Ti", pods=4000)
        core = client.CoreV1Api(_client(cp.admin_kubeconfig))
        runs = []
        for batch in batches:
            for repeat in range(args.repeats):
                namespace = f"burst-{batch}-{repeat}"
                cp.kubectl("create", "namespace", namespace)
                run = measure(core, namespace, batch)
                took = run["all_running_s"]
                print(f"{batch} pods: bound at {run['bind_per_s']}/s, all running "
                      f"{took} s after the first create", flush=True)  # fmt: skip
                runs.append(run)
                _clear(core, namespace)
    report = {
        "command": " ".join(["python e2e/bench_control_plane.py", *sys.argv[1:]]),
        "machine": f"{platform.node()}, {platform.machine()}, Python {platform.python_version()}",
        "cluster": f"{NODES} kwok nodes × {CORES} cores; kube-apiserver and kube-scheduler "
        "v1.34.10 with default settings; creates from a client with "
        f"{CREATORS} at once",
        "wall_s": round(time.perf_counter() - started, 1),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
