"""``tangram bench gpu-pool``: reward services pooled on shared GPUs against one static GPU
per service, for the same calls (seed 000 §5.3, the comparison behind its MOPD figures).

Both sides run the real system in this process: the scheduler service over HTTP, a node
agent with the GPU role and the PyTorch worker, the real ``AsyncClient``. The calls are one
open-loop trace replayed against each setup:

- ``static``: one deployment per service, as today: a scheduler and an agent with one
  device each, the service made resident before the trace starts and never evicted.
- ``pooled-<G>``: one scheduler, one agent with G devices for all services; every call
  gets a device from the elastic algorithm, its service is restored there unless resident,
  LRU eviction makes room (each device holds ``--per-device`` services at most).

The trace follows the shape of multi-teacher distillation: rounds of rollouts, in each a
changing subset of the services (the domains of that batch) called in a burst as
trajectories finish. A call's compute is modeled by default (``--compute timed``: it
sleeps its milliseconds, on the device's thread) so the figures show what pooling changes:
queueing, restores, evictions; restores are real copies of the service's weights. With
``--compute decode`` it is real: each call decodes a number of steps through the model's
layers (``--compute-ms`` at one row, measured on the device before the trace), and with
``--batch N`` both sides run up to N calls of a service at once on its instance, sharing
forward passes (a RewardService's ``batching.maxCalls``), as a deployment batches; static
deployments then run one after another, each alone on the device and the host, as each
would on its own GPU. With CUDA
(``--devices auto`` finds it) the agents serve real devices (``--gpus cuda:I,...``): the
pooled sides need that many, and static deployments share them round-robin when there are
fewer than services, which leaves their figures alone (after the warm-up they never
restore, and their compute is modeled). Without CUDA the devices are CPU-backed (``--gpus
cpu:N``). The report says which.

GPU-seconds: ``held`` is devices × the run's span (what a deployment pays for);
``busy`` is, summed over the devices, the time some call was restoring or computing there
(each call's span taken back from its answer's arrival; calls sharing passes count once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tangram.api.wire import ActionResult, ActionStatus, ServiceDef
from tangram.cli.bench_agent import serving
from tangram.cli.files import InputError
from tangram.cli.progress import note
from tangram.cli.up import run_loop
from tangram.client import AsyncClient
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.gpu_batching import MAX_CALLS
from tangram.node_agent.gpu_service import GpuOptions
from tangram.scheduler.core.config import SchedulerConfig
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import PoolConfig, ServiceConfig
from tangram.service.embedded import Running

LAYER_MB = 32  # one layer of the bench model (tangram.node_agent.gpu_bench.WIDTH² fp16)
HEADROOM = 1.25  # a service's gpuMemoryGiB over its weights: activations, workspace


@dataclass(frozen=True, slots=True)
class Call:
    at_s: float  # from the start of the trace
    service: str
    compute_ms: float


@dataclass(frozen=True, slots=True)
class Answered:
    call: Call
    result: ActionResult
    setup: str  # the scheduler that ran it: its devices are its own
    end_s: float  # when its answer arrived, from the start of the trace


def call_trace(
    services: Sequence[str],
    *,
    rounds: int,
    round_s: float,
    burst: int,
    compute_ms: float,
    active: float,
    seed: int,
) -> list[Call]:
    """Rounds of ``round_s``; in each, every service is in the batch's mix with probability
    ``active`` (at least one is), and each one in it gets a Poisson(``burst``) number of
    calls spread uniformly over the first 60 % of the round (trajectories finishing), each
    with a lognormal compute time of median ``compute_ms``. Deterministic in ``seed``."""
    if not services:
        raise ValueError("no services")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    calls: list[Call] = []
    for r in range(rounds):
        mix = [s for s in services if rng.random() < active] or [rng.choice(list(services))]
        for s in mix:
            for _ in range(int(np_rng.poisson(burst))):
                at = r * round_s + rng.uniform(0, 0.6 * round_s)
                ms = compute_ms * float(np.exp(np_rng.normal(0.0, 0.3)))
                calls.append(Call(round(at, 4), s, round(ms, 2)))
    return sorted(calls, key=lambda c: c.at_s)


@dataclass(frozen=True, slots=True)
class Setup:
    """One scheduler + agent: the services it serves on its devices."""

    name: str
    services: tuple[ServiceConfig, ...]
    devices: int
    cuda: tuple[int, ...] = ()  # the CUDA devices it serves; none: CPU-backed devices
    scheduling: SchedulerConfig = field(default_factory=SchedulerConfig)


async def _serve(
    setup: Setup, tmp: Path, per_device_mib: int, stack: AsyncExitStack
) -> tuple[Running, str]:
    user, agent_token = secrets.token_hex(16), secrets.token_hex(16)
    tokens = TokenStore({user: "bench", agent_token: AGENT_TENANT})
    agent = NodeAgent.create(
        tmp / setup.name,
        node=setup.name,
        runtime="noop",
        cores_for_actions=1,
        gpus=GpuOptions("cuda", per_device_mib, setup.cuda)
        if setup.cuda
        else GpuOptions(f"cpu:{setup.devices}", per_device_mib),
    )
    config = PoolConfig(
        name=setup.name,
        services={s.spec.name: s for s in setup.services},
        scheduling=setup.scheduling,
    )
    running = await stack.enter_async_context(
        serving(config, tokens, agent, what=f"gpu-pool ({setup.name})")
    )
    await _until_loaded(running, [s.spec.name for s in setup.services])
    return running, user


async def _until_loaded(running: Running, services: list[str], timeout_s: float = 300) -> None:
    """Until the agent has read every service's weights into host memory (at start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loaded = running.engine.gpu.loads.values()
        states = {s: load for loads in loaded for s, load in loads.items()}
        failed = {s: load.error for s, load in states.items() if not load.ok}
        if failed:
            raise InputError(f"bench gpu-pool: services failed to load: {failed}")
        if set(states).issuperset(services):
            return
        if time.monotonic() > deadline:
            raise InputError(f"bench gpu-pool: services not loaded after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def _replay(
    clients: dict[str, tuple[str, AsyncClient]],
    calls: list[Call],
    checks: dict[str, float],
    step_s: float | None,
) -> tuple[list[Answered], float]:
    """Submit each call at its time (open loop); the results and the span, first arrival
    to last completion. Every answer must carry its own service's checksum: a call that
    ran on another model's weights (a residency bug) stops the bench. ``step_s``: calls
    decode ``compute_ms`` worth of steps of that many seconds (None: modeled compute)."""
    out: list[Answered] = []
    start = time.perf_counter()
    end = start

    async def one(c: Call) -> None:
        nonlocal end
        await asyncio.sleep(max(0.0, start + c.at_s - time.perf_counter()))
        setup, client = clients[c.service]
        work = c.compute_ms if step_s is None else max(1, round(c.compute_ms / 1000 / step_s))
        r = await client.score(c.service, [work], input_size=1)
        if r.status != ActionStatus.OK:
            raise InputError(f"bench gpu-pool: a call of {c.service} ended {r.status}: {r.error}")
        if r.output != [checks[c.service]]:
            raise InputError(
                f"bench gpu-pool: a call of {c.service} ran on other weights "
                f"(answered {r.output}, its model's checksum is {checks[c.service]})"
            )
        now = time.perf_counter()
        out.append(Answered(c, r, setup, now - start))
        end = max(end, now)

    await asyncio.gather(*(one(c) for c in calls))
    return out, end - start


