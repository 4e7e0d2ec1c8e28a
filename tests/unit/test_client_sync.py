"""The sync ``Client``'s own event-loop thread: not left behind by a constructor that
fails, and not waited on forever from a forked child, where it does not exist."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tangram.client import Client, ClientClosedError

GUARD_S = 60  # a child not done by then hangs: a failure, not a wait
NOBODY = "http://127.0.0.1:9"  # (no call here reaches it)


def _loop_threads() -> int:
    return sum(t.name == "tangram-client" for t in threading.enumerate())


def test_a_failing_constructor_leaves_no_loop_thread() -> None:
    before = _loop_threads()
    with pytest.raises(TypeError, match="retry"):
        Client(NOBODY, "t" * 24, retry=3)  # (retries=)
    assert _loop_threads() == before


def test_a_forked_child_gets_an_error_not_a_hang() -> None:
    with Client(NOBODY, "t" * 24, retries=0) as client:
        pid = os.fork()
        if pid == 0:  # the child: its exit status says what the call did
            code = 1
            try:
                client.get("t-1")
            except ClientClosedError as e:  # naming the process that made the client
                code = 0 if f"process {os.getppid()}" in str(e) else 3
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + GUARD_S
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the child's call hangs")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(done[1]) == 0
