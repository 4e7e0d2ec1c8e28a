"""``tangram bench coding-seeds``: the coding replay over batches *and* trace seeds.

A user's trace is neither of the ones the docs were tuned on, so one seed proves little:
every batch is replayed on several generated traces, each under the elastic policies and
the fixed-DoP baselines, and the report gives each seed's ratio and the spread across
seeds. Replays are independent and deterministic; they run in parallel processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tangram.cli.seed_runs import check_out, header, header_line, numbers, run_jobs
from tangram.scheduler.core.scheduler import SchedulerConfig
from tangram.sim.policies import simulate
from tangram.sim.tracegen import generate, scenario_cluster

# elastic: the default core price (arrivals); elastic-load: without the return term
POLICIES = (
    "elastic",
    "elastic-load",
    "elastic-paper",
    "fixed-dop-4",
    "fixed-dop-16",
    "k8s-static",
    "k8s-static-cp",  # pods bound at the kube-scheduler's rate (docs/simulator.md)
)
BATCHES = (128, 256, 512, 768, 1024, 1280, 1536, 2048)
SEEDS = (0, 1, 2)
BASELINES = ("fixed-dop-4", "fixed-dop-16")  # the target: elastic <= 0.95x the better one
KEPT = ("avg_act_s", "p99_act_s", "avg_traj_act_s")


def _replay(job: tuple[int, int, str]) -> dict[str, float]:
    batch, seed, policy = job
    trace = generate("coding", batch, seed)
    result = simulate(
        trace, scenario_cluster("coding"), policy, seed=seed, config=SchedulerConfig()
    )
    summary = result.summary()
    return {k: float(summary[k]) for k in KEPT}


def run_seeds_bench(args: argparse.Namespace) -> dict[str, Any]:
    check_out(args)
    batches = numbers(args.batches, BATCHES, "batches", least=1)
    seeds = numbers(args.seeds, SEEDS, "seeds", least=0)
    jobs = [(b, s, p) for b in batches for s in seeds for p in POLICIES]
    started = time.perf_counter()
    got = run_jobs(
        _replay,
        jobs,
        args.jobs,
        lambda job, r: f"batch {job[0]} seed {job[1]} {job[2]}: avg ACT {r['avg_act_s']:.3f} s",
    )
    rows: dict[int, dict[int, dict[str, dict[str, float]]]] = {}
    for (b, s, p), figures in got.items():
        rows.setdefault(b, {}).setdefault(s, {})[p] = figures
    report: dict[str, Any] = {
        **header(args, "coding-seeds", started),
        "policies": list(POLICIES),
        "batches": {str(b): _batch(rows[b], seeds) for b in batches},
    }
    return report


def _batch(
    by_seed: dict[int, dict[str, dict[str, float]]], seeds: tuple[int, ...]
) -> dict[str, Any]:
    per_seed: dict[str, dict[str, Any]] = {}
    ratios: list[float] = []
    for s in seeds:
        row = by_seed[s]
        elastic = row["elastic"]["avg_act_s"]
        best = min(row[p]["avg_act_s"] for p in BASELINES)
        ratios.append(round(elastic / best, 4))
        per_seed[str(s)] = {
            "avg_act_s": {p: round(row[p]["avg_act_s"], 4) for p in POLICIES},
            "elastic_vs_best_fixed": ratios[-1],
            "elastic_vs_paper_rule": round(elastic / row["elastic-paper"]["avg_act_s"], 4),
            "load_vs_best_fixed": round(row["elastic-load"]["avg_act_s"] / best, 4),
            "k8s_static_over_elastic": round(row["k8s-static"]["avg_act_s"] / elastic, 3),
            "k8s_cp_over_elastic": round(row["k8s-static-cp"]["avg_act_s"] / elastic, 3),
        }
    return {
        "seeds": per_seed,
        "elastic_vs_best_fixed": {
            "min": min(ratios),
            "median": statistics.median(ratios),
            "max": max(ratios),
        },
    }


def render(report: dict[str, Any]) -> str:
    """The report as a Markdown table: one row per batch, each seed's ratio and the spread."""
    lines = [
        header_line(report),
        "",
        "avg ACT per action, s: elastic (core price `arrivals`, the default) / elastic-load "
        "(core price `load`) / elastic-paper / fixed-dop-4 / fixed-dop-16; ratio = "
        "elastic / the better fixed DoP (target ≤ 0.95), and elastic-load / it; "
        "k8s = k8s-static / elastic; k8s cp = k8s-static-cp (pods bound at the "
        "kube-scheduler's rate) / elastic.",
        "",
        "| batch | seed | elastic | elastic-load | elastic-paper | fixed-dop-4 | "
        "fixed-dop-16 | ratio | load ratio | k8s | k8s cp |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, row in report["batches"].items():
        for seed, v in row["seeds"].items():
            act = v["avg_act_s"]
            lines.append(
                f"| {batch} | {seed} | {act['elastic']:.3f} | {act['elastic-load']:.3f} | "
                f"{act['elastic-paper']:.3f} | "
                f"{act['fixed-dop-4']:.3f} | {act['fixed-dop-16']:.3f} | "
                f"**{v['elastic_vs_best_fixed']:.3f}** | {v['load_vs_best_fixed']:.3f} | "
                f"{v['k8s_static_over_elastic']:.2f}× | {v['k8s_cp_over_elastic']:.2f}× |"
            )
        spread = row["elastic_vs_best_fixed"]
        lines.append(
            f"| {batch} | spread | | | | | | {spread['min']:.3f}–{spread['max']:.3f} "
            f"(median {spread['median']:.3f}) | | | |"
        )
    return "\n".join(lines) + "\n"
