"""A GPU call runs in a thread that cannot be stopped: its cancelled caller is answered
only once the thread is done with the GPUs, and the process's exit does not wait for it
(no torch needed)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from tangram.node_agent.daemon_threads import DaemonThreads
from tangram.node_agent.gpu_service import _in_thread

GUARD_S = 120.0  # a hang's bound, far above any run's time: never a timing assertion


def test_a_call_cancelled_twice_is_answered_only_once_its_thread_is_done() -> None:
    started, gate, done = threading.Event(), threading.Event(), threading.Event()

    def work() -> int:
        started.set()
        gate.wait(30)
        done.set()
        return 1

    async def scenario() -> bool:
        task = asyncio.create_task(_in_thread("rm", work))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0)  # it waits for the thread now
        task.cancel()  # a repeated cancel of the same call
        threading.Timer(0.2, gate.set).start()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done.is_set()

    assert asyncio.run(scenario())  # the GPUs were free when the cancel was answered


def test_the_call_threads_never_hold_the_process_exit() -> None:
    """A call that cannot end is abandoned at the stop: the standard pool's threads were
    joined at exit, so a stopped agent lived on until its call returned."""
    script = (
        "import threading\n"
        "from tangram.node_agent.daemon_threads import DaemonThreads\n"
        "threads = DaemonThreads(2, thread_name_prefix='gpu-call')\n"
        "started = threading.Event()\n"
        "threads.submit(lambda: (started.set(), threading.Event().wait()))\n"
        "assert threads.submit(lambda: 6 * 7).result() == 42\n"
        "started.wait()\n"
        "threads.shutdown(wait=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=GUARD_S, check=False)
    assert done.returncode == 0


def test_daemon_threads_carry_errors_and_refuse_work_after_shutdown() -> None:
    threads = DaemonThreads(1, thread_name_prefix="t")
    failed = threads.submit(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(GUARD_S)
    threads.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.submit(int)
