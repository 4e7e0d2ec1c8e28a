"""``tangram bench exec``: per-action overhead of both allocate-on-execution paths, and
trajectory open latency cold vs warm, against the local Docker Engine."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tangram.api.wire import EnvSpec
from tangram.cli.files import InputError
from tangram.cli.progress import bar, note
from tangram.node_agent.docker_runtime import DockerRuntime, import_busybox
from tangram.node_agent.exec_server import build
from tangram.node_agent.execution import ExecError

BENCH_IMAGE = "tangram-bench/busybox:1"


def cache_dir() -> Path:
    return Path(os.environ.get("TANGRAM_CACHE_DIR", Path.home() / ".cache" / "tangram"))


def run_exec_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.runtime == "pod":
        return run_pod_bench(args)
    from tangram.node_agent.exec_bench import measure_exec, measure_open

    cores = sorted(os.sched_getaffinity(0))
    built = build(cache_dir())
    if built.path is None:
        raise InputError(f"bench exec: the fast path cannot be measured: {built.reason}")
    state = Path(args.state_dir)
    try:
        rt = DockerRuntime(cores[:1], execd=built, state_dir=state)
    except ExecError as e:
        raise InputError(f"bench exec: {e}") from None
    image = args.image or import_busybox(rt.client, BENCH_IMAGE)
    if image is None:
        raise InputError("--image: none given, and busybox-static is not installed to make one")
    template = EnvSpec(name="bench", image=image, memory_gb=0.25)
    action_cores = cores[-1:]
    trajectory = "bench-exec"
    rt.close(trajectory)
    try:
        rt.open(trajectory, template)
        with bar("exec overhead (fast + portable)", args.actions, enabled=not args.json) as update:
            report = asyncio.run(
                measure_exec(rt, trajectory, args.actions, action_cores, progress=update)
            )
    finally:
        rt.close(trajectory)
    with bar("open latency (cold + warm)", args.opens, enabled=not args.json) as update:
        report["open"] = measure_open(rt, template, args.opens, progress=update)
    report.update(
        image=image,
        docker=rt.client.version().get("Version"),
        cgroup_version=rt.cgroups.version,
        machine=f"{platform.machine()}, {len(cores)} cores, Linux {platform.release()}",
    )
    if not args.json:
        f, p = report["fast"], report["portable"]
        note(
            f"fast p50 {f['p50_ms']:.2f} ms p99 {f['p99_ms']:.2f} ms | portable p50 "
            f"{p['p50_ms']:.1f} ms p99 {p['p99_ms']:.1f} ms | "
            f"{report['portable_over_fast_p50']:.0f}x"
        )
    return report


def run_pod_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The pod runtime on this node: per-action overhead (its one path, the fast one) and
    open latency, cold (a pod created and started) and warm (a ready pod relabelled)."""
    from tangram.node_agent.exec_bench import measure_exec, measure_open
    from tangram.node_agent.kube_pods import kube_pod_api
    from tangram.node_agent.pod_runtime import PodRuntime

    if not (args.image and args.execd_image):
        raise InputError("bench exec --runtime pod needs --image and --execd-image")
    cores = sorted(os.sched_getaffinity(0))
    node = args.node or platform.node()
    try:
        rt = PodRuntime(
            cores[:1],
            api=kube_pod_api(args.namespace, args.kubeconfig),
            node=node,
            namespace=args.namespace,
            execd_image=args.execd_image,
        )
    except ExecError as e:
        raise InputError(f"bench exec: {e}") from None
    template = EnvSpec(name="bench", image=args.image, memory_gb=0.25, pool="bench")
    trajectory = "bench-exec"
    try:
        rt.open(trajectory, template)
        with bar("exec overhead (pod, fast path)", args.actions, enabled=not args.json) as update:
            report = asyncio.run(
                measure_exec(
                    rt, trajectory, args.actions, cores[-1:], paths=("fast",), progress=update
                )
            )
    finally:
        rt.close(trajectory)
    with bar("open latency (cold + warm)", args.opens, enabled=not args.json) as update:
        report["open"] = measure_open(rt, template, args.opens, progress=update)
    report.update(
        runtime="pod",
        image=args.image,
        node=node,
        cgroup_version=rt.cgroups.version,
        machine=f"{platform.machine()}, {len(cores)} cores, Linux {platform.release()}",
    )
    if not args.json:
        f = report["fast"]
        note(f"pod fast path p50 {f['p50_ms']:.2f} ms p99 {f['p99_ms']:.2f} ms")
    return report


def print_tables(report: dict[str, Any], console: Console) -> None:
    t = Table(title=f"per-action overhead, {report['actions']} actions per path")
    cols = ("p50_ms", "p99_ms", "mean_ms", "setup_p50_ms", "exec_p50_ms", "teardown_p50_ms")
    t.add_column("path")
    for col in cols:
        t.add_column(col, justify="right")
    for path in [p for p in ("fast", "portable") if p in report]:
        t.add_row(path, *(f"{report[path][c]:.2f}" for c in cols))
    console.print(t)
    t = Table(title=f"trajectory open latency, {report['open']['opens']} opens each")
    t.add_column("from")
    stats = ("p50_ms", "p99_ms", "mean_ms")
    for col in stats:
        t.add_column(col, justify="right")
    for kind in ("cold", "warm"):
        t.add_row(kind, *(f"{report['open'][kind][c]:.1f}" for c in stats))
    console.print(t)