def busy_seconds(answers: list[Answered]) -> float:
    """Summed over devices, the time some call restored or computed there: the union of
    the calls' spans, each taken back from its answer's arrival (calls sharing a pass
    overlap and count once)."""
    spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for a in answers:
        t = a.result.timings
        for gpu in a.result.allocation.gpus:
            spans.setdefault((a.setup, gpu), []).append((a.end_s - t.restore_s - t.exec_s, a.end_s))
    total = 0.0
    for intervals in spans.values():
        reach = -np.inf
        for lo, hi in sorted(intervals):
            total += max(0.0, hi - max(lo, reach))
            reach = max(reach, hi)
    return total


def _summary(answers: list[Answered], span_s: float, devices: int) -> dict[str, Any]:
    results = [a.result for a in answers]
    act = np.array([r.timings.act_s for r in results])
    queued = np.array([r.timings.queued_s for r in results])
    restore = np.array([r.timings.restore_s for r in results])
    hits = sum(1 for r in results if r.service is not None and r.service.resident)
    return {
        "devices": devices,
        "calls": len(results),
        "avg_act_s": float(act.mean()),
        "p50_act_s": float(np.percentile(act, 50)),
        "p99_act_s": float(np.percentile(act, 99)),
        "avg_queued_s": float(queued.mean()),
        "avg_restore_s": float(restore.mean()),
        "hit_rate": hits / len(results),
        "restores": len(results) - hits,
        "evictions": sum(len(r.service.evicted) for r in results if r.service is not None),
        "span_s": span_s,
        "gpu_seconds_held": devices * span_s,
        "gpu_seconds_busy": busy_seconds(answers),
    }


