"""A GRPO-shaped rollout step against a running ARL-Tangram service.

N trajectories run concurrently in a closed loop: "think" (the LLM generating, simulated
by a sleep), then one action, until each has taken its steps; then the step's ACT
statistics are printed per action kind, split into queueing, system overhead and
execution. Start the service first (`make run`), then:

    python examples/rollout.py                   # 16 trajectories x 6 steps
    python examples/rollout.py -n 64 --steps 10 --think 0.2

What it runs: its defaults fit the pool of `make run` (manifests/examples/local). Each
trajectory opens the TrajectoryEnv --env (`sandbox`); its steps run `sh -c 'echo step N'`
under the profile --shell-profile (`shell`: one that takes the request's command, so the
image needs `sh`), every third step leases and releases a unit of the API quota --api
(`search`; no request is made), and its last step runs the profile --tests-profile
(`tests`: one with a command of its own, elastic). Another pool names its own: `tangram
up` prints the flags its pool needs, or read its TrajectoryEnv's spec.actions and the
ActionPool's spec.apis.
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
    ActionTimeoutError,
    AsyncClient,
    CallTimeoutError,
    ServiceUnreachableError,
    StreamClosedError,
    TangramError,
    TooManyOpenFilesError,
)

# What a rollout worker reports rather than crashes on: the service's answers, the service
# out of reach, a stream cut off, the client's own timeouts, this process out of descriptors.
CLIENT_ERRORS = (
    TangramError,
    ServiceUnreachableError,
    StreamClosedError,
    ActionTimeoutError,
    CallTimeoutError,
    TooManyOpenFilesError,
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
            if args.tests_profile and step == args.steps - 1:  # the (elastic) test suite
                kind, r = "tests", await t.exec(profile=args.tests_profile)
            elif args.api and step % 3 == 2:  # a metered API call: lease, call, release
                kind, r = "api", await client.lease(args.api)
                if r.lease:
                    await client.release(r.lease)
            else:  # a one-core shell command
                command = ["sh", "-c", f"echo step {step}"]
                if args.shell_profile:
                    r = await t.exec(profile=args.shell_profile, args=command)
                else:
                    r = await t.exec(command)
                kind = "shell"
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
    p.add_argument("--env", default="sandbox", help="TrajectoryEnv to open (default: %(default)s)")
    p.add_argument(
        "-n", "--trajectories", type=int, default=16, help="trajectories at once (default: 16)"
    )
    p.add_argument("--steps", type=int, default=6, help="actions a trajectory (default: 6)")
    p.add_argument(
        "--think", type=float, default=0.05, help="mean think time, seconds (default: 0.05)"
    )
    p.add_argument(
        "--shell-profile",
        default="shell",
        help="the env's profile for the shell steps, one taking the request's command "
        "('' for none: the env's default demand) (default: %(default)s)",
    )
    p.add_argument(
        "--tests-profile",
        default="tests",
        help="the env's profile for the last step, one with its own command ('' for none: "
        "a shell step) (default: %(default)s)",
    )
    p.add_argument(
        "--api", default="search", help="API quota to lease ('' for none) (default: %(default)s)"
    )
    args = p.parse_args()
    out: dict[str, list[ActionResult]] = defaultdict(list)
    failed: list[BaseException] = []
    t0 = time.perf_counter()
    try:
        # The task group cancels the other trajectories at the first error and waits for
        # each to close before the client does: none is left open.
        async with AsyncClient(args.url) as client, asyncio.TaskGroup() as group:
            for i in range(args.trajectories):
                group.create_task(trajectory(client, i, args, out))
    except* CLIENT_ERRORS as errors:
        failed.extend(errors.exceptions)
    if failed:
        print(f"rollout: {failed[0]}", file=sys.stderr)
        return 1
    report(out, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
