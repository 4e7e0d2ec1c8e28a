"""A GPU call runs in a thread that cannot be stopped: its cancelled caller is answered
only once the thread is done with the GPUs (no torch needed)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tangram.node_agent.gpu_service import _in_thread


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
