"""``tangram bench search-seeds``: DeepSearch's managed quotas against unmanaged calls over
trace seeds, and how good the clients' remaining-steps hints must be.

The target (quota scale 1.0): a managed mean ACT no higher than unmanaged calls', a lower
p99 and no failed action. In this closed loop the mean is set by when trajectories end,
so what decides it is the order in which the bottleneck quota serves them
(docs/benchmarks.md, DeepSearch); the margins are a few percent, hence many seeds. The
hinted policies differ only in the hints' lognormal sigma (0: exact).

Replays are independent and deterministic; they run in parallel processes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tangram.cli.seed_runs import check_out, header, header_line, numbers, run_jobs
from tangram.sim.policies import HINT_SIGMA, simulate
from tangram.sim.tracegen import generate, scenario_cluster

BASELINE = "unmanaged"
HINT_SIGMAS = (0.0, 0.3, HINT_SIGMA, 0.9, 1.2)
HINTED = tuple(f"elastic-shortest-hinted-{s:g}" for s in HINT_SIGMAS)
MANAGED = ("elastic", "elastic-shortest", *HINTED)
BATCHES = (512, 2048)
SEEDS = tuple(range(9))

Job = tuple[int, int, str]  # batch, seed, policy


def _replay(job: Job) -> dict[str, float]:
    batch, seed, policy = job
    trace = generate("deepsearch", batch, seed)
    s = simulate(trace, scenario_cluster("deepsearch"), policy, seed=seed).summary()
    return {k: float(s[k]) for k in ("avg_act_s", "p99_act_s", "failed")}


def run_search_seeds_bench(args: argparse.Namespace) -> dict[str, Any]:
    check_out(args)
    batches = numbers(args.batches, BATCHES, "batches", least=1)
    seeds = numbers(args.seeds, SEEDS, "seeds", least=0)
    policies = (BASELINE, *MANAGED)
    jobs: list[Job] = [(b, s, p) for b in batches for s in seeds for p in policies]
    started = time.perf_counter()
    got = run_jobs(_replay, jobs, args.jobs, _progress)
    report: dict[str, Any] = {
        **header(args, "search-seeds", started),
        "quota_scale": 1.0,
        "hint_sigmas": dict(zip(HINTED, HINT_SIGMAS, strict=True)),
        "deepsearch": {
            str(b): _batch({s: {p: got[(b, s, p)] for p in policies} for s in seeds})
            for b in batches
        },
    }
    return report


def _progress(job: Job, got: dict[str, float]) -> str:
    return (
        f"deepsearch batch {job[0]} seed {job[1]} {job[2]}: "
        f"avg ACT {got['avg_act_s']:.2f} s, p99 {got['p99_act_s']:.1f} s"
    )


def _meets(managed: dict[str, float], baseline: dict[str, float]) -> bool:
    return (
        managed["failed"] == 0
        and managed["avg_act_s"] <= baseline["avg_act_s"]
        and managed["p99_act_s"] < baseline["p99_act_s"]
    )


def _batch(by_seed: dict[int, dict[str, dict[str, float]]]) -> dict[str, Any]:
    meets = {
        seed: {p: _meets(row[p], row[BASELINE]) for p in MANAGED} for seed, row in by_seed.items()
    }
    seeds = {
        str(seed): {
            "avg_act_s": {p: round(r["avg_act_s"], 3) for p, r in row.items()},
            "p99_act_s": {p: round(r["p99_act_s"], 1) for p, r in row.items()},
            "failed": {p: int(r["failed"]) for p, r in row.items()},
            "meets": meets[seed],
        }
        for seed, row in by_seed.items()
    }
    summary: dict[str, Any] = {}
    for p in MANAGED:
        mean = [row[p]["avg_act_s"] / row[BASELINE]["avg_act_s"] for row in by_seed.values()]
        p99 = [row[p]["p99_act_s"] / row[BASELINE]["p99_act_s"] for row in by_seed.values()]
        summary[p] = {
            "met": sum(m[p] for m in meets.values()),
            "of": len(by_seed),
            "mean_vs_unmanaged": {"min": round(min(mean), 4), "max": round(max(mean), 4)},
            "p99_vs_unmanaged": {"min": round(min(p99), 4), "max": round(max(p99), 4)},
        }
    return {"seeds": seeds, "policies": summary}


def _label(report: dict[str, Any], policy: str) -> str:
    sigma = report["hint_sigmas"].get(policy)
    return policy if sigma is None else f"hinted, σ {sigma:g}"


def render(report: dict[str, Any]) -> str:
    """The report as Markdown tables, as recorded in docs/benchmarks.md."""
    lines = [
        header_line(report),
        "",
        f"DeepSearch at quota scale {report['quota_scale']:g}: points where the policy's mean "
        "ACT is ≤ unmanaged calls', its p99 below theirs and no action failed, and the ratios "
        "to unmanaged over the seeds (hinted: `elastic-shortest-hinted-S`, the clients' "
        "remaining-steps hints off by a lognormal factor of sigma S).",
        "",
        "| batch | policy | points met | mean / unmanaged | p99 / unmanaged |",
        "|---|---|---|---|---|",
    ]
    for batch, v in report["deepsearch"].items():
        for p, s in v["policies"].items():
            mean, p99 = s["mean_vs_unmanaged"], s["p99_vs_unmanaged"]
            lines.append(
                f"| {batch} | {_label(report, p)} | **{s['met']} of {s['of']}** | "
                f"{mean['min']:.3f}–{mean['max']:.3f} | {p99['min']:.2f}–{p99['max']:.2f} |"
            )
    policies = [BASELINE, *MANAGED]
    lines += [
        "",
        "Each point: avg / p99 ACT (s); ✗ where the policy misses the target there.",
        "",
        "| batch | seed | " + " | ".join(_label(report, p) for p in policies) + " |",
        "|---|---|" + "---|" * len(policies),
    ]
    for batch, v in report["deepsearch"].items():
        for seed, row in v["seeds"].items():
            cells = [
                f"{row['avg_act_s'][p]:.2f} / {row['p99_act_s'][p]:.0f}"
                + ("" if p == BASELINE or row["meets"][p] else " ✗")
                for p in policies
            ]
            lines.append(f"| {batch} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
