"""The GPU worker: reward services loaded once into host memory, restored into the GPUs a
call is given, evicted when the memory is needed (evict-on-execution, seed 000 §5.3).

The only module that imports ``torch``. A RewardService names an entry point
``package.module:function`` returning ``(module, score)``: ``module`` a ``torch.nn.Module``
(its parameters built on the ``meta`` device, so building allocates nothing; buffers it
computes itself and leaves out of its state dict are computed once at load and restored
with the weights), ``score(module, inputs) -> outputs`` the call itself. Its ``weights``
is a file written by ``torch.save(state_dict)``.

- **Load once**: the state dict is mapped from its file and copied once into host memory
  at start (pinned when CUDA is there, so restores are asynchronous DMA copies); the file
  is never read again.
- **Restore**: for a call on a chunk of k devices the service's DoP-k instance is made
  resident there: a fresh module skeleton per device, its tensors copied from the pinned
  host copy (``non_blocking``), ``load_state_dict(assign=True)`` (no second allocation).
  A DoP-k instance splits each batch over its k replicas.
- **Evict**: drop the device copies; nothing is written back (the host copy is the master).
- **Batch**: calls the scheduler runs on one resident instance at once (a RewardService's
  ``batching.maxCalls``) share its forward passes
  (:class:`~tangram.node_agent.gpu_batching.SharedPasses`); a call never shares GPUs with
  a call of another instance.
- Which instance to evict, and when a service can never fit, is decided by the pure
  :class:`~tangram.node_agent.gpu_residency.Residency`.

Without CUDA the same code runs with ``cpu`` standing for every device (tests, and
``tangram bench gpu`` on a machine without a GPU, which says so).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import pickle
import statistics
import sys
import threading
import time
import types
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from tangram.api.wire import ServiceDef
from tangram.node_agent.daemon_threads import DaemonThreads
from tangram.node_agent.gpu_batching import MAX_CALLS, SharedPasses
from tangram.node_agent.gpu_residency import (
    InstanceKey,
    Plan,
    Residency,
    instance_key,
    name,
    size_text,
)
from tangram.node_agent.gpu_service import a_type

GIB = 2**30

Score = Callable[[torch.nn.Module, list[Any]], list[Any]]
T = TypeVar("T")


class ServiceError(RuntimeError):
    """A service that cannot be loaded or called (bad entry point, weights, outputs)."""


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
    nbytes: int  # what a restore copies to each device: ``host`` and ``buffers``
    # Buffers the module computes itself and leaves out of its state dict (``persistent=False``,
    # like the rotary ``inv_freq`` of most transformers): computed once at load, copied
    # like the weights, since a skeleton built on ``meta`` holds no values for them.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # The files it was loaded from (its weights, its entry point's module), with their
    # stat before they were read: one that changed since makes a sync load it again.
    sources: dict[str, Stat | None] = field(default_factory=dict)

    def changed(self) -> str | None:
        """Which of its files changed since it was loaded, or None."""
        moved = [path for path, stat in self.sources.items() if file_stat(path) != stat]
        return ", ".join(moved) or None

    @property
    def bytes_per_device(self) -> int:
        """Weights plus working memory on each GPU of an instance (every GPU of a DoP-k
        instance holds a whole replica)."""
        return bytes_per_device(self.spec)


@dataclass
class _Resident:
    """An instance in GPU memory: a replica per device, their shared forward passes, and
    the service as it was when the instance was built."""

    replicas: list[torch.nn.Module]
    passes: list[SharedPasses]
    service: _Service


def bytes_per_device(spec: ServiceDef) -> int:
    return int(spec.gpu_memory_gb * GIB)


_META_PARAMS = threading.local()  # set in the thread that builds a load-time skeleton
_META_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on ``meta`` but everything else real.

    ``torch.device("meta")`` puts buffers on ``meta`` too, and buffers a module computes
    in ``__init__`` (rotary frequencies, masks) are then lost. So parameters are moved to
    ``meta`` as they are registered, as accelerate's ``init_empty_weights`` does, but only
    in this thread: the worker builds skeletons in other threads at the same time.
    """
    with _META_PARAMS_LOCK:
        original = torch.nn.Module.register_parameter

        def register(module: torch.nn.Module, name: str, param: Any) -> None:
            original(module, name, param)
            if getattr(_META_PARAMS, "on", False) and param is not None and not param.is_meta:
                meta = param.detach().to("meta")
                module._parameters[name] = torch.nn.Parameter(meta, param.requires_grad)

        torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
        _META_PARAMS.on = True
        try:
            yield
        finally:
            _META_PARAMS.on = False
            torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def read_weights(path: str) -> Any:
    """A ``torch.save`` file's contents, its tensors on the CPU.

    Files in the zip format (every ``torch.save`` since PyTorch 1.6) are memory-mapped:
    their pages are read as the pinned copy is made, so loading holds one copy of the
    weights in host memory, not two (a 70B model in bf16 would otherwise need 280 GB at
    its peak). Older files cannot be mapped and are read whole.
    """
    mapped = zipfile.is_zipfile(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)


