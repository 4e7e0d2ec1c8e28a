"""``tangram trace generate``: synthetic traces of the paper's workloads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tangram.cli.files import InputError, check_writable, dump_cluster, whole_number
from tangram.sim.tracegen import SCENARIOS, generate, scenario_cluster


def register(sub: Any) -> None:
    p = sub.add_parser("trace", help="generate synthetic traces")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    g = tsub.add_parser(
        "generate",
        help="write a JSON Lines trace for one of the paper's workloads",
        description="Write one RL step of a paper workload as a trace, JSON Lines, one "
        "trajectory a line, and with --cluster-out the cluster file it replays on: both "
        "formats, every field with its unit, in docs/simulator.md, 'Trace and cluster "
        "files'. Parameters and their sources: docs/trace-generator.md.",
    )
    g.add_argument("--scenario", required=True, choices=SCENARIOS)
    g.add_argument(
        "--trajectories", type=whole_number(1), required=True, help="batch size (trajectories)"
    )
    g.add_argument(
        "--seed",
        type=whole_number(0),
        default=0,
        help="the generator's random seed: the same seed, scenario and size give the same trace",
    )
    g.add_argument("--out", "-o", help="trace file (default: stdout)")
    g.add_argument(
        "--cluster-out",
        help="also write the scenario's paper cluster as YAML (the cluster file of "
        "tangram bench --cluster)",
    )
    g.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Both paths are checked before either is written: no trace left behind without the
    # cluster it was asked with.
    outs = [
        (flag, path)
        for flag, path in (("--out", args.out), ("--cluster-out", args.cluster_out))
        if path
    ]
    for flag, path in outs:
        check_writable(path, flag, parents=False)
    if len(outs) == 2 and Path(args.out).resolve() == Path(args.cluster_out).resolve():
        raise InputError(f"--cluster-out: {args.cluster_out} is the --out file too")
    trajs = generate(args.scenario, args.trajectories, args.seed)
    lines = "".join(t.model_dump_json(exclude_defaults=True) + "\n" for t in trajs)
    if args.out:
        _write("--out", args.out, lines)
    else:
        sys.stdout.write(lines)
    if args.cluster_out:
        _write("--cluster-out", args.cluster_out, dump_cluster(scenario_cluster(args.scenario)))
    return 0


def _write(flag: str, path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise InputError(f"{flag}: cannot write {path}: {e.strerror}") from None
