"""Idempotency keys: what a retry of a key gets, with bounded memory and no GC cost.

A key maps to its action while the action runs (a retry waits for the same result) and to
a plain tuple of strings and bytes once it ended (handed out as :class:`Remembered`). The
cyclic garbage collector stops tracking such a tuple after one pass (an exact tuple only,
not a NamedTuple). Kept as live records instead (request, result, future: ~20 objects
each), the last hundred thousand actions made every young-generation collection a 12–18 ms
pause, once a second at 2,000 actions/s (docs/benchmarks.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, NamedTuple, Protocol, TypeVar

MAX_KEYS = 100_000  # idempotency keys remembered per scheduler ...
MAX_KEY_BYTES = 256 << 20  # ... and the bytes their results may hold


class Remembered(NamedTuple):
    """A finished keyed action, as a retry of its key needs it."""

    id: str
    target: str  # what the key was used for: "exec on t-1", "lease of search"
    result: bytes  # what its submitter got, as JSON


class _Record(Protocol):
    @property
    def id(self) -> str: ...


R = TypeVar("R", bound=_Record)
TenantKey = tuple[str, str]
_Kept = tuple[str, str, bytes]  # Remembered's fields, in a tuple the GC can untrack


class KeyMemory(Generic[R]):
    """(tenant, key) → the action in flight, or what it answered. Keys are kept for the
    newest ``max_keys`` actions and ``max_bytes`` of their results (a retry comes within
    seconds); a key whose action is still in flight is never dropped."""

    def __init__(self, max_keys: int = MAX_KEYS, max_bytes: int = MAX_KEY_BYTES) -> None:
        self.max_keys, self.max_bytes = max_keys, max_bytes
        # oldest first: an OrderedDict pops its front in O(1), a dict does not
        self._entries: OrderedDict[TenantKey, R | _Kept] = OrderedDict()
        self._in_flight: dict[str, TenantKey] = {}  # action id -> its key, until it ends
        self.bytes = 0  # held by remembered results

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tenant_key: object) -> bool:
        return tenant_key in self._entries

    def keys(self) -> list[TenantKey]:
        return list(self._entries)

    def in_flight(self, record_id: str) -> bool:
        return record_id in self._in_flight

    def get(self, tenant: str, key: str) -> R | Remembered | None:
        entry = self._entries.get((tenant, key))
        return Remembered(*entry) if isinstance(entry, tuple) else entry

    def remember(self, tenant: str, key: str, record: R) -> None:
        self._entries[(tenant, key)] = record
        self._in_flight[record.id] = (tenant, key)
        self._trim()

    def forget(self, tenant: str, key: str, record: R) -> None:
        """Drop a key whose action was withdrawn before it ran (a retry runs it)."""
        if self._entries.get((tenant, key)) is record:
            del self._entries[(tenant, key)]
            self._in_flight.pop(record.id, None)

    def ended(self, record: R, target: str, answer: bytes) -> None:
        """``record`` ended and its submitter got ``answer``: keep only that for a retry."""
        tenant_key = self._in_flight.pop(record.id, None)
        if tenant_key is None or self._entries.get(tenant_key) is not record:
            return
        self._entries[tenant_key] = (record.id, target, answer)  # keeps its place
        self.bytes += len(answer)
        self._trim()

    def _trim(self) -> None:
        for _ in range(len(self._entries)):
            if len(self._entries) <= self.max_keys and self.bytes <= self.max_bytes:
                return
            tenant_key, entry = next(iter(self._entries.items()))
            if not isinstance(entry, tuple):  # in flight (records are never tuples)
                self._entries.move_to_end(tenant_key)
                continue
            self._entries.popitem(last=False)
            self.bytes -= len(entry[2])


__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "KeyMemory", "Remembered"]
