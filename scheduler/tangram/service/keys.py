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
_SEP = "\x00"  # neither a tenant, an action id nor a target holds it; JSON escapes it


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


R = TypeVar("R", bound=_Record)


class KeyMemory(Generic[R]):
    """(tenant, key) → the action in flight, or what it answered. Keys are kept for the
    newest ``max_keys`` actions and ``max_bytes`` of what their ended actions keep (a
    retry comes within seconds); a key whose action is still in flight is never dropped."""

    def __init__(self, max_keys: int = MAX_KEYS, max_bytes: int = MAX_KEY_BYTES) -> None:
        self.max_keys, self.max_bytes = max_keys, max_bytes
        # oldest first: an OrderedDict pops its front in O(1), a dict does not
        self._entries: OrderedDict[str, R | bytes] = OrderedDict()
        self._in_flight: dict[str, str] = {}  # action id -> its key, until it ends
        self.bytes = 0  # held by ended actions

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tenant_key: object) -> bool:
        return isinstance(tenant_key, tuple) and _SEP.join(tenant_key) in self._entries

    def keys(self) -> list[tuple[str, str]]:
        return [(t, k) for t, _, k in (joined.partition(_SEP) for joined in self._entries)]

    def in_flight(self, record_id: str) -> bool:
        return record_id in self._in_flight

    def get(self, tenant: str, key: str) -> R | Remembered | None:
        entry = self._entries.get(tenant + _SEP + key)
        if not isinstance(entry, bytes):
            return entry
        aid, target, digest, answer = entry.split(b"\x00", 3)
        return Remembered(aid.decode(), target.decode(), answer, digest.decode() or None)

    def remember(self, tenant: str, key: str, record: R) -> None:
        joined = tenant + _SEP + key
        self._entries[joined] = record
        self._in_flight[record.id] = joined
        self._trim()

    def forget(self, tenant: str, key: str, record: R) -> None:
        """Drop a key whose action was withdrawn before it ran (a retry runs it)."""
        joined = tenant + _SEP + key
        if self._entries.get(joined) is record:
            del self._entries[joined]
            self._in_flight.pop(record.id, None)

    def ended(self, record: R, target: str, answer: bytes, digest: str | None = None) -> None:
        """``record`` ended and its submitter got ``answer``: keep only that for a retry
        (and what was asked: ``target``, and the request's ``digest`` where known)."""
        joined = self._in_flight.pop(record.id, None)
        if joined is None or self._entries.get(joined) is not record:
            return
        kept = f"{record.id}{_SEP}{target}{_SEP}{digest or ''}{_SEP}".encode() + answer
        self._entries[joined] = kept  # keeps its place
        self.bytes += len(kept)
        self._trim()

    def _trim(self) -> None:
        for _ in range(len(self._entries)):
            if len(self._entries) <= self.max_keys and self.bytes <= self.max_bytes:
                return
            joined, entry = next(iter(self._entries.items()))
            if not isinstance(entry, bytes):  # in flight (records are never bytes)
                self._entries.move_to_end(joined)
                continue
            self._entries.popitem(last=False)
            self.bytes -= len(entry)


__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "KeyMemory", "Remembered", "request_digest"]
