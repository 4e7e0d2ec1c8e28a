"""``tangram bench gpu-seeds``: pooled GPUs against static deployments over trace seeds.

Two questions, each over several generated traces so that one lucky seed proves nothing:

- MOPD (9 teachers, 40 GPUs): the pooled calls' average ACT and GPU-seconds against
  static TP-4 deployments, both batching up to ``max_calls`` calls an instance, and the
  pooled side without batching (``elastic-unbatched``).
- MOPD + DeepSearch (10 services): the fewest pooled GPUs whose average service-call ACT
  is no worse than static deployments on all 40.

A restore costs ``--restore-fixed-s`` + GB / DoP / ``--restore-gbps`` (the generator's
assumption by default; ``tangram bench gpu`` measures a GPU's bandwidth).

Replays are independent and deterministic; they run in parallel processes.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Any

from tangram.cli.files import InputError
from tangram.cli.paper import with_gpus
from tangram.cli.seed_runs import check_out, header, header_line, numbers, run_jobs
from tangram.sim.policies import simulate
from tangram.sim.tracegen import RESTORE_FIXED_S, RESTORE_GBPS, generate, scenario_cluster

MOPD_POLICIES = ("elastic", "elastic-unbatched", "static-gpu")
BATCHES = (1024, 2048)
SEEDS = (0, 1, 2)
MIXED_GPUS = (2, 3, 4, 5, 6, 8)
STATIC_GPUS = 40
METRIC = "avg_act_service_s"

Job = tuple[str, int, int, str, int | None]  # scenario, batch, seed, policy, pooled GPUs


def _replay(
    job: Job, restore_gbps: float = RESTORE_GBPS, restore_fixed_s: float = RESTORE_FIXED_S
) -> dict[str, float]:
    scenario, batch, seed, policy, gpus = job
    cluster = scenario_cluster(scenario, restore_gbps=restore_gbps, restore_fixed_s=restore_fixed_s)
    if gpus is not None:
        cluster = with_gpus(cluster, gpus)
    summary = simulate(generate(scenario, batch, seed), cluster, policy, seed=seed).summary()
    return {METRIC: float(summary[METRIC]), "gpu_s": float(summary["unit_seconds_service"])}


def run_gpu_seeds_bench(args: argparse.Namespace) -> dict[str, Any]:
    check_out(args)
    batches = numbers(args.batches, BATCHES, "batches", least=1)
    seeds = numbers(args.seeds, SEEDS, "seeds", least=0)
    jobs: list[Job] = [
        ("mopd", b, s, p, None) for b in batches for s in seeds for p in MOPD_POLICIES
    ]
    mixed_batch = args.mixed_batch
    jobs += [("mixed", mixed_batch, s, "static-gpu", None) for s in seeds]
    jobs += [("mixed", mixed_batch, s, "elastic", g) for s in seeds for g in MIXED_GPUS]
    if not math.isfinite(args.restore_fixed_s):
        raise InputError(f"--restore-fixed-s: {args.restore_fixed_s} is not a finite number")
    restore = {"restore_gbps": args.restore_gbps, "restore_fixed_s": args.restore_fixed_s}
    started = time.perf_counter()
    got = run_jobs(functools.partial(_replay, **restore), jobs, args.jobs, _progress)
    mopd = {
        str(b): {
            str(s): _mopd_row({p: got[("mopd", b, s, p, None)] for p in MOPD_POLICIES})
            for s in seeds
        }
        for b in batches
    }
    mixed = {str(s): _mixed_row(mixed_batch, s, got) for s in seeds}
    report: dict[str, Any] = {
        **header(
            args,
            "gpu-seeds",
            started,
            mixed_batch=(mixed_batch, 1024),
            restore_gbps=(args.restore_gbps, RESTORE_GBPS),
            restore_fixed_s=(args.restore_fixed_s, RESTORE_FIXED_S),
        ),
        "restore": {"gbps": args.restore_gbps, "fixed_s": args.restore_fixed_s},
        "mopd": mopd,
        "mixed": {"batch": mixed_batch, "seeds": mixed},
    }
    return report


def _progress(job: Job, got: dict[str, float]) -> str:
    where = f" on {job[4]} GPUs" if job[4] is not None else ""
    return f"{job[0]} batch {job[1]} seed {job[2]} {job[3]}{where}: service ACT {got[METRIC]:.3f} s"


def _mopd_row(row: dict[str, dict[str, float]]) -> dict[str, Any]:
    static = row["static-gpu"]
    return {
        "service_act_s": {p: round(r[METRIC], 4) for p, r in row.items()},
        "gpu_s": {p: round(r["gpu_s"], 1) for p, r in row.items()},
        "act_vs_static": round(row["elastic"][METRIC] / static[METRIC], 4),
        "gpu_s_vs_static": round(row["elastic"]["gpu_s"] / static["gpu_s"], 4),
    }


def _mixed_row(batch: int, seed: int, got: dict[Job, dict[str, float]]) -> dict[str, Any]:
    static = got[("mixed", batch, seed, "static-gpu", None)][METRIC]
    pooled = {g: got[("mixed", batch, seed, "elastic", g)][METRIC] for g in MIXED_GPUS}
    enough = [g for g in MIXED_GPUS if pooled[g] <= static]
    return {
        "static_40_s": round(static, 3),
        "pooled_s": {str(g): round(v, 3) for g, v in pooled.items()},
        "fewest_gpus_matching_static": enough[0] if enough else None,
    }


def render(report: dict[str, Any]) -> str:
    """The report as Markdown tables, as recorded in docs/benchmarks.md."""
    lines = [
        header_line(report),
        "",
        "MOPD, 40 GPUs: avg service-call ACT (s) and GPU-seconds; ratios = elastic / static-gpu "
        "(targets: ACT ≤ 1, GPU-seconds ≤ 0.5).",
        "",
        "| batch | seed | elastic | elastic-unbatched | static-gpu | ACT ratio | "
        "elastic GPU-s | static GPU-s | GPU-s ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, by_seed in report["mopd"].items():
        for seed, v in by_seed.items():
            act, gpu = v["service_act_s"], v["gpu_s"]
            lines.append(
                f"| {batch} | {seed} | {act['elastic']:.3f} | {act['elastic-unbatched']:.2f} | "
                f"{act['static-gpu']:.3f} | **{v['act_vs_static']:.3f}** | "
                f"{gpu['elastic']:.0f} | {gpu['static-gpu']:.0f} | **{v['gpu_s_vs_static']:.3f}** |"
            )
    m = report["mixed"]
    gpus = list(next(iter(m["seeds"].values()))["pooled_s"])
    lines += [
        "",
        f"MOPD + DeepSearch (10 services), batch {m['batch']}: avg service-call ACT (s) of "
        f"static-gpu on {STATIC_GPUS} GPUs and pooled on fewer; the fewest matching static "
        "(target ≤ 30 % of 40, i.e. ≤ 12).",
        "",
        "| seed | static on 40 | " + " | ".join(f"pooled on {g}" for g in gpus) + " | fewest |",
        "|---|---|" + "---|" * len(gpus) + "---|",
    ]
    for seed, v in m["seeds"].items():
        fewest = v["fewest_gpus_matching_static"]
        cells = " | ".join(f"{v['pooled_s'][g]:.2f}" for g in gpus)
        share = f"**{fewest}** ({fewest / STATIC_GPUS:.1%})" if fewest else "none"
        lines.append(f"| {seed} | {v['static_40_s']:.2f} | {cells} | {share} |")
    return "\n".join(lines) + "\n"
