"""The GPU worker: reward services loaded once into host memory, restored into the GPUs a
call is given, evicted when the memory is needed (evict-on-execution, seed 000 §5.3).

The only module that imports ``torch``. A RewardService names an entry point
``package.module:function`` returning ``(module, score)``: ``module`` a ``torch.nn.Module``
(built on the ``meta`` device: the worker calls the function under
``torch.device("meta")``, so building allocates nothing), ``score(module, inputs) ->
outputs`` the call itself. Its ``weights`` is a file written by ``torch.save(state_dict)``.

- **Load once**: the state dict is read to host memory at start (pinned when CUDA is
  there, so restores are asynchronous DMA copies) and never read from disk again.
- **Restore**: for a call on a chunk of k devices the service's DoP-k instance is made
  resident there: a fresh module skeleton per device, its tensors copied from the pinned
  host copy (``non_blocking``), ``load_state_dict(assign=True)`` (no second allocation).
  A DoP-k instance splits each batch over its k replicas.
- **Evict**: drop the device copies; nothing is written back (the host copy is the master).
- Which instance to evict, and when a service can never fit, is decided by the pure
  :class:`~tangram.node_agent.gpu_residency.Residency`.

Without CUDA the same code runs with ``cpu`` standing for every device (tests, and
``tangram bench gpu`` on a machine without a GPU, which says so).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tangram.node_agent.gpu_residency import InstanceKey, Residency

Score = Callable[[torch.nn.Module, list[Any]], list[Any]]


class ServiceError(RuntimeError):
    """A service that cannot be loaded or called (bad entry point, weights, outputs)."""


@dataclass(frozen=True)
class ServiceDef:
    name: str
    entrypoint: str  # package.module:function -> (module on meta, score)
    weights: str  # a torch.save(state_dict) file
    bytes_per_device: int  # weights plus working memory, per GPU of an instance


@dataclass
class CallStats:
    """What one call cost besides its own run, and what it found."""

    hit: bool
    restore_s: float = 0.0
    evict_s: float = 0.0
    exec_s: float = 0.0
    restored_bytes: int = 0
    evicted: list[str] = field(default_factory=list)


@dataclass
class _Service:
    spec: ServiceDef
    build: Callable[[], tuple[torch.nn.Module, Score]]
    score: Score
    host: dict[str, torch.Tensor]  # the master copy: pinned host memory when CUDA is there
    nbytes: int


def resolve(entrypoint: str) -> Callable[[], tuple[torch.nn.Module, Score]]:
    module_name, _, attr = entrypoint.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ServiceError(f"entrypoint {entrypoint}: {e}") from None
    if not callable(fn):
        raise ServiceError(f"entrypoint {entrypoint}: not callable")
    built: Callable[[], tuple[torch.nn.Module, Score]] = fn
    return built


class GpuWorker:
    """Serves calls on the devices it owns; thread-safe (calls on disjoint chunks run at
    once, the scheduler never gives one device to two calls)."""

    def __init__(
        self,
        capacity: dict[int, int],
        *,
        device: Callable[[int], torch.device] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cuda = torch.cuda.is_available()
        self.device = device or (
            (lambda i: torch.device("cuda", i)) if self.cuda else (lambda _i: torch.device("cpu"))
        )
        self.residency = Residency(dict(capacity))
        self.clock = clock
        self.services: dict[str, _Service] = {}
        self.instances: dict[InstanceKey, list[torch.nn.Module]] = {}
        self.loads = 0  # reads of weights from storage: one per service, ever
        self.hits = self.restores = self.evictions = 0
        self._lock = threading.Lock()

    # ---- loading ---------------------------------------------------------------------
    def load(self, spec: ServiceDef) -> float:
        """Read ``spec``'s weights into host memory (once); seconds it took."""
        if spec.name in self.services:
            return 0.0
        t0 = self.clock()
        build = resolve(spec.entrypoint)
        try:
            state = torch.load(spec.weights, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise ServiceError(f"{spec.name}: weights {spec.weights}: {e}") from None
        if not isinstance(state, dict):
            raise ServiceError(f"{spec.name}: {spec.weights} is not a state dict")
        host = {k: (v.pin_memory() if self.cuda else v.contiguous()) for k, v in state.items()}
        skeleton, score = self._skeleton(build, spec)
        missing = set(skeleton.state_dict()) - set(host)
        if missing:
            raise ServiceError(f"{spec.name}: weights lack {sorted(missing)[:5]}")
        nbytes = sum(t.numel() * t.element_size() for t in host.values())
        if nbytes > spec.bytes_per_device:
            raise ServiceError(
                f"{spec.name}: weights are {nbytes} bytes, more than gpuMemoryGiB allows "
                f"({spec.bytes_per_device})"
            )
        self.services[spec.name] = _Service(spec, build, score, host, nbytes)
        self.loads += 1
        return self.clock() - t0

    @staticmethod
    def _skeleton(
        build: Callable[[], tuple[torch.nn.Module, Score]], spec: ServiceDef
    ) -> tuple[torch.nn.Module, Score]:
        with torch.device("meta"):
            built = build()
        if not (isinstance(built, tuple) and len(built) == 2):
            raise ServiceError(f"{spec.name}: {spec.entrypoint} must return (module, score)")
        module, score = built
        if not isinstance(module, torch.nn.Module) or not callable(score):
            raise ServiceError(f"{spec.name}: {spec.entrypoint} must return (module, score)")
        return module, score

    # ---- calls -------------------------------------------------------------------------
    def call(
        self, name: str, chunk: Sequence[int], inputs: list[Any]
    ) -> tuple[list[Any], CallStats]:
        """Run ``inputs`` through service ``name`` on the devices of ``chunk``."""
        service = self.services.get(name)
        if service is None:
            raise ServiceError(f"unknown service {name!r} (loaded: {sorted(self.services)})")
        key: InstanceKey = (name, len(chunk))
        with self._lock:
            plan = self.residency.plan(key, chunk, service.spec.bytes_per_device)
            stats = CallStats(hit=plan.hit)
            t0 = self.clock()
            for victim in plan.evict:
                self._evict(victim)
                stats.evicted.append(f"{victim[0]}@dop{victim[1]}")
            stats.evict_s = self.clock() - t0
            if plan.hit:
                self.hits += 1
            else:
                t0 = self.clock()
                self.instances[key] = [self._restore(service, d) for d in chunk]
                self._synchronize(chunk)
                stats.restore_s = self.clock() - t0
                stats.restored_bytes = service.nbytes * len(chunk)
                self.residency.admit(key, chunk, service.spec.bytes_per_device)
                self.restores += 1
            self.residency.acquire(key)
            replicas = self.instances[key]
        try:
            t0 = self.clock()
            outputs = self._run(service, replicas, chunk, inputs)
            stats.exec_s = self.clock() - t0
        finally:
            with self._lock:
                self.residency.release(key)
        return outputs, stats

    def _restore(self, service: _Service, index: int) -> torch.nn.Module:
        device = self.device(index)
        module, _ = self._skeleton(service.build, service.spec)
        # copy=True: on the CPU too the instance gets its own memory, as on a GPU.
        state = {k: v.to(device, non_blocking=True, copy=True) for k, v in service.host.items()}
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()

    def _evict(self, key: InstanceKey) -> None:
        self.residency.evict(key)
        self.instances.pop(key, None)  # the device tensors go with their last reference
        self.evictions += 1
        if self.cuda:
            torch.cuda.empty_cache()  # hand the memory back for other processes' NVML view

    def _synchronize(self, chunk: Sequence[int]) -> None:
        if self.cuda:
            for i in chunk:
                torch.cuda.synchronize(self.device(i))

    def _run(
        self,
        service: _Service,
        replicas: list[torch.nn.Module],
        chunk: Sequence[int],
        inputs: list[Any],
    ) -> list[Any]:
        score = service.score
        k = len(replicas)
        share = -(-len(inputs) // k) if inputs else 0  # ceil: the batch over the replicas
        outputs: list[Any] = []
        with torch.inference_mode():
            for r, replica in enumerate(replicas):
                part = inputs[r * share : (r + 1) * share]
                if part:
                    got = score(replica, part)
                    if len(got) != len(part):
                        raise ServiceError(
                            f"{service.spec.name}: score returned {len(got)} outputs for "
                            f"{len(part)} inputs"
                        )
                    outputs.extend(got)
        self._synchronize(chunk)
        return outputs

    def evict_all(self) -> None:
        with self._lock:
            for key in list(self.residency.resident):
                self._evict(key)

    def resident(self) -> dict[str, list[int]]:
        """service@dopK -> its devices, for status and metrics."""
        return {f"{k[0]}@dop{k[1]}": list(p.devices) for k, p in self.residency.resident.items()}


__all__ = ["CallStats", "GpuWorker", "ServiceDef", "ServiceError", "resolve"]
