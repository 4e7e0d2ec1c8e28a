"""A request head over ``HEAD_BYTES`` is refused however it arrives: in one read (it was
counted a read at a time from the read after the one it began in, so a head of up to
256 KiB sent at once was served), or as one header line that never ends (which the
parser keeps growing without telling, so counting its lines alone missed it)."""

from __future__ import annotations

import pytest

from tangram.service.embedded import HEAD_BYTES, Running

from .test_request_limits import _connect, _read_all, _send_until_refused, running

pytestmark = [pytest.mark.xdist_group("service")]
__all__ = ["running"]  # (the fixture, shared)


@pytest.mark.parametrize("size", [HEAD_BYTES + 1024, 3 * HEAD_BYTES])
def test_a_head_over_the_bound_sent_at_once_gets_431(
    running: tuple[Running, str], size: int
) -> None:
    run, _ = running
    head = f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * size}\r\nConnection: close\r\n\r\n"
    with _connect(run) as s:
        s.sendall(head.encode())
        got = _read_all(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]


def test_one_header_that_never_ends_gets_431(running: tuple[Running, str]) -> None:
    run, _ = running
    with _connect(run) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        _send_until_refused(s, (b"a" * 4096 for _ in range(16 * HEAD_BYTES // 4096)))
        got = _read_all(s)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