Stat = tuple[int, int, int, int]  # (device, inode, size, mtime in ns) of a file


def file_stat(path: str | None) -> Stat | None:
    """What tells a file from its next version (a rename over it, or a rewrite); None when
    it is not there."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _SourceOnly(importlib.machinery.SourceFileLoader):
    """Compiles the module from its source: a cached ``.pyc`` is trusted when the source's
    mtime (in whole seconds) and size match, which an edit within a second may keep."""

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


# Entry point modules as resolve last used them, with their source's stat then: one whose
# source changed since is imported afresh. The lock keeps two loads from doing it at once.
_MODULES: dict[str, tuple[types.ModuleType, Stat | None]] = {}
_IMPORTS = threading.Lock()


def _import(module_name: str) -> tuple[types.ModuleType, Stat | None]:
    """The module, imported afresh (a new module object: calls running the old one keep
    it) when its source changed since it was last used here; and its source's stat."""
    with _IMPORTS:
        module = sys.modules.get(module_name)
        seen = _MODULES.get(module_name)
        stat = None if module is None else file_stat(getattr(module, "__file__", None))
        if module is None:
            importlib.invalidate_caches()  # a module written since its directory was listed
            module = importlib.import_module(module_name)
        elif seen is not None and seen[0] is module and seen[1] != stat:
            module = _fresh(module_name, module)
        else:  # as it is, with the stat just read
            _MODULES[module_name] = (module, stat)
            return _MODULES[module_name]
        # (Taken after an import: an edit during it is seen only at the next one.)
        _MODULES[module_name] = (module, file_stat(getattr(module, "__file__", None)))
        return _MODULES[module_name]


def _fresh(module_name: str, old: types.ModuleType) -> types.ModuleType:
    """``module_name`` imported again from its source, as a new module object; ``old``
    stays in ``sys.modules`` if that fails."""
    del sys.modules[module_name]
    try:
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module_name)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"No module named {module_name!r}")
        if isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _SourceOnly(spec.loader.name, spec.loader.path)
        module = importlib.util.module_from_spec(spec)
        # A package's submodules stay imported: bound on the new object as on the old
        # (its ``import pkg.sub`` finds pkg.sub imported and binds nothing: pkg.sub was
        # missing on it, and every call failed).
        prefix = module_name + "."
        for name, sub in list(sys.modules.items()):
            if name.startswith(prefix) and "." not in name[len(prefix) :] and sub is not None:
                setattr(module, name[len(prefix) :], sub)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[module_name] = old
        raise
    parent, _, leaf = module_name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, module)  # as an import binds it
    return module


