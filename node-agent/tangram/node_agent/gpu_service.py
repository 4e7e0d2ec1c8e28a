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
event loop, in threads of its own (never the loop's default executor, which Docker exec
output and closes share: a batch holding threads there would starve calls on free GPUs),
and a call answers only once its thread has finished, even when cancelled, so the
scheduler never hands a GPU to a second call while the first still runs on it. A call's
outputs must be plain JSON (numbers, strings, lists, dicts): anything else fails that call,
with the type and where it is, rather than the reply that carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import pydantic_core

from tangram.api.wire import (
    GpuWorkerInfo,
    ResidentInstance,
    ServiceDef,
    ServiceLoad,
    ServiceOutcome,
    ServiceStats,
)
from tangram.node_agent.daemon_threads import DaemonThreads
from tangram.node_agent.execution import ExecError
from tangram.node_agent.gpu_batching import MAX_CALLS

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
        """Bring ``spec`` into host memory once; seconds it took. Raises on a bad service.
        Called again at each sync for a service it holds: 0.0 when nothing changed; it
        may load it again if its files changed (the worker does, replacing it)."""
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


def role_threads(devices: int) -> int:
    """The most threads the GPU role may need at once: on each device, the calls of its
    instance (up to ``batching.maxCalls``, bounded by :data:`MAX_CALLS`: agents are not
    told each service's figure) and a restore ahead; twice that for the calls from before
    a reconnect, which may still run while their successors wait for the devices. Threads
    are started only when none is idle, so this bounds the pool, it does not fill it."""
    return 2 * max(1, devices) * (MAX_CALLS + 1)


