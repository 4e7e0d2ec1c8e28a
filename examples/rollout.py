"""A GRPO-shaped rollout step against a running ARL-Tangram service.

N trajectories run concurrently in a closed loop: "think" (the LLM generating, simulated
by a sleep), then one action, until each has taken its steps; then the step's ACT
statistics are printed per action kind, split into queueing, system overhead and
execution. Start the service first (`make run`), then:

    python examples/rollout.py                   # 16 trajectories x 6 steps
    python examples/rollout.py -n 64 --steps 10 --think 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import defaultdict

from tangram.client import (
    ActionResult,
    ActionStatus,
    AsyncClient,
    ServiceUnreachableError,
    TangramError,
)


async def trajectory(
    client: AsyncClient, i: int, args: argparse.Namespace, out: dict[str, list[ActionResult]]
) -> None:
    rng = random.Random(i)
    labels = {"rollout": "example", "index": str(i)}
    # expected_steps: what the trajectory orderings of a pool read (docs/scheduler.md).
    async with client.trajectory(args.env, labels=labels, expected_steps=args.steps) as t:
        for step in range(args.steps):
            await asyncio.sleep(rng.expovariate(1 / args.think) if args.think > 0 else 0)
            if step == args.steps - 1:  # the last step runs the (elastic) test suite
                kind, r = "tests", await t.exec(profile="tests")
            elif args.api and step % 3 == 2:  # a metered API call: lease, call, release
                kind, r = "api", await client.lease(args.api)
                if r.lease:
                    await client.release(r.lease)
            else:  # a one-core shell command
                kind, r = (
                    "shell",
                    await t.exec(profile="shell", args=["sh", "-c", f"echo step {step}"]),
                )
            out[kind].append(r)
            if r.status is not ActionStatus.OK:
                print(f"trajectory {t.id} step {step}: {r.status.value} {r.error}", file=sys.stderr)


def report(out: dict[str, list[ActionResult]], wall: float) -> None:
    total = sum(len(v) for v in out.values())
    print(f"{total} actions in {wall:.1f} s ({total / wall:.1f} actions/s)")
    heads = ("ACT p50", "ACT p99", "queued", "overhead", "exec")
    head = " ".join(f"{h:>9}" for h in heads)
    print(f"{'kind':8} {'n':>5} {head}  (ms, means but p50/p99)")
    for kind, rs in sorted(out.items()):
        act = sorted(r.timings.act_s * 1e3 for r in rs)
        p99 = act[min(len(act) - 1, int(0.99 * len(act)))]
        means = [
            statistics.fmean(getattr(r.timings, f) * 1e3 for r in rs)
            for f in ("queued_s", "overhead_s", "exec_s")
        ]
        cells = [statistics.median(act), p99, *means]
        print(f"{kind:8} {len(rs):5d} " + " ".join(f"{c:9.2f}" for c in cells))
    dops = [r.allocation.dop for r in out.get("tests", [])]
    if dops:
        print(f"tests ran with DoP {dict(sorted((d, dops.count(d)) for d in set(dops)))}")


async def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="service URL (default: TANGRAM_URL or http://127.0.0.1:8080)")
    p.add_argument("--env", default="sandbox", help="TrajectoryEnv to open")
    p.add_argument("-n", "--trajectories", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--think", type=float, default=0.05, help="mean think time, seconds")
    p.add_argument("--api", default="search", help="API quota to lease ('' for none)")
    args = p.parse_args()
    out: dict[str, list[ActionResult]] = defaultdict(list)
    t0 = time.perf_counter()
    try:
        async with AsyncClient(args.url) as client:
            await asyncio.gather(
                *(trajectory(client, i, args, out) for i in range(args.trajectories))
            )
    except (TangramError, ServiceUnreachableError) as e:
        print(f"rollout: {e}", file=sys.stderr)
        return 1
    report(out, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
