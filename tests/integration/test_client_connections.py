"""The client's connections under a limit on open files: it holds no more than half the
process's limit by default (``max_connections``), so a worker with many trajectories in
flight under ``ulimit -n`` waits for a connection rather than failing; and one that has
run out of file descriptors all the same says so at once, not "cannot reach the service
(is it running?)" after every retry. The client runs in a child process under a low
``RLIMIT_NOFILE``; its peer is a server on 127.0.0.1 in this one."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from tangram.client import AsyncClient
from tangram.client.common import default_max_connections

from .http_stub import JsonHandler, http_serving

GUARD_S = 120  # a child not done by then hangs: a failure, not a wait
LIMIT = 64  # the child's soft RLIMIT_NOFILE
STRAGGLERS_S = 10  # a group that never fills is answered after this


class _Overlapping(JsonHandler):
    """Answers GETs in groups of ``group`` that waited at once (so that they overlap,
    however fast they come), and counts the requests waiting at once."""

    group = 8
    cond = threading.Condition()
    waiting = 0
    groups = 0
    in_flight = 0
    peak = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server names it)
        cls = type(self)
        with cls.cond:
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            cls.waiting += 1
            group = cls.groups
            if cls.waiting == cls.group:
                cls.waiting, cls.groups = 0, cls.groups + 1
                cls.cond.notify_all()
            else:
                # (every group fills when the client's requests all come; those that
                # cannot, with some refused, are answered after STRAGGLERS_S)
                cls.cond.wait_for(lambda: cls.groups != group, STRAGGLERS_S)
            cls.in_flight -= 1  # (before it answers: no next request can come before)
        self.answer(200, b"ok")


@pytest.fixture
def overlapping() -> Iterator[str]:
    _Overlapping.waiting = _Overlapping.groups = _Overlapping.in_flight = _Overlapping.peak = 0
    with http_serving(_Overlapping) as url:
        yield url


def _child(script: str, url: str) -> dict[str, object]:
    """Run ``script`` (the body of ``async def main(url)``, returning a JSON-able value)
    in a child process whose soft limit on open files is ``LIMIT``; what it returned."""
    program = textwrap.dedent("""\
        import asyncio, json, os, resource, sys
        from tangram.client import AsyncClient
        async def main(url):
        {body}
        print(json.dumps(asyncio.run(main(sys.argv[1]))))
        """).format(body=textwrap.indent(textwrap.dedent(script), "    "))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = subprocess.run(
        [sys.executable, "-c", program, url],
        check=False, capture_output=True, text=True, timeout=GUARD_S,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


def test_many_requests_at_once_under_a_low_limit_on_open_files_wait_for_a_connection(
    overlapping: str,
) -> None:
    """The probe's worker: more files read at once than ``ulimit -n`` allows sockets.
    With no bound every one had a connection of its own: past the limit "Too many open
    files", reported as the service being unreachable after every retry."""
    answer = _child(
        """
        async with AsyncClient(url, "t" * 24, stream=False, retries=0) as c:
            reads = [c.files("t-1").read(f"f{i}") for i in range(96)]
            got = await asyncio.gather(*reads, return_exceptions=True)
            return {"bound": c.max_connections,
                    "failed": [repr(g) for g in got if not isinstance(g, bytes)][:3]}
        """,
        overlapping,
    )
    assert answer == {"bound": LIMIT // 2, "failed": []}
    assert _Overlapping.peak <= LIMIT // 2


def test_running_out_of_file_descriptors_is_said_at_once(overlapping: str) -> None:
    """Not retried (no retry finds a descriptor the process has none of): a retry here
    would wait an hour, and the child's guard would end it."""
    answer = _child(
        """
        async with AsyncClient(url, "t" * 24, stream=False, backoff_s=3600.0) as c:
            held = []
            try:
                while True:  # every descriptor this process may have
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            try:
                await c.files("t-1").read("a")
            except OSError as e:
                return {"type": type(e).__name__, "errno": e.errno, "said": str(e)}
            finally:
                for fd in held:
                    os.close(fd)
        """,
        overlapping,
    )
    assert answer["type"] == "TooManyOpenFilesError" and answer["errno"] == 24, answer
    said = str(answer["said"])
    assert f"{LIMIT} files open at once" in said and "RLIMIT_NOFILE" in said, said
    assert f"up to {LIMIT // 2} connections (max_connections)" in said, said


def test_max_connections_bounds_the_client_s_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        async with AsyncClient("http://127.0.0.1:9", "t" * 24, max_connections=4) as c:
            pools = [session.connector for session in (c._http(), c._cancels())]
            assert [pool.limit if pool is not None else None for pool in pools] == [4, 32]
        with pytest.raises(ValueError, match="max_connections"):
            AsyncClient("http://127.0.0.1:9", "t" * 24, max_connections=-1)

    asyncio.run(main())
    for soft, bound in ((1024, 512), (20, 16), (1 << 20, 4096), (resource.RLIM_INFINITY, 4096)):
        monkeypatch.setattr(resource, "getrlimit", lambda _, s=soft: (s, s))
        assert default_max_connections() == bound, soft
