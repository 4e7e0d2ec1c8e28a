"""The node agent's GPU role: RewardService calls on the node's GPUs, behind one interface.

:class:`ServiceBackend` is what the agent needs from whatever holds the models. The
built-in PyTorch worker (:mod:`tangram.node_agent.gpu_worker`) implements it and is the
one tested here. An external inference server that can release and resume its GPU memory
fits behind the same interface: ``load`` starts the server once and puts it to sleep
(its weights stay in host memory), a call's restore is a wake-up on the chunk's GPUs
(vLLM ``/wake_up``, SGLang ``/resume_memory_occupation``), an eviction is a sleep (vLLM
``/sleep`` level 1, SGLang ``/release_memory_occupation``), and the call itself is
forwarded to the server.

:class:`GpuRole` runs a backend for the agent: torch work happens in threads off the
event loop, and a call answers only once its thread has finished, even when cancelled,
so the scheduler never hands a GPU to a second call while the first still runs on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from tangram.api.wire import (
    GpuWorkerInfo,
    ResidentInstance,
    ServiceDef,
    ServiceLoad,
    ServiceOutcome,
    ServiceStats,
)
from tangram.node_agent.execution import ExecError

log = logging.getLogger("tangram.agent.gpu")
T = TypeVar("T")
MIB = 2**20
# Kept free on each GPU for the CUDA context, the caching allocator's slack and kernels'
# workspaces: a restore the residency plan admits must never run out of memory.
RESERVE_BYTES = 1536 * MIB
RESERVE_FRACTION = 0.03
MAX_OUTPUT_BYTES = 8 << 20  # a call's outputs as JSON; the link's messages stay far below 16 MiB


class CallStatsLike(Protocol):
    hit: bool
    restore_s: float
    evict_s: float
    exec_s: float
    restored_bytes: int
    evicted: list[str]


class ServiceBackend(Protocol):
    """What serves RewardService calls on this node's GPUs (see the module docstring)."""

    def load(self, spec: ServiceDef) -> float:
        """Bring ``spec`` into host memory once; seconds it took. Raises on a bad service."""
        ...

    def loaded_bytes(self, service: str) -> int:
        """Bytes a restore of one replica copies to a GPU."""
        ...

    def unload(self, service: str) -> None: ...

    def call(
        self, service: str, chunk: Sequence[int], inputs: list[Any]
    ) -> tuple[list[Any], CallStatsLike]:
        """Make the service resident on ``chunk`` (evicting as needed) and run ``inputs``."""
        ...

    def restore_ahead(self, service: str, chunk: Sequence[int]) -> CallStatsLike:
        """Make the service resident on ``chunk`` before its call, without holding the
        devices (calls of other instances may run there meanwhile)."""
        ...

    def resident_instances(self) -> list[tuple[str, list[int]]]:
        """(service, devices) of the instances in GPU memory, least recently used first."""
        ...

    def h2d_gbps(self, device: int) -> float: ...


@dataclass(frozen=True)
class GpuOptions:
    """``--gpus``: ``auto`` (every CUDA device, if any), ``cuda:0,2`` (those CUDA devices
    only: the node's GPUs other agents or jobs keep), ``none``, or ``cpu:N`` (N CPU-backed
    devices standing in for GPUs: tests and demos); ``--gpu-memory-mib`` overrides what
    each device offers to service instances."""

    mode: str = "none"
    memory_mib: int | None = None
    devices: tuple[int, ...] = ()  # cuda: the CUDA device indexes to serve

    @classmethod
    def parse(cls, text: str, memory_mib: int | None = None) -> GpuOptions:
        if text in ("auto", "none"):
            return cls(text, memory_mib)
        count = text.removeprefix("cpu:")
        if text.startswith("cpu:") and count.isdecimal() and int(count) in (1, 2, 4, 8):
            return cls(text, memory_mib)
        if text.startswith("cuda:"):
            listed = text.removeprefix("cuda:").split(",")
            if not all(d.isascii() and d.isdecimal() for d in listed):
                raise ExecError(f"--gpus: {text!r}: cuda: takes device indexes, e.g. cuda:0,1")
            devices = tuple(int(d) for d in listed)
            if len(set(devices)) != len(devices):
                raise ExecError(f"--gpus: {text!r} names a device twice")
            return cls("cuda", memory_mib, devices)
        raise ExecError(
            f"--gpus: {text!r} is not auto, none, cuda:I,J,... or cpu:N with N in 1, 2, 4, 8"
        )