@dataclass(frozen=True, slots=True)
class Replay:
    """What every side replays, and how."""

    calls: list[Call]
    checks: dict[str, float]  # each service's checksum: what its calls must answer
    tmp: Path
    per_device_mib: int
    step_s: float | None  # a decode step's seconds (None: modeled compute)


async def _run_setup(setups: list[Setup], replay: Replay) -> tuple[list[Answered], float]:
    """Start every scheduler of one side, make each service resident once (a deployment
    is warm before traffic), replay the trace, stop them: the answers and the span."""
    async with AsyncExitStack() as stack:
        clients: dict[str, tuple[str, AsyncClient]] = {}
        for setup in setups:
            running, token = await _serve(setup, replay.tmp, replay.per_device_mib, stack)
            client = await stack.enter_async_context(AsyncClient(running.url, token))
            for s in setup.services:
                clients[s.spec.name] = (setup.name, client)
        for name, (_, client) in clients.items():
            warm = await client.score(name, [0], input_size=1)
            if warm.status != ActionStatus.OK:
                raise InputError(
                    f"bench gpu-pool: warming {name} ended {warm.status}: {warm.error}"
                )
        return await _replay(clients, replay.calls, replay.checks, replay.step_s)


def _run_side(setups: list[Setup], replay: Replay, *, alone: bool) -> dict[str, Any]:
    """One side's figures: its setups together, or (``alone``) one after another, each
    replaying its own services' calls with the machine to itself. Every run starts at the
    trace's start; the side's span is the longest (each deployment is held until the last
    call of the trace is answered, as when they run together)."""
    if not alone:
        answers, span = run_loop(_run_setup(setups, replay))
        return _summary(answers, span, sum(s.devices for s in setups))
    answers, span = [], 0.0
    for setup in setups:
        names = {s.spec.name for s in setup.services}
        mine = [c for c in replay.calls if c.service in names]
        if mine:
            got, took = run_loop(_run_setup([setup], replace(replay, calls=mine)))
            answers += got
            span = max(span, took)
    return _summary(answers, span, sum(s.devices for s in setups))


def _services(
    names: list[str], weights: Path, *, layers: int, compute_ms: float, compute: str, batch: int
) -> list[tuple[ServiceConfig, float]]:
    """One bench model per name (seeded apart), and the checksum its calls answer."""
    from tangram.node_agent.gpu_bench import entrypoint, write_weights  # needs PyTorch

    out = []
    for i, name in enumerate(names):
        path = weights / f"{name}.pt"
        nbytes, check = write_weights(path, layers, seed=i)
        spec = ServiceDef(
            name=name,
            entrypoint=entrypoint(compute, layers),
            weights=str(path),
            gpu_memory_gb=nbytes * HEADROOM / 2**30,
            max_batch=batch,
        )
        # The profile the elastic algorithm plans with: a call's median compute at DoP 1.
        cfg = ServiceConfig(spec=spec, profiles=((1, compute_ms / 1000, None),), max_calls=batch)
        out.append((cfg, check))
    return out


def _devices_said(visible: int, services: int, compute: str) -> str:
    how = "real compute (decode steps)" if compute == "decode" else f"modeled compute ({compute})"
    static = ""
    if compute == "decode":
        static = f"; the {services} static deployments run one after another, each alone"
    elif visible and visible < services:
        static = (
            f"; the {services} static deployments share them round-robin (no restores after "
            "warm-up, modeled compute)"
        )
    if not visible:
        return f"cpu-backed devices (--gpus cpu:N; {how}, real restores){static}"
    from tangram.node_agent.gpu_worker import cuda_name

    return f"{visible} × {cuda_name(0)} (--gpus cuda:...; {how}, real restores){static}"


