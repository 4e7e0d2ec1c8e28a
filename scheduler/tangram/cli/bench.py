"""``tangram bench``: trace replays against the baselines, and scheduler micro-benchmarks."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tangram.api.field_errors import alternatives
from tangram.api.orderings import GPU_JOINING, QuotaWaiting
from tangram.cli.files import (
    STDIN,
    InputError,
    Interrupted,
    OutputError,
    check_writable,
    load_cluster,
    load_trace_file,
    positive_number,
    seconds,
    whole_number,
)
from tangram.cli.progress import bar, note, plain_console
from tangram.cli.seed_runs import write_table
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.sim.policies import build, check_policy, simulate
from tangram.sim.records import SimResult
from tangram.sim.roundbench import (
    DEFAULT_CASES,
    DEFAULT_GPU_CASES,
    DEFAULT_QUOTA_CASES,
    Case,
    GpuCase,
    QuotaCase,
    measure,
    measure_gpu,
    measure_quota,
)
from tangram.sim.tracegen import RESTORE_FIXED_S, RESTORE_GBPS
from tangram.sim.validate import check_trace


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="replay a trace under several policies, or run a benchmark",
        description=(
            "Without a sub-command: replay --trace on --cluster under each --policy and print "
            "the figures of docs/architecture.md (Contracts). `tangram bench scheduler` "
            "measures round latency; "
            "`tangram bench paper` runs the paper-scale sweeps recorded in docs/benchmarks.md; "
            "`tangram bench coding-seeds` replays the coding scenario over batches and several "
            "trace seeds, elastic against fixed DoP, and reports the spread; "
            "`tangram bench gpu-seeds` does the same for pooled GPUs against static "
            "deployments (MOPD, and the GPUs the 10-service mix needs); "
            "`tangram bench search-seeds` for DeepSearch's managed quotas against unmanaged "
            "calls, with remaining-steps hints of several qualities; "
            "`tangram bench exec` measures per-action overhead of the fast and portable "
            "allocate-on-execution paths and open latency (needs a Docker Engine); "
            "`tangram bench gpu` compares restore bandwidth with the host-to-device copy "
            "bandwidth (needs the gpu extra; on the CPU without CUDA); `tangram bench "
            "gpu-pool` compares RewardServices pooled on shared devices with one static "
            "device per service for the same calls (needs the gpu extra); `tangram bench "
            "tenants` measures one tenant's queueing beside another's flood under each "
            "tenant policy; `tangram bench files` compares the files API's upload and "
            "download throughput with docker cp (needs a Docker Engine)."
        ),
    )
    p.add_argument(
        "what",
        nargs="?",
        choices=(
            "scheduler",
            "paper",
            "coding-seeds",
            "gpu-seeds",
            "search-seeds",
            "exec",
            "service",
            "gpu",
            "gpu-pool",
            "tenants",
            "files",
        ),
        help="a named benchmark",
    )
    p.add_argument(
        "--trace",
        help="JSON Lines trace, one trajectory a line, or - for the standard input (tangram "
        "trace generate; the format: docs/simulator.md, 'Trace and cluster files')",
    )
    p.add_argument(
        "--cluster",
        help="cluster YAML: nodes, services, apis (trace generate --cluster-out; the format: "
        "docs/simulator.md, 'Trace and cluster files')",
    )
    p.add_argument(
        "--policy",
        default="elastic",
        help="comma-separated policies (docs/simulator.md: elastic, elastic-paper, fixed-dop-N, "
        "k8s-static, ...)",
    )
    p.add_argument(
        "--seed",
        type=whole_number(0),
        default=0,
        help="the replay's random choices (a replay, paper); the trace's are its own",
    )
    p.add_argument(
        "--depth",
        type=whole_number(1, 4),
        default=2,
        help="ACT approximation depth, 1 to 4 (as the ActionPool's spec.scheduling.depth)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot",
        help="PNG of ACT distributions per policy, its folder created if missing (default: "
        "next to the trace, when that is a regular file; otherwise none is drawn)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw the ACT plot")
    p.add_argument(
        "--out", help="the report as JSON (a replay, a named benchmark), or a directory (paper)"
    )
    p.add_argument("--quick", action="store_true", help="paper: smaller sweeps for a smoke run")
    p.add_argument(
        "--gc",
        choices=("service", "default"),
        default="service",
        help="scheduler: the garbage collector as the scheduler service sets it after start-up "
        "(start-up objects frozen, young collections every 10,000 allocations), or Python's "
        "default",
    )
    p.add_argument("--batches", help="*-seeds: comma-separated batch sizes")
    p.add_argument(
        "--seeds",
        help="*-seeds: comma-separated trace seeds (default 0,1,2; search-seeds 0 to 8)",
    )
    p.add_argument(
        "--mixed-batch",
        type=whole_number(1),
        default=1024,
        help="gpu-seeds: batch of the 10-service mix",
    )
    p.add_argument(
        "--restore-gbps",
        type=positive_number,
        default=RESTORE_GBPS,
        help="gpu-seeds: host-to-device restore bandwidth of each GPU, GB/s (`tangram bench "
        "gpu` measures one GPU's)",
    )
    p.add_argument(
        "--restore-fixed-s",
        type=seconds,
        default=RESTORE_FIXED_S,
        help="gpu-seeds: set-up time added to every restore, seconds",
    )
    p.add_argument(
        "--jobs",
        type=whole_number(1),
        default=None,
        help="*-seeds: parallel replays",
    )
    p.add_argument(
        "--actions", type=whole_number(1), default=500, help="exec: timed actions per path"
    )
    p.add_argument(
        "--opens", type=whole_number(1), default=30, help="exec: timed opens of each kind"
    )
    p.add_argument(
        "--image", help="exec, files: environment image (default: one made from busybox)"
    )
    p.add_argument("--sizes", help="files: comma-separated file sizes, MB (default 1,10,50,200)")
    p.add_argument("--repeats", type=whole_number(1), default=5, help="files: runs per size")
    p.add_argument(
        "--trajectories",
        type=whole_number(1),
        default=1000,
        help="service: concurrent trajectories",
    )
    p.add_argument("--think", type=float, default=0.4, help="service: mean think time, seconds")
    p.add_argument("--sweep", help="service: comma-separated think times (e.g. 2,1,0.5,0.3)")
    p.add_argument("--duration", type=float, default=20.0, help="service: measured seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="service: seconds before measuring")
    p.add_argument(
        "--generator-gc",
        action="store_true",
        help="service: keep the load generator's cyclic GC on while measuring",
    )
    p.add_argument(
        "--transport",
        choices=("stream", "http"),
        default="stream",
        help="service: the client's execs on its action stream (one WebSocket) or a request each",
    )
    p.add_argument(
        "--placement",
        choices=("dedicated", "shared"),
        default="dedicated",
        help="service: the scheduler alone on one CPU, the agent and generator on the others "
        "(dedicated, as a scheduler pod with a whole-core CPU request gets), or all three "
        "wherever the OS puts them (shared)",
    )
    p.add_argument(
        "--state-dir", default="/var/lib/tangram/bench", help="exec: agent state (socket dirs)"
    )
    k = p.add_argument_group(
        "exec on Kubernetes (--runtime pod: run on a node, as root, in the host PID namespace)"
    )
    k.add_argument(
        "--runtime",
        choices=("docker", "pod"),
        default="docker",
        help="exec: Docker containers (both paths) or sandbox pods of this node",
    )
    k.add_argument("--namespace", default="default", help="exec --runtime pod: pods' namespace")
    k.add_argument("--node", help="exec --runtime pod: this node's name (default: hostname)")
    k.add_argument("--execd-image", help="exec --runtime pod: an image holding the exec server")
    k.add_argument("--kubeconfig", help="exec --runtime pod: default in-cluster, else $KUBECONFIG")
    p.add_argument(
        "--size-mb", type=whole_number(32), default=None, help="gpu, gpu-pool: model size"
    )
    g = p.add_argument_group("gpu-pool")
    g.add_argument("--services", type=whole_number(1), default=4, help="services (teachers)")
    g.add_argument(
        "--pooled",
        default="auto",
        help="devices of each pooled run, comma-separated (auto: 1, 2, 4 up to the CUDA "
        "devices there are; 2,4 CPU-backed)",
    )
    g.add_argument(
        "--devices",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="CUDA devices when there are any (auto), or CPU-backed ones",
    )
    g.add_argument(
        "--per-device", type=whole_number(1), default=2, help="services one device can hold"
    )
    g.add_argument("--rounds", type=whole_number(1), default=8, help="rollout rounds")
    g.add_argument("--round-s", type=float, default=5.0, help="seconds per round")
    g.add_argument("--burst", type=whole_number(0), default=10, help="mean calls per burst")
    g.add_argument(
        "--compute-ms", type=float, default=150.0, help="median modeled compute per call"
    )
    g.add_argument("--active", type=float, default=0.5, help="chance a service is in a round's mix")
    g.add_argument(
        "--compute",
        choices=("timed", "batched", "decode"),
        default="timed",
        help="a call's compute: modeled (timed: a pass sleeps its calls' sum; batched: its "
        "longest call's, as on a GPU) or real decode steps",
    )
    g.add_argument(
        "--gpu-joining",
        choices=GPU_JOINING,
        default=SchedulerConfig().gpu_joining,
        help="the pooled schedulers' rule for calls joining a busy instance past a call "
        "waiting for GPUs (ActionPool spec.scheduling.gpuJoining)",
    )
    g.add_argument(
        "--step-ms",
        type=positive_number,
        default=None,
        help="decode: a step's milliseconds, to turn --compute-ms into steps (default: "
        "measured on the device first; give it to compare runs with the same work)",
    )
    g.add_argument(
        "--batch",
        type=whole_number(1),
        default=1,
        help="calls one instance runs at once, sharing forward passes (batching.maxCalls)",
    )
    t = p.add_argument_group("tenants")
    t.add_argument("--cores", type=whole_number(1), default=2, help="tenants: action cores")
    t.add_argument("--action-s", type=float, default=0.05, help="tenants: each action's sleep")
    t.add_argument("--steps", type=whole_number(1), default=60, help="tenants: steady actions")
    t.add_argument("--think-s", type=float, default=0.02, help="tenants: steady think time")
    t.add_argument("--flood-actions", type=whole_number(1), default=400,
                   help="tenants: the flood's backlog")  # fmt: skip
    t.add_argument("--flood-trajectories", type=whole_number(1), default=8,
                   help="tenants: trajectories the backlog is spread over")  # fmt: skip
    options = {a.dest: (a.option_strings[-1], a.default) for a in p._actions if a.option_strings}
    options.pop("help")
    p.set_defaults(run=run, bench_options=options)


REPLAY = "replay"  # the mode without a named benchmark: --trace on --cluster
_SEEDS = ("coding-seeds", "gpu-seeds", "search-seeds")
_GPU_POOL = (
    "services", "pooled", "devices", "per_device", "rounds", "round_s", "burst", "compute_ms",
    "active", "compute", "batch", "step_ms", "gpu_joining",
)  # fmt: skip
_TENANTS = ("cores", "action_s", "steps", "think_s", "flood_actions", "flood_trajectories")
_SERVICE = (
    "trajectories", "think", "sweep", "duration", "warmup", "generator_gc", "transport",
    "placement",
)  # fmt: skip
_EXEC = ("actions", "opens", "state_dir", "runtime", "namespace", "node", "execd_image",
         "kubeconfig")  # fmt: skip
# Which modes read each option (every option is listed: a test checks it). One given to
# a mode that does not read it is refused, naming it, rather than silently ignored.
APPLIES: dict[str, tuple[str, ...]] = {
    "json": ("*",),
    "out": ("*",),
    **dict.fromkeys(("trace", "cluster", "policy", "depth", "plot", "no_plot"), (REPLAY,)),
    "seed": (REPLAY, "paper", "gpu-pool"),
    "quick": ("paper",),
    "gc": ("scheduler",),
    **dict.fromkeys(("batches", "seeds", "jobs"), _SEEDS),
    **dict.fromkeys(("mixed_batch", "restore_gbps", "restore_fixed_s"), ("gpu-seeds",)),
    **dict.fromkeys(_EXEC, ("exec",)),
    "image": ("exec", "files"),
    **dict.fromkeys(("sizes", "repeats"), ("files",)),
    **dict.fromkeys(_SERVICE, ("service",)),
    "size_mb": ("gpu", "gpu-pool"),
    **dict.fromkeys(_GPU_POOL, ("gpu-pool",)),
    **dict.fromkeys(_TENANTS, ("tenants",)),
}


def _mode_name(mode: str) -> str:
    return "a trace replay" if mode == REPLAY else f"bench {mode}"


def _modes(modes: tuple[str, ...]) -> str:
    return alternatives([_mode_name(m) for m in modes])


def check_options(args: argparse.Namespace) -> None:
    """Refuse the options given that the chosen mode does not read, naming each and the
    modes that do (a value equal to its default is not told from none given)."""
    mode = args.what or REPLAY
    wrong = [
        (flag, APPLIES[dest])
        for dest, (flag, default) in args.bench_options.items()
        if getattr(args, dest) != default and "*" not in APPLIES[dest] and mode not in APPLIES[dest]
    ]
    if wrong:
        flags = ", ".join(flag for flag, _ in wrong)
        where = "; ".join(f"{flag} is for {_modes(modes)}" for flag, modes in wrong)
        raise InputError(f"{flags}: not options of {_mode_name(mode)} ({where})")


# Imported when asked for: each pulls in what only it needs (the client, Docker, PyTorch).
_REPORTS = {
    "service": ("tangram.cli.bench_service", "run_service_bench"),
    "tenants": ("tangram.cli.bench_tenants", "run_tenants_bench"),
    "coding-seeds": ("tangram.cli.bench_seeds", "run_seeds_bench"),
    "gpu-seeds": ("tangram.cli.bench_gpu_seeds", "run_gpu_seeds_bench"),
    "search-seeds": ("tangram.cli.bench_search_seeds", "run_search_seeds_bench"),
    "gpu-pool": ("tangram.cli.bench_gpu_pool", "run_gpu_pool_bench"),
    "exec": ("tangram.cli.bench_exec", "run_exec_bench"),
    "files": ("tangram.cli.bench_files", "run_files_bench"),
}


def run(args: argparse.Namespace) -> int:
    check_options(args)
    if args.out and args.what != "paper":  # checked now, written at the end
        check_writable(args.out, "--out")
    if args.what == "scheduler":
        report = run_round_bench(progress=not args.json, gc_settings=args.gc)
        _emit(report, args)
        return 0
    if args.what in _REPORTS:  # these take the parsed options and return one report
        module, function = _REPORTS[args.what]
        _emit(getattr(importlib.import_module(module), function)(args), args)
        return 0
    if args.what == "gpu":
        try:
            from tangram.node_agent.gpu_bench import run as run_gpu_bench
        except ImportError as e:
            raise InputError(f"bench gpu needs PyTorch (pip install '.[gpu]'): {e}") from None
        _emit(run_gpu_bench(args.size_mb or 1024, repeats=5), args)
        return 0
    if args.what == "paper":
        from tangram.cli.paper import run_paper

        out = Path(args.out or "docs/bench")
        try:
            figures = run_paper(out, quick=args.quick, seed=args.seed)
        except ReplayInterrupted as e:  # its sweeps' figures are written only at the end
            raise Interrupted(
                f"interrupted during {e.policy} ({out}/paper.json is written at the end of the "
                "sweeps: nothing was; each finished batch was noted above)"
            ) from None
        if args.json:
            print(json.dumps(figures, indent=2))
        return 0
    if not args.trace or not args.cluster:
        raise InputError("--trace and --cluster are required for a replay (or name a benchmark)")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise InputError("--policy: name at least one policy")
    for p in policies:
        try:
            check_policy(p)
        except ValueError as e:
            raise InputError(f"--policy: {e}") from None
    trace = load_trace_file(args.trace)
    cluster = load_cluster(args.cluster)
    try:
        check_trace(trace, cluster, policies)
    except ValueError as e:
        raise InputError(f"{args.trace} on {args.cluster}: {e}") from None
    for p in policies:  # a baseline's deployment that cannot exist, before any replay
        try:
            build(p, cluster)
        except ValueError as e:
            raise InputError(f"policy {p}: {e}") from None
    plot = _plot_path(args)  # checked before the replays, drawn after them
    try:
        results = replay_all(trace, cluster, policies, seed=args.seed, depth=args.depth)
        stopped = None
    except ReplayInterrupted as e:  # what finished is reported, then the exit is 130
        results, stopped = e.finished, e
        plot = None
    report = {
        "trace": args.trace,
        "cluster": args.cluster,
        "trajectories": len(trace),
        "actions": sum(len(t.steps) for t in trace),
        "policies": {p: r.summary() for p, r in results.items()},
    }
    if "elastic" in results:
        base = results["elastic"].summary()["avg_act_s"]
        report["avg_act_ratio_vs_elastic"] = {
            p: r.summary()["avg_act_s"] / base if base else None for p, r in results.items()
        }
    if stopped is not None:
        report["interrupted_during"] = stopped.policy
        # In the first policy: no row to print, but --out and --json say where it stopped.
        if results or args.json or args.out:
            _emit(report, args, rows=bool(results))
        raise stopped
    if plot is not None:
        from tangram.cli.plots import act_cdf

        try:
            Path(plot).parent.mkdir(parents=True, exist_ok=True)  # (as --out's)
            act_cdf(results, plot, title=_trace_name(args.trace))
            report["plot"] = plot
            note(f"wrote {plot}")
        except (OSError, ValueError) as e:  # the replays' figures stand without it
            why = e.strerror if isinstance(e, OSError) else str(e)
            note(f"tangram: warning: --plot: cannot write {plot}: {why}")
    _emit(report, args)
    return 0


def _plot_path(args: argparse.Namespace) -> str | None:
    """Where the ACT plot goes: ``--plot``, else beside the trace when that is a regular
    file (``--trace -`` or ``/dev/stdin`` has no folder of its own to put it in: a
    ``/dev/stdin.act.png`` is no place for it), else nowhere, with a note."""
    if args.no_plot:
        return None
    plot: str | None = args.plot
    if plot is None:
        if args.trace == STDIN or not Path(args.trace).is_file():
            where = "the standard input" if args.trace == STDIN else args.trace
            note(f"tangram: no plot: {where} is not a regular file to put it beside (--plot FILE)")
            return None
        plot = str(Path(args.trace).with_suffix(".act.png"))
    from tangram.cli.plots import check_plot

    try:
        check_plot(plot)
    except ValueError as e:
        raise InputError(f"--plot: {e}") from None
    check_writable(plot, "--plot")
    return plot


def _trace_name(trace: str) -> str:
    return "the standard input" if trace == STDIN else Path(trace).name


def run_round_bench(
    cases: Iterable[tuple[int, int, int, bool]] = DEFAULT_CASES,
    *,
    rounds: int = 200,
    progress: bool = True,
    gc_settings: str = "service",
    gpu_cases: Iterable[tuple[int, int]] = DEFAULT_GPU_CASES,
    quota_cases: Iterable[tuple[int, QuotaWaiting]] = DEFAULT_QUOTA_CASES,
) -> dict[str, Any]:
    """Round latency per case: p50/p99 over ``rounds`` timed rounds. ``cases``: exec
    actions on one node's cores; ``gpu_cases``: (GPUs, queued) service calls pooled on
    GPUs (``roundbench.measure_gpu``); ``quota_cases``: (queued, rule) calls waiting for
    an API quota under each ``quota_waiting`` rule (``roundbench.measure_quota``).

    ``gc_settings="service"`` sets the collector as the scheduler service does once it has
    started (``quiet_gc``), so the rounds are timed as they run there; "default" leaves
    Python's, whose full collections of the queue's objects set the p99 of large cases.
    """
    cases, gpu_cases, quota_cases = list(cases), list(gpu_cases), list(quota_cases)
    if gc_settings == "service":
        from tangram.service.embedded import quiet_gc

        quiet_gc()
    report: list[dict[str, Any]] = []
    gpu_report: list[dict[str, Any]] = []
    quota_report: list[dict[str, Any]] = []
    total = len(cases) + len(gpu_cases) + len(quota_cases)
    with bar("scheduler rounds", total, enabled=progress) as update:
        for i, (cores, queued, cands, elastic) in enumerate(cases):
            times = measure(Case(cores, queued, cands, elastic), rounds)
            report.append(
                {"cores": cores, "queued": queued, "candidates": cands, "elastic": elastic}
                | _latency(times)
            )
            update(i + 1, total)
        for i, (gpus, queued) in enumerate(gpu_cases, start=len(cases)):
            times = measure_gpu(GpuCase(gpus, queued), rounds)
            gpu_report.append({"gpus": gpus, "queued": queued} | _latency(times))
            update(i + 1, total)
        for i, (queued, rule) in enumerate(quota_cases, start=len(cases) + len(gpu_cases)):
            times = measure_quota(QuotaCase(queued, rule), rounds)
            quota_report.append({"queued": queued, "quota_waiting": rule} | _latency(times))
            update(i + 1, total)
    return {
        "cases": report,
        "gpu_cases": gpu_report,
        "quota_cases": quota_report,
        "depth": 2,
        "gc": gc_settings,
        "python": platform.python_version(),
    }


def _latency(seconds: list[float]) -> dict[str, Any]:
    ms = np.array(seconds) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "rounds": len(seconds),
    }


class ReplayInterrupted(Interrupted):
    """Ctrl-C during ``policy``'s replay: ``finished`` holds the policies replayed before."""

    def __init__(self, policy: str, finished: dict[str, SimResult]) -> None:
        done = ", ".join(finished) or "none"
        super().__init__(
            f"interrupted during {policy}; finished: {done}"
            + (" (their figures are above)" if finished else "")
        )
        self.policy, self.finished = policy, finished


