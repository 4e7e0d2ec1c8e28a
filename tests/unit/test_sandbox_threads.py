"""Sandbox opens block a thread each for as long as a sandbox takes to make (a cold pod:
its start and its setup commands, up to minutes): a burst of them must not hold up the
short calls (closes, the gone watch), which used to queue behind them in the one
default thread pool."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from tangram.api.wire import AgentClose, EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.execution import Gone, Opened
from tangram.node_agent.runtimes import Sandboxes

GUARD_S = 60.0  # a close that has not ended by then waits behind the opens: a failure
SPEC = EnvSpec(name="swe", image="swe:1")


class SlowToMake:
    """Opens that block until released; closes and looks that return at once."""

    def __init__(self) -> None:
        self.envs: dict[str, object] = {"done": object()}
        self.release = threading.Event()
        self.opening = 0
        self.lock = threading.Lock()

    def open(self, trajectory: str, template: EnvSpec) -> Opened:
        with self.lock:
            self.opening += 1
        self.release.wait()
        self.envs[trajectory] = object()
        return Opened(trajectory, False, 0.0)

    def close(self, trajectory: str) -> None:
        self.envs.pop(trajectory, None)

    def gone(self) -> list[Gone]:
        return []

    def shutdown_warm(self) -> None:
        return None


def test_a_close_and_the_gone_watch_do_not_wait_behind_blocked_opens(tmp_path: Path) -> None:
    inner = SlowToMake()
    runtime = Sandboxes("slow", inner)
    agent = NodeAgent.create(tmp_path, runtime="noop", cores_for_actions=1)
    agent.runtime = runtime
    # More opens than the default pool has threads (asyncio's: min(32, cpus + 4)).
    burst = min(32, (os.cpu_count() or 1) + 4) + 1

    async def go() -> None:
        opens = [asyncio.ensure_future(runtime.open(f"t{i}", SPEC)) for i in range(burst)]
        try:
            while inner.opening < burst - 1:  # they hold their threads (the default pool's, all)
                await asyncio.sleep(0.01)
            close = asyncio.ensure_future(agent.handle(AgentClose(rid=1, trajectory="done")))
            looked = asyncio.ensure_future(runtime.gone())
            done, _ = await asyncio.wait({close, looked}, timeout=GUARD_S)
            assert done == {close, looked}, "a short call waited behind the opens"
            assert close.result().ok and looked.result() == []
            assert "done" not in inner.envs
        finally:
            inner.release.set()
            await asyncio.gather(*opens, return_exceptions=True)
            await runtime.shutdown()

    asyncio.run(go())
