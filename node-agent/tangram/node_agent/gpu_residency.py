"""Which service instances hold GPU memory, and what to evict to restore one (pure).

The GPU manager of ARL-Tangram (seed 000 §5.3): every reward service is loaded once into
host memory; a call gets a chunk of 1/2/4/8 GPUs from the scheduler, and the service's
instance for that DoP is restored into the chunk unless it is already resident there.
Instances stay resident after their calls (a later call on the same chunk is a hit) until
memory is needed: then the least recently used idle instances on the chunk's devices that
lack room are evicted. Eviction writes nothing back (the host copy is the master).

This module only decides; :mod:`tangram.node_agent.gpu_worker` moves the tensors. The
accounting is in bytes per device against a capacity the worker measured (NVML's total
minus a reserve for the CUDA context and allocator slack), so that a restore the plan
admits never runs out of memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

InstanceKey = tuple[str, tuple[int, ...]]
"""(service name, its devices, ascending): as in the scheduler's GPU pool, an instance is a
service on one chunk, so a DoP-2 instance and two DoP-1 instances are three instances."""


class NeverFitsError(ValueError):
    """A service that needs more memory per device than a device has."""


class BusyError(RuntimeError):
    """The chunk's memory is held by instances that are running calls."""


@dataclass
class Placement:
    devices: tuple[int, ...]
    bytes_per_device: int
    busy: int = 0  # calls running on it: never evicted while > 0


@dataclass(frozen=True)
class Plan:
    """What to do before a call runs: nothing (a hit), or evict then restore."""

    hit: bool
    evict: tuple[InstanceKey, ...] = ()


@dataclass
class Residency:
    capacity: Mapping[int, int]  # device index -> bytes usable by instances
    resident: OrderedDict[InstanceKey, Placement] = field(default_factory=OrderedDict)
    # least recently used first

    def used(self, device: int) -> int:
        return sum(p.bytes_per_device for p in self.resident.values() if device in p.devices)

    def plan(self, key: InstanceKey, bytes_per_device: int) -> Plan:
        """How to make ``key`` resident on its devices; raises :class:`NeverFitsError` or
        :class:`BusyError` when it cannot be."""
        chunk = key[1]
        unknown = [d for d in chunk if d not in self.capacity]
        if unknown or not chunk:
            raise ValueError(f"devices {list(chunk)}: not this worker's ({sorted(self.capacity)})")
        smallest = min(self.capacity[d] for d in chunk)
        if bytes_per_device > smallest:
            raise NeverFitsError(
                f"{key[0]} needs {size_text(bytes_per_device)} per GPU; a GPU here has "
                f"{size_text(smallest)} for services"
            )
        if key in self.resident:
            return Plan(hit=True)
        evict: list[InstanceKey] = []
        # Bytes each of the chunk's devices still has to free for the instance to fit.
        lacking = {d: self.used(d) + bytes_per_device - self.capacity[d] for d in chunk}

        def short() -> set[int]:
            return {d for d, n in lacking.items() if n > 0}

        # Least recently used first, and only instances on a device still short: one that
        # shares only devices with room to spare stays (the scheduler's pool does the same).
        for other, placement in self.resident.items():
            devices = short()
            if not devices:
                break
            if not placement.busy and devices.intersection(placement.devices):
                evict.append(other)
                for d in placement.devices:
                    if d in lacking:
                        lacking[d] -= placement.bytes_per_device
        if short():
            raise BusyError(
                f"GPUs {list(chunk)}: memory held by running calls; {key[0]} cannot be restored now"
            )
        return Plan(hit=False, evict=tuple(evict))

    def admit(self, key: InstanceKey, bytes_per_device: int) -> None:
        """Record ``key`` as restored (after the plan's evictions were carried out)."""
        self.resident[key] = Placement(key[1], bytes_per_device)
        self.resident.move_to_end(key)

    def evict(self, key: InstanceKey) -> Placement:
        placement = self.resident.pop(key)
        if placement.busy:
            self.resident[key] = placement
            raise BusyError(f"{name(key)} is running")
        return placement

    def acquire(self, key: InstanceKey) -> None:
        """A call starts on ``key``: it is now the most recently used, and pinned."""
        self.resident[key].busy += 1
        self.resident.move_to_end(key)

    def release(self, key: InstanceKey) -> None:
        self.resident[key].busy -= 1


def instance_key(service: str, devices: Iterable[int]) -> InstanceKey:
    return service, tuple(sorted(devices))


def name(key: InstanceKey) -> str:
    """``judge@0`` or ``teacher@0,1``: the service and its devices."""
    return f"{key[0]}@{','.join(map(str, key[1]))}"


def size_text(n: int) -> str:
    """Bytes as people read them: MiB, or GiB from 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


__all__ = [
    "BusyError",
    "InstanceKey",
    "NeverFitsError",
    "Placement",
    "Plan",
    "Residency",
    "instance_key",
    "name",
    "size_text",
]