def replay_all(
    trace: Any, cluster: Any, policies: list[str], *, seed: int, depth: int = 2
) -> dict[str, SimResult]:
    """Each policy's replay, in order; Ctrl-C raises :class:`ReplayInterrupted` with those
    that finished."""
    config = SchedulerConfig(depth=depth)
    results: dict[str, SimResult] = {}
    for policy in policies:
        try:
            with bar(f"replay {policy}", sum(len(t.steps) for t in trace)) as update:
                results[policy] = simulate(
                    trace, cluster, policy, seed=seed, config=config, progress=update
                )
        except (ValueError, RuntimeError) as e:
            raise InputError(f"policy {policy}: {e}") from None
        except KeyboardInterrupt:
            raise ReplayInterrupted(policy, results) from None
    return results


def _emit(report: dict[str, Any], args: argparse.Namespace, *, rows: bool = True) -> None:
    """Print the report, then write it to ``--out`` and its table beside it: a write that
    fails however --out was checked before leaves the printed report. ``rows`` False:
    no table is printed (a replay stopped before any policy finished has no row)."""
    failed = _print_report(report, args, rows=rows)
    if args.out:  # (also when the reader left: the file is what was asked for)
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise InputError(
                f"--out: cannot write {args.out}: {e.strerror} (the report is printed above)"
            ) from None
        note(f"wrote {args.out}")
        table = _markdown(report)
        if table is not None:
            write_table(args, table)
    if failed is _READER_LEFT:
        raise BrokenPipeError  # (main ends quietly, as for any reader gone)
    if failed is not None:
        written = f" ({args.out} is written)" if args.out else ""
        raise OutputError(f"cannot write the report to the standard output: {failed}{written}")