def run_gpu_pool_bench(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from tangram.node_agent.gpu_worker import cuda_count
    except ImportError as e:
        raise InputError(f"bench gpu-pool needs PyTorch (pip install '.[gpu]'): {e}") from None
    n = args.services
    visible = cuda_count() if args.devices != "cpu" else 0
    if args.devices == "cuda" and not visible:
        raise InputError("bench gpu-pool --devices cuda: no CUDA device is visible")
    if args.pooled == "auto":  # as many as the machine has, up to 4; 2 and 4 on the CPU
        pooled = [g for g in (1, 2, 4) if g <= visible] if visible else [2, 4]
    else:
        pooled = sorted({int(g) for g in str(args.pooled).split(",")})
    for g in pooled:
        if g not in (1, 2, 4, 8):
            raise InputError(f"--pooled: {g} devices is not 1, 2, 4 or 8 (a GPU chunk)")
        if visible and g > visible:
            raise InputError(
                f"--pooled: {g} devices, but {visible} CUDA devices are visible "
                "(--pooled up to that, or --devices cpu)"
            )
    if args.step_ms is not None and args.compute != "decode":
        raise InputError("--step-ms: only --compute decode has steps")
    if args.batch > MAX_CALLS:
        raise InputError(f"--batch: {args.batch} calls at once is over the most, {MAX_CALLS}")
    layers = max(1, (args.size_mb or 256) // LAYER_MB)
    names = [f"teacher-{i}" for i in range(n)]
    calls = call_trace(
        names,
        rounds=args.rounds,
        round_s=args.round_s,
        burst=args.burst,
        compute_ms=args.compute_ms,
        active=args.active,
        seed=args.seed,
    )
    if not calls:
        raise InputError("bench gpu-pool: the trace has no calls (raise --burst or --rounds)")
    model_mib = layers * LAYER_MB
    per_device_mib = int(model_mib * HEADROOM * args.per_device) + 1
    step_s = None
    if args.compute == "decode" and args.step_ms is not None:
        step_s = args.step_ms / 1000  # the same work in every run, to compare runs
    elif args.compute == "decode":
        from tangram.node_agent.gpu_bench import step_seconds

        step_s = step_seconds(layers, "cuda:0" if visible else "cpu")
        if not args.json:
            note(f"a decode step of one row takes {step_s * 1000:.3f} ms on the device")
    tmp = Path(tempfile.mkdtemp(prefix="tangram-bench-gpu-pool-"))
    try:
        made = _services(
            names,
            tmp,
            layers=layers,
            compute_ms=args.compute_ms,
            compute=args.compute,
            batch=args.batch,
        )
        services = [cfg for cfg, _ in made]
        checks = {cfg.spec.name: check for cfg, check in made}

        def cuda(first: int, count: int) -> tuple[int, ...]:
            return tuple((first + k) % visible for k in range(count)) if visible else ()

        sides: dict[str, list[Setup]] = {
            "static": [
                Setup(f"static-{s.spec.name}", (s,), 1, cuda(i, 1)) for i, s in enumerate(services)
            ]
        }
        for g in pooled:
            scheduling = SchedulerConfig(gpu_joining=args.gpu_joining)
            sides[f"pooled-{g}"] = [
                Setup(f"pooled-{g}", tuple(services), g, cuda(0, g), scheduling)
            ]
        report_sides: dict[str, Any] = {}
        for i, (side, setups) in enumerate(sides.items()):
            if not args.json:
                note(
                    f"[{i + 1}/{len(sides)}] {side}: {len(calls)} calls over {len(names)} services"
                )
            replay = Replay(calls, checks, tmp, per_device_mib, step_s)
            alone = side == "static" and args.compute == "decode"
            report_sides[side] = _run_side(setups, replay, alone=alone)
            if not args.json:
                s = report_sides[side]
                note(
                    f"  {side}: ACT avg {s['avg_act_s']:.3f} s p99 {s['p99_act_s']:.3f} s, "
                    f"hit rate {s['hit_rate']:.2f}, GPU-s held {s['gpu_seconds_held']:.1f} "
                    f"busy {s['gpu_seconds_busy']:.1f}"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    static = report_sides["static"]
    return {
        "device": _devices_said(visible, n, args.compute),
        "services": n,
        "model_mb": model_mib,
        "per_device": args.per_device,
        "compute": args.compute,
        "gpu_joining": args.gpu_joining,  # the pooled schedulers' (static: the default)
        "batch": args.batch,
        "decode_step_ms": None if step_s is None else step_s * 1000,
        "calls": len(calls),
        "trace": {
            "rounds": args.rounds,
            "round_s": args.round_s,
            "burst": args.burst,
            "compute_ms": args.compute_ms,
            "active": args.active,
            "seed": args.seed,
        },
        "sides": report_sides,
        "vs_static": {
            side: {
                "avg_act": s["avg_act_s"] / static["avg_act_s"],
                "p99_act": s["p99_act_s"] / static["p99_act_s"],
                "gpu_seconds_held": s["gpu_seconds_held"] / static["gpu_seconds_held"],
            }
            for side, s in report_sides.items()
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
    }