class GpuRole:
    def __init__(self, backend: ServiceBackend, info: GpuWorkerInfo) -> None:
        self.backend = backend
        self.info = info
        self.defs: dict[str, ServiceDef] = {}
        self.loaded: dict[str, ServiceLoad] = {}
        self._sync_lock = asyncio.Lock()
        # The role's own threads: a call placed on a free GPU starts at once, whatever
        # batches hold threads on the other GPUs or the loop's default executor.
        self.threads = self._threads()

    def _threads(self) -> DaemonThreads:
        # Daemons: a call still running when the agent stops is abandoned, not waited for
        # by the process's exit (daemon_threads).
        return DaemonThreads(role_threads(len(self.info.devices)), thread_name_prefix="gpu-call")

    def close(self) -> None:
        """The agent stops: the threads end once their calls have ended, and so do the
        backend's, if it has any to stop; the process does not wait for them. The role
        stays usable (an embedded scheduler restarted around the same agent): later work
        gets new threads."""
        old, self.threads = self.threads, self._threads()
        old.shutdown(wait=False)
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

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
        reloaded, removed ones dropped, and unchanged ones whose files changed loaded again.
        One failing service does not stop the others."""
        async with self._sync_lock:
            wanted = {d.name: d for d in defs}
            for name in [n for n in self.defs if wanted.get(n) != self.defs[n]]:
                await _run_in(self.threads, partial(self.backend.unload, name))
                self.defs.pop(name)
            for name in [n for n in self.loaded if n not in self.defs]:
                del self.loaded[name]  # changed or removed; a failed load is tried again
            for name, spec in wanted.items():
                if name in self.defs:
                    await self._refresh(spec)
                    continue
                try:
                    seconds = await _run_in(self.threads, partial(self.backend.load, spec))
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

    async def _refresh(self, spec: ServiceDef) -> None:
        """A service held in this definition: the backend loads it again if its files
        changed (a weights file renamed over, an edited entry point module), which costs a
        stat of each. Failing, the one loaded serves on, as a reload keeps the running
        definitions when the new ones are wrong."""
        name = spec.name
        try:
            seconds = await _run_in(self.threads, partial(self.backend.load, spec))
        except Exception as e:
            log.warning(
                "RewardService %s: its weights file or entrypoint module changed, but does "
                "not load (the one loaded before serves on): %s",
                name,
                e,
            )
            return
        if seconds > 0.0:
            self.loaded[name] = ServiceLoad(
                ok=True, bytes=self.backend.loaded_bytes(name), load_s=seconds
            )
            log.info(
                "RewardService %s loaded again in %.2f s: its weights file or entrypoint "
                "module changed",
                name,
                seconds,
            )

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
        ahead = partial(self.backend.restore_ahead, service, list(gpus))
        stats = await _in_thread(service, ahead, self.threads)
        return ServiceOutcome(outputs=[], stats=_stats(service, stats), exec_s=0.0)

    async def call(self, service: str, gpus: Sequence[int], inputs: list[Any]) -> ServiceOutcome:
        self._check(service, gpus)

        def run() -> tuple[list[Any], CallStatsLike, int]:
            outputs, stats = self.backend.call(service, list(gpus), inputs)
            # Checked and measured here, in the thread: up to 8 MiB of JSON would stall the
            # agent's loop. Outputs the reply could not carry fail this call, not the reply.
            return outputs, stats, json_size(outputs)

        outputs, stats, size = await _in_thread(service, run, self.threads)
        if size > MAX_OUTPUT_BYTES:  # the reply must fit a WebSocket message of the link
            raise ExecError(
                f"service {service}: outputs of {size} bytes exceed {MAX_OUTPUT_BYTES}; "
                "split the call or return less per input"
            )
        return ServiceOutcome(outputs=outputs, stats=_stats(service, stats), exec_s=stats.exec_s)


def json_size(outputs: Any) -> int:
    """The size of ``outputs`` as the reply encodes them, once they are found to be plain
    JSON: None, booleans, numbers (finite: JSON has no NaN or Infinity, which the reply
    would turn into null), strings, and lists, tuples and dicts with string keys of these.
    Raises ``ValueError`` naming the first thing that is not, and where it is."""
    if not isinstance(outputs, (list, tuple)):
        raise ValueError(f"score returned {a_type(outputs)}, not a list with one output per input")
    try:
        problem = _not_json(outputs, "outputs")
    except RecursionError:
        problem = "outputs nested too deeply (or holding themselves)"
    if problem is not None:
        raise ValueError(f"score returned {problem}")
    try:  # the reply's own encoder, so the size is the reply's
        return len(pydantic_core.to_json(outputs))
    except (pydantic_core.PydanticSerializationError, ValueError) as e:
        raise ValueError(f"score returned outputs the reply cannot carry: {e}") from None


_ADVICE = "return plain numbers, lists, dicts or strings (.tolist())"
_SCALARS = (str, int, type(None))  # bool is an int


def _not_json(value: Any, at: str) -> str | None:
    """What in ``value`` (at ``at``) is not plain JSON, or None (see :func:`json_size`)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        return f"{value} at {at}: JSON has no NaN or Infinity; return a finite number or None"
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            kind = type(item)
            if kind is str or kind is int or (kind is float and math.isfinite(item)):
                continue  # the common case, checked without a call
            problem = _not_json(item, f"{at}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a dict key {key!r} ({_type(key)}) at {at}: JSON object keys are strings"
            problem = _not_json(item, f"{at}[{key!r}]")
            if problem is not None:
                return problem
        return None
    return f"{a_type(value)} at {at}: {_ADVICE}"


def _type(value: Any) -> str:
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def a_type(value: Any) -> str:
    """``a dict``, ``a torch.Tensor``: what a score returned, as its errors name it."""
    kind = _type(value)
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


async def _run_in(threads: Executor | None, work: Callable[[], T]) -> T:
    """``work`` in one of ``threads`` (None: the loop's default executor), in this task's
    context, as ``asyncio.to_thread`` runs it."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(threads, partial(context.run, work))


async def _in_thread(service: str, work: Callable[[], T], threads: Executor | None = None) -> T:
    """``work`` on the GPUs, in one of ``threads`` (the GPU role's own); its errors as the
    agent reports them. The thread cannot be stopped: a cancelled caller is answered once
    it is done with the GPUs."""
    running = asyncio.ensure_future(_run_in(threads, work))  # a closed role's fails below
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


__all__ = ["GpuOptions", "GpuRole", "ServiceBackend", "a_type", "json_size", "role_threads"]
