"""Idempotency keys: what a retry of a key gets, with bounded memory and no GC cost.

A key maps to its action while the action runs (a retry waits for the same result) and to
one ``bytes`` object once it ended (handed out as :class:`Remembered`): the action's id,
the key's target, the request's digest and the answer, NUL-separated. Keys are ``str``
too. Neither is a container, so the cyclic garbage collector never tracks them. Kept as
live records instead (request, result, future: ~20 objects each), the last hundred
thousand actions made every young-generation collection a 12–18 ms pause, once a second
at 2,000 actions/s; kept as tuples, the 2,000 a second it made were most of what filled
the young generation (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Generic, NamedTuple, Protocol, TypeVar

from pydantic import BaseModel

MAX_KEYS = 100_000  # idempotency keys remembered per scheduler ...
MAX_KEY_BYTES = 256 << 20  # ... and the bytes their results may hold
_SEP = "\x00"  # neither an action id nor a target holds it; JSON escapes it


def request_digest(request: BaseModel) -> str:
    """What a retry must send again, as a short digest: the whole request but its key. A
    key reused with another body (another command on the same trajectory, say) is a
    client's bug; answered with the first body's result it would go unseen."""
    body = request.model_dump_json(exclude={"idempotency_key"}).encode()
    return hashlib.blake2b(body, digest_size=8).hexdigest()


class Remembered(NamedTuple):
    """A finished keyed action, as a retry of its key needs it."""

    id: str
    target: str  # what the key was used for: "exec on t-1", "lease of search"
    result: bytes  # what its submitter got, as JSON
    digest: str | None = None  # its request's (request_digest); None: not known


class _Record(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def target(self) -> str: ...


def exec_target(trajectory: str) -> str:
    """What an exec (a session step) on the trajectory its tenant calls so is for."""
    return f"exec on {trajectory}"


R = TypeVar("R", bound=_Record)


class KeyMemory(Generic[R]):
    """(tenant, key) → the action in flight, or what it answered. Keys are kept for the
    newest ``max_keys`` actions and ``max_bytes`` of what their ended actions keep (a
    retry comes within seconds); a key whose action is still in flight is never dropped.
    Over a bound, the tenant holding the most (keys, or bytes) loses its oldest first: one
    tenant's flood of keys does not erase another's, whose retries would run again."""

    def __init__(self, max_keys: int = MAX_KEYS, max_bytes: int = MAX_KEY_BYTES) -> None:
        self.max_keys, self.max_bytes = max_keys, max_bytes
        # tenant -> key -> entry, oldest first: an OrderedDict pops its front in O(1)
        self._tenants: dict[str, OrderedDict[str, R | bytes]] = {}
        self._bytes: dict[str, int] = {}  # tenant -> what its ended actions keep
        self._in_flight: dict[str, tuple[str, str]] = {}  # action id -> its (tenant, key)
        self._count = 0
        self.bytes = 0  # held by ended actions

    def __len__(self) -> int:
        return self._count

    def __contains__(self, tenant_key: object) -> bool:
        if not isinstance(tenant_key, tuple) or len(tenant_key) != 2:
            return False
        tenant, key = tenant_key
        entries = self._tenants.get(tenant)
        return entries is not None and key in entries

    def keys(self) -> list[tuple[str, str]]:
        return [(t, k) for t, entries in self._tenants.items() for k in entries]

    def in_flight(self, record_id: str) -> bool:
        return record_id in self._in_flight

    def get(self, tenant: str, key: str) -> R | Remembered | None:
        entries = self._tenants.get(tenant)
        entry = None if entries is None else entries.get(key)
        if not isinstance(entry, bytes):
            return entry
        aid, target, digest, answer = entry.split(b"\x00", 3)
        return Remembered(aid.decode(), target.decode(), answer, digest.decode() or None)

    def remember(self, tenant: str, key: str, record: R) -> None:
        entries = self._tenants.setdefault(tenant, OrderedDict())
        self._bytes.setdefault(tenant, 0)
        old = entries.pop(key, None)
        if old is None:
            self._count += 1
        elif isinstance(old, bytes):
            self._kept(tenant, -len(old))
        entries[key] = record
        self._in_flight[record.id] = (tenant, key)
        self._trim()

    def forget(self, tenant: str, key: str, record: R) -> None:
        """Drop a key whose action was withdrawn before it ran (a retry runs it)."""
        entries = self._tenants.get(tenant)
        if entries is not None and entries.get(key) is record:
            del entries[key]
            self._count -= 1
            self._in_flight.pop(record.id, None)
            self._drop_if_empty(tenant)

    def drop(self, tenant: str, key: str, target: str) -> None:
        """Forget ``key`` if it is used for ``target`` (its action ended or not: one still
        running ends unremembered)."""
        entries = self._tenants.get(tenant)
        entry = None if entries is None else entries.get(key)
        if entries is None or entry is None:
            return
        if isinstance(entry, bytes):
            if entry.split(b"\x00", 2)[1].decode() != target:
                return
            self._kept(tenant, -len(entry))
        elif entry.target != target:
            return
        else:
            self._in_flight.pop(entry.id, None)
        del entries[key]
        self._count -= 1
        self._drop_if_empty(tenant)

    def ended(self, record: R, target: str, answer: bytes, digest: str | None = None) -> None:
        """``record`` ended and its submitter got ``answer``: keep only that for a retry
        (and what was asked: ``target``, and the request's ``digest`` where known)."""
        where = self._in_flight.pop(record.id, None)
        if where is None:
            return
        tenant, key = where
        entries = self._tenants.get(tenant)
        if entries is None:
            return
        if entries.get(key) is not record:
            return
        kept = f"{record.id}{_SEP}{target}{_SEP}{digest or ''}{_SEP}".encode() + answer
        entries[key] = kept  # keeps its place
        self._kept(tenant, len(kept))
        self._trim()

    def _kept(self, tenant: str, n: int) -> None:
        self._bytes[tenant] += n
        self.bytes += n

    def _trim(self) -> None:
        while self._count > self.max_keys or self.bytes > self.max_bytes:
            if self.bytes > self.max_bytes:
                heaviest = sorted(self._tenants, key=self._bytes.__getitem__, reverse=True)
            else:
                heaviest = sorted(self._tenants, key=lambda t: len(self._tenants[t]), reverse=True)
            if not any(self._drop_oldest(t) for t in heaviest):
                return  # every key left is in flight

    def _drop_oldest(self, tenant: str) -> bool:
        """Drop ``tenant``'s oldest ended key; False when all of its keys are in flight."""
        entries = self._tenants[tenant]
        for _ in range(len(entries)):
            key, entry = next(iter(entries.items()))
            if not isinstance(entry, bytes):  # in flight (records are never bytes)
                entries.move_to_end(key)
                continue
            entries.popitem(last=False)
            self._count -= 1
            self._kept(tenant, -len(entry))
            self._drop_if_empty(tenant)
            return True
        return False

    def _drop_if_empty(self, tenant: str) -> None:
        if not self._tenants.get(tenant, True):
            del self._tenants[tenant], self._bytes[tenant]


__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "KeyMemory", "Remembered", "request_digest"]
