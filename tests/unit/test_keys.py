"""Idempotency keys: in flight they name the action, ended they keep only its answer."""

from __future__ import annotations

from dataclasses import dataclass

from tangram.api.wire import ExecRequest
from tangram.service.keys import KeyMemory, Remembered, request_digest


@dataclass
class Rec:
    id: str
    target: str = "exec on t-1"


def test_an_ended_action_leaves_only_its_answer_untracked_by_the_gc() -> None:
    m: KeyMemory[Rec] = KeyMemory()
    rec = Rec("a-1")
    m.remember("t", "k", rec)
    assert m.get("t", "k") is rec and m.in_flight("a-1")
    m.ended(rec, "exec on x", b'{"id":"a-1"}')
    kept = m.get("t", "k")
    assert kept == Remembered("a-1", "exec on x", b'{"id":"a-1"}') and not m.in_flight("a-1")
    assert m.bytes == len(b'a-1\x00exec on x\x00\x00{"id":"a-1"}')  # all it keeps (no digest)
    (joined, stored), *_ = m._tenants["t"].items()
    # no container the GC tracks: a str key and a bytes value, walked by no collection
    assert isinstance(joined, str) and isinstance(stored, bytes)


def test_the_oldest_ended_keys_go_first_and_in_flight_ones_stay() -> None:
    m: KeyMemory[Rec] = KeyMemory(max_keys=2)
    running = Rec("a-0")
    m.remember("t", "k0", running)
    for i in range(1, 5):
        rec = Rec(f"a-{i}")
        m.remember("t", f"k{i}", rec)
        m.ended(rec, "x", b"{}")
    # k0 is still running: it stays (moved behind the newest) while ended keys go
    assert m.keys() == [("t", "k4"), ("t", "k0")]
    m.ended(running, "x", b"{}")
    assert len(m) == 2


def test_the_byte_bound_counts_what_ended_actions_keep() -> None:
    m: KeyMemory[Rec] = KeyMemory(max_bytes=24)
    for i in range(3):
        rec = Rec(f"a-{i}")
        m.remember("t", f"k{i}", rec)
        m.ended(rec, "x", b"12345")  # kept as b"a-i\x00x\x00\x0012345": 12 bytes
    assert m.keys() == [("t", "k1"), ("t", "k2")] and m.bytes == 24


def test_one_tenants_flood_of_keys_does_not_erase_anothers() -> None:
    """Over a bound, the tenant holding the most loses its oldest keys: a retry of the
    quiet tenant's key still gets its answer (else it would run again)."""
    m: KeyMemory[Rec] = KeyMemory(max_keys=10, max_bytes=1000)
    for i in range(3):
        rec = Rec(f"b-{i}")
        m.remember("bob", f"k{i}", rec)
        m.ended(rec, "x", b"{}")
    for i in range(100):
        rec = Rec(f"a-{i}")
        m.remember("alice", f"k{i}", rec)
        m.ended(rec, "x", b"{}")
    kept = m.keys()
    assert [k for t, k in kept if t == "bob"] == ["k0", "k1", "k2"]
    assert len(m) == 10 and next(k for t, k in kept if t == "alice") == "k93"
    big = Rec("a-big")  # the bytes bound: the tenant holding the most bytes pays
    m.remember("alice", "big", big)
    m.ended(big, "x", b"y" * 900)
    assert ("bob", "k0") in m and m.bytes <= 1000
    assert m.bytes == sum(
        len(e) for es in m._tenants.values() for e in es.values() if isinstance(e, bytes)
    )


def test_forget_and_a_late_end_touch_only_their_own_record() -> None:
    m: KeyMemory[Rec] = KeyMemory()
    first, second = Rec("a-1"), Rec("a-2")
    m.remember("t", "k", first)
    m.forget("t", "k", second)  # not the key's action: nothing happens
    assert m.get("t", "k") is first
    m.forget("t", "k", first)
    assert ("t", "k") not in m and not m.in_flight("a-1")
    m.remember("t", "k", second)
    m.ended(first, "x", b"{}")  # a withdrawn action ending later does not overwrite
    assert m.get("t", "k") is second and m.bytes == 0


def test_a_key_holding_the_separator_stays_apart_from_its_tenant() -> None:
    m: KeyMemory[Rec] = KeyMemory()
    rec = Rec("a-1")
    m.remember("t", "k\x00with\x00nul", rec)
    m.ended(rec, "exec on t-1", b'{"s":"a\\u0000b"}')
    assert m.keys() == [("t", "k\x00with\x00nul")] and ("t", "k\x00with\x00nul") in m
    assert m.get("t", "k\x00with\x00nul") == Remembered("a-1", "exec on t-1", b'{"s":"a\\u0000b"}')
    assert m.get("t", "k") is None


def test_an_ended_key_keeps_its_requests_digest() -> None:
    m: KeyMemory[Rec] = KeyMemory()
    rec = Rec("a-1")
    m.remember("t", "k", rec)
    m.ended(rec, "exec on t-1", b"{}", "0123456789abcdef")
    assert m.get("t", "k") == Remembered("a-1", "exec on t-1", b"{}", "0123456789abcdef")


def test_a_request_digest_ignores_the_key_and_sees_every_other_field() -> None:
    run = ExecRequest(argv=["pytest", "-q"], idempotency_key="k1")
    assert request_digest(run) == request_digest(run.model_copy(update={"idempotency_key": "k2"}))
    assert request_digest(run) == request_digest(ExecRequest.model_validate_json(
        '{"argv": ["pytest", "-q"], "pty": false, "idempotency_key": "k1"}'
    ))  # fmt: skip
    for other in ({"argv": ["pytest"]}, {"stdin": "y"}, {"env": {"A": "1"}}, {"timeout_s": 5}):
        assert request_digest(run) != request_digest(run.model_copy(update=other)), other