class GpuRole:
    def __init__(self, backend: ServiceBackend, info: GpuWorkerInfo) -> None:
        self.backend = backend
        self.info = info
        self.defs: dict[str, ServiceDef] = {}
        self.loaded: dict[str, ServiceLoad] = {}
        self._sync_lock = asyncio.Lock()

    @classmethod
    def start(cls, options: GpuOptions, nvml_gpus: int = 0) -> GpuRole | None:
        """The role for ``options``, or None (no GPUs asked for, or none found with auto).
        ``nvml_gpus``: GPUs NVML sees; with auto and none, PyTorch is never imported (it
        costs seconds and hundreds of MB on every CPU node)."""
        if options.mode == "none" or (options.mode == "auto" and nvml_gpus == 0):
            return None
        try:
            from tangram.node_agent.gpu_worker import GpuWorker, cuda_count, cuda_memory
        except ImportError as e:
            if options.mode == "auto":  # NVML sees GPUs, so serving them was likely meant
                log.warning(
                    "%d GPUs but no GPU role: %s (use an image with the gpu extra)", nvml_gpus, e
                )
                return None
            raise ExecError(f"--gpus {options.mode}: PyTorch is not installed ({e})") from None
        # Every device is offered; the scheduler uses a power of two of them (buddy chunks).
        override = options.memory_mib * MIB if options.memory_mib is not None else None
        if options.mode in ("auto", "cuda"):
            visible = cuda_count()
            if options.mode == "auto" and not visible:
                return None
            devices = list(options.devices) or list(range(visible))
            missing = [d for d in devices if d >= visible]
            if missing:
                raise ExecError(
                    f"--gpus cuda:{','.join(map(str, devices))}: no CUDA device {missing} "
                    f"({visible} visible)"
                )
            # Only the chosen devices are touched: the others may be the trainer's.
            usable = [
                max(0, int(t - RESERVE_BYTES - RESERVE_FRACTION * t)) for t in cuda_memory(devices)
            ]
            if override is not None and override > min(usable):
                # More than a device has would let a restore run out of memory.
                raise ExecError(
                    f"--gpu-memory-mib {options.memory_mib}: more than the {min(usable) // MIB} "
                    "MiB a GPU here can give services (its memory less a reserve for CUDA)"
                )
            capacity = [override or u for u in usable]
            backend = "cuda"
        else:
            capacity = [override or 1024 * MIB] * int(options.mode.removeprefix("cpu:"))
            devices = list(range(len(capacity)))
            backend = "cpu"
        worker = GpuWorker(dict(zip(devices, capacity, strict=True)), cpu=backend == "cpu")
        gbps = worker.h2d_gbps(devices[0])
        info = GpuWorkerInfo(backend=backend, devices=devices, memory_bytes=capacity, h2d_gbps=gbps)
        log.info(
            "GPU role: %d %s devices, %.1f GiB each for services, host-to-device %.1f GB/s",
            len(devices),
            backend,
            min(capacity) / 2**30,
            gbps,
        )
        return cls(worker, info)

    async def sync(self, defs: Sequence[ServiceDef]) -> dict[str, ServiceLoad]:
        """Hold exactly ``defs``: new ones are loaded (once, into host memory), changed ones
        reloaded, removed ones dropped. One failing service does not stop the others."""
        async with self._sync_lock:
            wanted = {d.name: d for d in defs}
            for name in [n for n in self.defs if wanted.get(n) != self.defs[n]]:
                await asyncio.to_thread(self.backend.unload, name)
                self.defs.pop(name)
            for name in [n for n in self.loaded if n not in self.defs]:
                del self.loaded[name]  # changed or removed; a failed load is tried again
            for name, spec in wanted.items():
                if name in self.defs:
                    continue
                try:
                    seconds = await asyncio.to_thread(self.backend.load, spec)
                except Exception as e:  # reported, never fatal; the next sync tries again
                    self.loaded[name] = ServiceLoad(ok=False, error=str(e))
                    log.warning("RewardService %s not loaded: %s", name, e)
                    continue
                self.defs[name] = spec
                self.loaded[name] = ServiceLoad(
                    ok=True, bytes=self.backend.loaded_bytes(name), load_s=seconds
                )
                log.info("RewardService %s loaded in %.2f s", name, seconds)
            return dict(self.loaded)

    def resident(self) -> list[ResidentInstance]:
        return [
            ResidentInstance(service=s, devices=d) for s, d in self.backend.resident_instances()
        ]

    def _check(self, service: str, gpus: Sequence[int]) -> None:
        unknown = [g for g in gpus if g not in self.info.devices]
        if unknown or not gpus:
            raise ExecError(f"gpus {list(gpus)}: not this worker's devices {self.info.devices}")
        state = self.loaded.get(service)
        if state is None or not state.ok:
            why = state.error if state is not None else "not defined on this node"
            raise ExecError(f"service {service}: {why}")

    async def restore_ahead(self, service: str, gpus: Sequence[int]) -> ServiceOutcome:
        """The scheduler's restore ahead of a call: no inputs, no outputs, the stats of the
        restore. Its thread, like a call's, is waited for even when cancelled."""
        self._check(service, gpus)
        stats = await _in_thread(service, partial(self.backend.restore_ahead, service, list(gpus)))
        return ServiceOutcome(outputs=[], stats=_stats(service, stats), exec_s=0.0)

    async def call(self, service: str, gpus: Sequence[int], inputs: list[Any]) -> ServiceOutcome:
        self._check(service, gpus)

        def run() -> tuple[list[Any], CallStatsLike, int]:
            outputs, stats = self.backend.call(service, list(gpus), inputs)
            # Measured here, in the thread: up to 8 MiB of JSON would stall the agent's loop.
            return outputs, stats, len(json.dumps(outputs, default=str))

        outputs, stats, size = await _in_thread(service, run)
        if size > MAX_OUTPUT_BYTES:  # the reply must fit a WebSocket message of the link
            raise ExecError(
                f"service {service}: outputs of {size} bytes exceed {MAX_OUTPUT_BYTES}; "
                "split the call or return less per input"
            )
        return ServiceOutcome(outputs=outputs, stats=_stats(service, stats), exec_s=stats.exec_s)


async def _in_thread(service: str, work: Callable[[], T]) -> T:
    """``work`` on the GPUs, in a thread; its errors as the agent reports them. The thread
    cannot be stopped: a cancelled caller is answered once it is done with the GPUs."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        while not running.done():  # (a second cancel, a repeated AgentCancel, waits too)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((running,))
        if not running.cancelled():
            running.exception()  # (its error, if any, is no one's now)
        raise
    except Exception as e:
        raise ExecError(f"service {service}: {e}") from None


def _stats(service: str, stats: CallStatsLike) -> ServiceStats:
    return ServiceStats(
        service=service,
        resident=stats.hit,
        restore_s=stats.restore_s,
        evict_s=stats.evict_s,
        restored_bytes=stats.restored_bytes,
        evicted=list(stats.evicted),
    )


__all__ = ["GpuOptions", "GpuRole", "ServiceBackend"]