_READER_LEFT = "the reader left"  # (``| head``): told apart from a write that failed


def _print_report(report: dict[str, Any], args: argparse.Namespace, *, rows: bool) -> str | None:
    """Print the report; what failed (a full disk, ``> /dev/full``), or None. A reader that
    left (``| head``) is no failure to report: main ends quietly then."""
    try:
        if args.json:
            print(json.dumps(report))
        elif rows:
            _table(report)
        sys.stdout.flush()
    except BrokenPipeError:
        return _READER_LEFT
    except OSError as e:
        return e.strerror or str(e)
    return None


def _markdown(report: dict[str, Any]) -> str | None:
    """A ``*-seeds`` report's Markdown tables, as recorded in docs/benchmarks.md."""
    if "batches" in report:  # bench coding-seeds
        from tangram.cli.bench_seeds import render

        return render(report)
    if "mixed" in report:  # bench gpu-seeds
        from tangram.cli.bench_gpu_seeds import render as render_gpu

        return render_gpu(report)
    if "deepsearch" in report:  # bench search-seeds
        from tangram.cli.bench_search_seeds import render as render_search

        return render_search(report)
    return None


def _table(report: dict[str, Any]) -> None:
    from rich.table import Table

    # Off a terminal (a pipe, a CI log) rich would cut tables at 80 columns, where
    # policy names such as fixed-dop-4 and fixed-dop-16 become the same "fixed-d…".
    # (plain: a cell's text, a trace's or a policy's name, is printed as it is)
    console = plain_console() if sys.stdout.isatty() else plain_console(width=200)
    if "actions_per_s" in report or "vs_static" in report:
        return  # bench service and gpu-pool printed their lines already
    markdown = _markdown(report)
    if markdown is not None:  # the *-seeds benchmarks: their tables, as recorded in docs
        print(markdown, end="")
        return
    if "restore_fraction" in report:
        t = Table(title=f"restore bandwidth on {report['device']}")
        t.add_column("figure")
        t.add_column("value", justify="right")
        for k, v in report.items():
            if k != "device":
                t.add_row(k, str(v))
        console.print(t)
        return
    if "fast" in report:  # bench exec: Docker (fast and portable) or pods (fast)
        from tangram.cli.bench_exec import print_tables

        print_tables(report, console)
        return
    if "sizes" in report:  # bench files
        t = Table(title="files API against docker cp (median MB/s)")
        for col in ("MB", "upload", "docker cp in", "ratio", "download", "docker cp out", "ratio"):
            t.add_column(col, justify="right")
        keys = ("upload_mb_s", "docker_cp_in_mb_s", "upload_vs_docker_cp", "download_mb_s",
                "docker_cp_out_mb_s", "download_vs_docker_cp")  # fmt: skip
        for r in report["sizes"]:
            cells = [f"{r[k]:.2f}×" if k.endswith("cp") else f"{r[k]:.0f}" for k in keys]
            t.add_row(str(r["size_mb"]), *cells)
        console.print(t)
        tree = report["tree"]
        console.print(
            f"a directory of {tree['files']} files ({tree['mb']:.1f} MB), median s: "
            f"upload_dir {tree['upload_dir_s']:.3f} (docker cp {tree['docker_cp_in_s']:.3f}, "
            f"{tree['upload_vs_docker_cp']:.2f}×; one write per file "
            f"{tree['one_write_per_file_s']:.2f}, {tree['upload_vs_one_write_per_file']:.1f}×), "
            f"download_dir {tree['download_dir_s']:.3f} (docker cp "
            f"{tree['docker_cp_out_s']:.3f}, {tree['download_vs_docker_cp']:.2f}×)"
        )
        live = report["live"]
        console.print(
            f"streamed output, first byte: p50 {live['first_byte_p50_ms']:.1f} ms, max "
            f"{live['first_byte_max_ms']:.1f} ms (not streamed: {live['not_streamed_p50_ms']:.0f} "
            f"ms; a plain echo: {live['echo_p50_ms']:.1f} ms); docker cp of an empty file: "
            f"{report['docker_cp_empty_file_s'] * 1e3:.0f} ms"
        )
        return
    if "scenarios" in report:  # bench tenants
        t = Table(title="the steady tenant's queueing beside a flooding tenant")
        for col in ("scenario", "p50 (ms)", "p99 (ms)", "max (ms)", "p99 vs alone"):
            t.add_column(col, justify="left" if col == "scenario" else "right")
        for name, f in report["scenarios"].items():
            ratio = f["p99_vs_alone"]
            t.add_row(name, f"{f['queued_p50_s'] * 1e3:.1f}", f"{f['queued_p99_s'] * 1e3:.1f}",
                      f"{f['queued_max_s'] * 1e3:.1f}",
                      f"{ratio:.2f}×" if ratio is not None else "-")  # fmt: skip
        console.print(t)
        return
    if "cases" in report:
        tables: tuple[tuple[str, str, tuple[str, ...]], ...] = (
            ("scheduling round latency", "cases", ("cores", "queued", "candidates", "elastic")),
            ("... with pooled GPU services", "gpu_cases", ("gpus", "queued")),
            ("... with calls waiting for an API quota", "quota_cases", ("queued", "quota_waiting")),
        )
        for title, key, cols in tables:
            if not report.get(key):
                continue
            t = Table(title=title)
            for col in (*cols, "p50_ms", "p99_ms"):
                t.add_column(col, justify="right")
            for c in report[key]:
                t.add_row(
                    *(
                        f"{c[k]:.3f}" if isinstance(c[k], float) else str(c[k])
                        for k in (*cols, "p50_ms", "p99_ms")
                    )
                )
            console.print(t)
        return
    console.print(replay_table(report, console))
    sys.stdout.flush()


def replay_table(report: dict[str, Any], console: Any) -> Any:
    """A replay's figures, a row per policy. A policy's name is never cut (fixed-dop-4 and
    fixed-dop-16 would read the same): on a narrow terminal the headers break at their
    first underscore, then the figures fold."""
    from rich.table import Table

    cols = ("avg_act_s", "p99_act_s", "avg_traj_act_s", "makespan_s", "unit_seconds")
    names = list(report["policies"])

    def table(headers: tuple[str, ...]) -> Table:
        t = Table(title=f"{report['trajectories']} trajectories, {report['actions']} actions")
        t.add_column("policy", no_wrap=True, min_width=max(map(len, names), default=6))
        for header in headers:
            t.add_column(header, justify="right", overflow="fold")
        for p, s in report["policies"].items():
            t.add_row(p, *(f"{s[c]:.2f}" for c in cols))
        return t

    cells = [[f"{s[c]:.2f}" for c in cols] for s in report["policies"].values()]
    widths = [max(map(len, names), default=6)] + [
        max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(cols)
    ]
    if sum(w + 3 for w in widths) + 1 <= console.width:  # (padding and a border each)
        return table(cols)
    return table(tuple(c.replace("_", "_\n", 1) for c in cols))