def resolve(
    entrypoint: str,
) -> tuple[Callable[[], tuple[torch.nn.Module, Score]], dict[str, Stat | None]]:
    """The entry point's function, and its module's source file with its stat (none for
    a module without one). A module whose source changed since it was last resolved is
    imported afresh."""
    module_name, _, attr = entrypoint.partition(":")
    try:
        module, stat = _import(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ServiceError(f"entrypoint {entrypoint}: {e}") from None
    except Exception as e:  # the module itself failed as it ran (a SyntaxError, a NameError)
        raise ServiceError(
            f"entrypoint {entrypoint}: importing it raised {type(e).__name__}: {e}"
        ) from None
    if not callable(fn):
        raise ServiceError(f"entrypoint {entrypoint}: not callable")
    built: Callable[[], tuple[torch.nn.Module, Score]] = fn
    source = getattr(module, "__file__", None)
    return built, ({source: stat} if source else {})


class GpuWorker:
    """Serves calls on the devices it owns; thread-safe (calls on disjoint chunks run at
    once, as do calls on one resident instance; the scheduler never gives one device to
    two instances)."""

    def __init__(
        self,
        capacity: dict[int, int],
        *,
        device: Callable[[int], torch.device] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cpu: bool = False,
    ) -> None:
        """``capacity``: device index -> bytes instances may use; ``cpu``: CPU memory stands
        in for every device even where CUDA is available."""
        self.cuda = torch.cuda.is_available() and not cpu
        self.device = device or (
            (lambda i: torch.device("cuda", i)) if self.cuda else (lambda _i: torch.device("cpu"))
        )
        self.residency = Residency(dict(capacity))
        self.clock = clock
        self.services: dict[str, _Service] = {}
        self.instances: dict[InstanceKey, _Resident] = {}
        self.loads = 0  # reads of weights from storage: one per service, ever
        self.hits = self.restores = self.evictions = 0
        self._running: dict[int, InstanceKey] = {}  # device -> the instance running there
        self._calls: dict[InstanceKey, int] = {}  # instance -> its calls, restoring or running
        self._ahead: set[InstanceKey] = set()  # instances being restored ahead of their calls
        # Threads for a call's other replicas (its own thread drives the first). Joined
        # calls wait in their replicas' shared passes, each holding a thread, so there is
        # room for as many calls as the scheduler may run on each device (twice: calls from
        # before a reconnect), started only as needed: a call on a free chunk never queues
        # behind a batch elsewhere. Restores have threads of their own, never queued behind
        # those.
        self._devices = max(1, len(capacity))
        self._pool, self._restorer = self._threads()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when calls leave devices

    def h2d_gbps(self, device: int, nbytes: int = 64 << 20, repeats: int = 3) -> float:
        """Host-to-device copy bandwidth from pinned memory, GB/s (median of ``repeats``):
        what a restore can reach, and what the scheduler divides model bytes by."""
        host = torch.empty(nbytes, dtype=torch.uint8)
        host = host.pin_memory() if self.cuda else host
        target = self.device(device)
        times = []
        for _ in range(repeats):
            self._synchronize([device])
            t0 = time.perf_counter()
            copy = host.to(target, non_blocking=True, copy=True)
            self._synchronize([device])
            times.append(time.perf_counter() - t0)
            del copy
        return nbytes / max(statistics.median(times), 1e-9) / 1e9

    # ---- loading ---------------------------------------------------------------------
    def load(self, spec: ServiceDef) -> float:
        """Read ``spec``'s weights into host memory (once); seconds it took, 0.0 when it
        holds it already. Held, but its weights file or its entry point's source changed
        since (a new file renamed over the old), it is loaded again: the new one replaces
        it once loaded (its idle instances go; running calls finish on the old one), and
        one that fails to load leaves the old one in place."""
        held = self.services.get(spec.name)
        if held is not None and held.changed() is None:
            return 0.0
        largest = max(self.residency.capacity.values(), default=0)
        if bytes_per_device(spec) > largest:  # refused before it costs a pinned host copy
            raise ServiceError(
                f"{spec.name}: gpuMemoryGiB {spec.gpu_memory_gb:g} is more than any GPU here "
                f"has for services ({size_text(largest)})"
            )
        if not spec.replicated:
            raise ServiceError(
                f"{spec.name}: the built-in PyTorch worker runs a DoP-k instance as k replicas; "
                "a sharded model needs an external inference server (parallelism: shard)"
            )
        t0 = self.clock()
        sources = {spec.weights: file_stat(spec.weights)}  # before it is read
        build, source = resolve(spec.entrypoint)
        sources.update(source)
        try:
            state = read_weights(spec.weights)
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
            # (UnpicklingError: a file that is no torch.save output, e.g. half written)
            raise ServiceError(f"{spec.name}: weights {spec.weights}: {e}") from None
        if not isinstance(state, dict):
            raise ServiceError(f"{spec.name}: {spec.weights} is not a state dict")
        # Checked before pinning: a service that is refused costs no pinned copy.
        skeleton, score = self._skeleton(build, spec, computed_buffers=True)
        wanted = set(skeleton.state_dict())
        missing, unexpected = wanted - set(state), set(state) - wanted
        if missing or unexpected:  # a restore loads strictly: every call would fail later
            wrong = [f"lack {sorted(missing)[:5]}"] if missing else []
            wrong += [f"have unexpected {sorted(unexpected)[:5]}"] if unexpected else []
            raise ServiceError(f"{spec.name}: weights {' and '.join(wrong)}")
        computed = {n: b for n, b in skeleton.named_buffers() if n not in wanted}
        unset = sorted(n for n, b in computed.items() if b.is_meta)
        if unset:
            raise ServiceError(
                f"{spec.name}: buffers {unset[:5]} are on the meta device and not in the "
                f"weights; {spec.entrypoint} must build them without device='meta'"
            )
        nbytes = sum(t.numel() * t.element_size() for t in (*state.values(), *computed.values()))
        if nbytes > bytes_per_device(spec):
            raise ServiceError(
                f"{spec.name}: weights are {nbytes} bytes, more than gpuMemoryGiB allows "
                f"({bytes_per_device(spec)})"
            )
        host, buffers = self._keep(state), self._keep(computed)
        del state  # unmaps the file
        service = _Service(spec, build, score, host, nbytes, buffers, sources)
        with self._lock:  # with its idle instances' eviction: no call may start on one
            self.services[spec.name] = service
            if held is not None:
                self._evict_idle(spec.name)
        self.loads += 1
        return self.clock() - t0

    def _keep(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The one host copy that stays: pinned (DMA-able) with CUDA, else plain memory of
        its own, so the weights file is never read again and may change or go."""
        return {
            k: (v.pin_memory() if self.cuda else v.clone(memory_format=torch.contiguous_format))
            for k, v in tensors.items()
        }

    @staticmethod
    def _skeleton(
        build: Callable[[], tuple[torch.nn.Module, Score]],
        spec: ServiceDef,
        *,
        computed_buffers: bool = False,
    ) -> tuple[torch.nn.Module, Score]:
        """``build()`` with its parameters on ``meta`` (no memory, no init). Its buffers are
        on ``meta`` too unless ``computed_buffers``: then they are computed on the CPU, as at
        load, where the ones missing from the weights are kept."""
        try:
            with parameters_on_meta() if computed_buffers else torch.device("meta"):
                built = build()
        except Exception as e:  # its type says what went wrong as much as its message
            raise ServiceError(
                f"{spec.name}: {spec.entrypoint} raised {type(e).__name__}: {e}"
            ) from None
        if not (isinstance(built, tuple) and len(built) == 2):
            raise ServiceError(f"{spec.name}: {spec.entrypoint} must return (module, score)")
        module, score = built
        if not isinstance(module, torch.nn.Module) or not callable(score):
            raise ServiceError(f"{spec.name}: {spec.entrypoint} must return (module, score)")
        return module, score

    # ---- calls -------------------------------------------------------------------------
    def call(
        self, service_name: str, chunk: Sequence[int], inputs: list[Any]
    ) -> tuple[list[Any], CallStats]:
        """Run ``inputs`` through service ``service_name`` on the devices of ``chunk``."""
        key: InstanceKey = instance_key(service_name, chunk)
        chunk = key[1]
        with self._lock:
            # A call shares its GPUs only with calls of its own instance once it is resident
            # (the scheduler's batching). Anything else there (a restore, or a call from
            # before the link dropped, when the agent reconnected or the scheduler restarted)
            # it waits for, rather than share the GPUs or fail.
            self._freed.wait_for(lambda: self._may_run(key))
            service = self._service(service_name)  # as it is now, after any wait
            if self._calls.get(key):  # it joins the calls running on the instance
                plan = Plan(hit=True)
            else:
                plan = self.residency.plan(key, service.bytes_per_device)
            stats = CallStats(hit=plan.hit)
            # How the scheduler will take a failure of this call: one that restored its
            # instance, or joined others on it, leaves the instance out of its books.
            doubtful = not plan.hit or bool(self._calls.get(key))
            self._carry_out(plan, stats)
            # Ours from here (with any calls that join): no other instance plans on them.
            self._calls[key] = self._calls.get(key, 0) + 1
            self._running.update(dict.fromkeys(chunk, key))
            if not plan.hit:
                # Its memory is taken now and pinned while copied, as a restore ahead's:
                # nothing else (a restore ahead among them) plans on it meanwhile.
                self.residency.admit(key, service.bytes_per_device)
            else:
                self.hits += 1
                resident = self.instances[key]
            self.residency.acquire(key)
        failed = True
        try:
            if not plan.hit:  # outside the lock: calls on other chunks go on meanwhile
                resident = self._copy(service, chunk, stats)
                with self._lock:
                    self.instances[key] = resident
                    self.restores += 1
                    self._freed.notify_all()  # calls waiting to join it may now
            t0 = self.clock()
            outputs = self._run(resident, chunk, inputs)
            stats.exec_s = self.clock() - t0
            failed = False
        finally:
            with self._lock:
                self.residency.release(key)
                last = self._calls[key] == 1
                if last and (
                    key not in self.instances
                    or self.services.get(service_name) is not service
                    or (failed and doubtful)
                ):
                    # Its restore failed; or its service was edited or removed; or it failed
                    # after restoring (or joining) the instance, which the scheduler then
                    # counts as not resident: the worker must not hold what it does not see.
                    self._evict(key)
                if last:
                    del self._calls[key]
                    for d in chunk:
                        del self._running[d]
                else:
                    self._calls[key] -= 1
                self._freed.notify_all()
        return outputs, stats

    def restore_ahead(self, service_name: str, chunk: Sequence[int]) -> CallStats:
        """Make the instance of ``service_name`` on ``chunk`` resident before its call comes
        (the scheduler restores ahead into memory it saw free). Unlike a call it neither
        waits for the devices nor holds them: calls of other instances run there meanwhile.
        A call of this instance waits for it, as for any restore. It evicts only idle
        instances, as a call's restore does; raises ``BusyError`` if running calls hold the
        memory. ``hit``: it was resident (or being restored) already."""
        key: InstanceKey = instance_key(service_name, chunk)
        chunk = key[1]
        with self._lock:
            service = self._service(service_name)
            if key in self.residency.resident or self._calls.get(key):
                return CallStats(hit=True)
            plan = self.residency.plan(key, service.bytes_per_device)
            stats = CallStats(hit=False)
            self._carry_out(plan, stats)
            # Its memory is taken now and pinned while copied: nothing else plans on it.
            self.residency.admit(key, service.bytes_per_device)
            self.residency.acquire(key)
            self._ahead.add(key)
        done = False
        try:
            resident = self._copy(service, chunk, stats)
            with self._lock:
                self.instances[key] = resident
                self.restores += 1
                done = True
        finally:
            with self._lock:
                self._ahead.discard(key)
                self.residency.release(key)
                if not done or self.services.get(service_name) is not service:
                    self._evict(key)  # failed, or its service was edited or removed meanwhile
                self._freed.notify_all()  # its calls may run now
        return stats

    def _service(self, service_name: str) -> _Service:
        """The loaded service of that name (called holding the lock)."""
        service = self.services.get(service_name)
        if service is None:
            raise ServiceError(
                f"unknown service {service_name!r} (loaded: {sorted(self.services)})"
            )
        return service

    def _carry_out(self, plan: Plan, stats: CallStats) -> None:
        """Evict what ``plan`` says (called holding the lock), into ``stats``."""
        t0 = self.clock()
        for victim in plan.evict:
            self._evict(victim)
            stats.evicted.append(name(victim))
        stats.evict_s = self.clock() - t0

    def _copy(self, service: _Service, chunk: Sequence[int], stats: CallStats) -> _Resident:
        """Restore ``service`` onto ``chunk``'s devices, one replica each at once, into
        ``stats`` (outside the lock: calls on other chunks go on meanwhile)."""
        t0 = self.clock()
        replicas = self._parallel(
            [partial(self._restore, service, d) for d in chunk], self._restorer
        )
        self._synchronize(chunk)
        stats.restore_s = self.clock() - t0
        stats.restored_bytes = service.nbytes * len(chunk)
        passes = [SharedPasses(service.spec.max_batch) for _ in chunk]
        return _Resident(replicas, passes, service)

    def _may_run(self, key: InstanceKey) -> bool:
        """Whether a call of ``key`` may start now (called holding the lock): its GPUs are
        free, or they run ``key`` itself, resident and built of the service as it is now;
        and ``key`` is not being restored ahead (the call waits for that restore)."""
        if key in self._ahead:
            return False
        there = {self._running.get(d) for d in key[1]}
        if there == {None}:
            return True
        resident = self.instances.get(key)
        return (
            there == {key}
            and resident is not None
            and resident.service is self.services.get(key[0])
        )

    def _parallel(self, jobs: list[Callable[[], T]], pool: Executor | None = None) -> list[T]:
        """Run one job per device at once (a DoP-k call drives its k GPUs together): the
        first in this thread, the others in ``pool``. Returns once every job has ended,
        raising the first error: a replica still on its GPU must not outlive the call."""
        if len(jobs) == 1:
            return [jobs[0]()]
        others = [(pool or self._pool).submit(job) for job in jobs[1:]]
        try:
            first = jobs[0]()
        finally:
            wait(others)
        return [first, *(f.result() for f in others)]

    def loaded_bytes(self, service: str) -> int:
        return self.services[service].nbytes

    def _current(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """Make ``index`` the thread's current CUDA device. Worker threads otherwise keep
        device 0, where a score's ``.cuda()`` or ``current_stream()`` would land, on a GPU
        that another call may have."""
        return torch.cuda.device(self.device(index)) if self.cuda else contextlib.nullcontext()

    def _restore(self, service: _Service, index: int) -> torch.nn.Module:
        device = self.device(index)
        with self._current(index):
            module, _ = self._skeleton(service.build, service.spec)
            # copy=True: on the CPU too the instance gets its own memory, as on a GPU.
            host = service.host.items()
            state = {k: v.to(device, non_blocking=True, copy=True) for k, v in host}
            module.load_state_dict(state, strict=True, assign=True)
            for path, value in service.buffers.items():
                owner, _, leaf = path.rpartition(".")
                module.get_submodule(owner).register_buffer(
                    leaf, value.to(device, non_blocking=True, copy=True), persistent=False
                )
            return module.eval()

    def _evict(self, key: InstanceKey) -> None:
        self.residency.evict(key)
        self.instances.pop(key, None)  # the device tensors go with their last reference
        self.evictions += 1
        # The freed blocks stay in PyTorch's cache, where the restore that made room for
        # itself takes them; only evict_all hands memory back (empty_cache waits for the
        # whole device, so never per eviction under the lock).

    def _synchronize(self, chunk: Sequence[int]) -> None:
        if self.cuda:
            for i in chunk:
                torch.cuda.synchronize(self.device(i))

    def _run(self, resident: _Resident, chunk: Sequence[int], inputs: list[Any]) -> list[Any]:
        service, replicas, passes = resident.service, resident.replicas, resident.passes
        score = service.score
        k = len(replicas)
        share = -(-len(inputs) // k) if inputs else 0  # ceil: the batch over the replicas

        def replica_run(r: int) -> list[Any]:
            part = inputs[r * share : (r + 1) * share]

            def forward(batch: list[Any]) -> list[Any]:
                # Per thread: the inference mode and the current device are thread-local,
                # and the pass may run in the thread of another call on this replica.
                with torch.inference_mode(), self._current(chunk[r]):
                    got = score(replicas[r], batch)
                # Before its length is taken or it is sliced: a dict or a generator would
                # fail there with a message that names neither. (The service is named by
                # the agent's error, once.) A tensor passes, to be named with where it is
                # by the check of the outputs.
                if isinstance(got, (Mapping, str, bytes)) or not (
                    hasattr(got, "__len__") and hasattr(got, "__getitem__")
                ):
                    raise ServiceError(
                        f"score returned {a_type(got)}, not a list with one output per input"
                    )
                if len(got) != len(batch):
                    raise ServiceError(f"score returned {len(got)} outputs for {len(batch)} inputs")
                return got

            # Forward passes of at most maxBatch inputs, shared with concurrent calls.
            return passes[r].run(part, forward)

        parts = self._parallel([partial(replica_run, r) for r in range(k)])
        self._synchronize(chunk)
        return [o for part in parts for o in part]

    def _threads(self) -> tuple[DaemonThreads, DaemonThreads]:
        """Threads for replicas, and for restores: daemons, so that a call that cannot be
        stopped does not hold the process's exit."""
        devices = self._devices
        replicas = DaemonThreads(2 * devices * MAX_CALLS, thread_name_prefix="gpu-replica")
        return replicas, DaemonThreads(devices, thread_name_prefix="gpu-restore")

    def close(self) -> None:
        """The agent stops: the threads of replicas and restores end once their work has
        ended. Later work (the same agent under a restarted embedded scheduler) gets new
        ones."""
        old = (self._pool, self._restorer)
        self._pool, self._restorer = self._threads()
        for threads in old:
            threads.shutdown(wait=False)

    def evict_all(self, service: str | None = None) -> None:
        """Drop idle instances (of ``service``, or all); running ones stay. Their memory
        goes back to the device, for other processes' NVML view."""
        with self._lock:
            idle = self._evict_idle(service)
        if idle and self.cuda:
            torch.cuda.empty_cache()

    def _evict_idle(self, service: str | None) -> bool:
        """Drop the idle instances of ``service`` (or all), holding the lock; whether any."""
        idle = [
            key
            for key, placement in self.residency.resident.items()
            if (service is None or key[0] == service) and not placement.busy
        ]
        for key in idle:
            self._evict(key)
        return bool(idle)

    def unload(self, service: str) -> None:
        """Forget a service (its RewardService was removed or changed): its idle instances
        and its host copy go; a running call keeps its own references until it ends."""
        self.evict_all(service)
        self.services.pop(service, None)

    def resident_instances(self) -> list[tuple[str, list[int]]]:
        """(service, devices), least recently used first."""
        with self._lock:
            return [(k[0], list(p.devices)) for k, p in self.residency.resident.items()]


def cuda_count() -> int:
    """Visible CUDA devices (0 without CUDA), without opening a context on any."""
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def cuda_memory(devices: Sequence[int] | None = None) -> list[int]:
    """Total memory of ``devices`` (default: every visible one), bytes; empty without
    CUDA. Read from the device properties, which opens no context on the device."""
    if devices is None:
        devices = range(cuda_count())
    return [int(torch.cuda.get_device_properties(d).total_memory) for d in devices]


def cuda_name(device: int = 0) -> str:
    """The model of a visible CUDA device, as reports name it."""
    return str(torch.cuda.get_device_name(device))


__all__ = [
    "CallStats",
    "GpuWorker",
    "ServiceError",
    "bytes_per_device",
    "cuda_count",
    "cuda_memory",
    "cuda_name",
    "read_weights",
    "resolve",
]
