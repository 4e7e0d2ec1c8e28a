"""What the benchmarks that run the real service share: the service on 127.0.0.1, a node
agent in a process of its own (as in a cluster, its work — process starts, a file's bytes —
never stalls the scheduler's event loop), and a quantile of few samples."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tangram.cli.files import InputError
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import PoolConfig
from tangram.service.embedded import Running, free_port, run

NODE = "bench"


@asynccontextmanager
async def bench_pool(
    config: PoolConfig,
    work: Path,
    tenants: Sequence[str],
    *,
    runtime: str,
    cores: int | None = None,
    what: str,
) -> AsyncIterator[tuple[Running, dict[str, str]]]:
    """The service on 127.0.0.1 and one ``tangram agent --runtime runtime`` connected to it;
    yields it and a token per tenant. ``what`` names the benchmark in errors."""
    tokens = {secrets.token_urlsafe(24): t for t in (*tenants, AGENT_TENANT)}
    work.mkdir(parents=True)
    (work / "tokens").write_text("".join(f"{k} {t}\n" for k, t in tokens.items()))
    async with serving(config, TokenStore(tokens), None, what=what) as running:
        running.engine.all_agents_joined()  # a fresh pool: no trajectory to wait for
        async with _agent(running, work, runtime, cores, what):
            yield running, {t: k for k, t in tokens.items()}


@asynccontextmanager
async def serving(
    config: PoolConfig, tokens: TokenStore, agent: NodeAgent | None, *, what: str
) -> AsyncIterator[Running]:
    """The service on 127.0.0.1 (with ``agent`` in its process, if given) until the body
    ends; a service that stops at start says why instead of being waited for."""
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        run(config, tokens, agent, stop, port=free_port(), on_ready=ready.set_result)
    )
    try:
        first: set[asyncio.Future[Any]] = {server, ready}
        done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if server in done:
            server.result()  # why it could not start
            raise InputError(f"bench {what}: the service stopped at start")
        yield ready.result()
    finally:
        stop.set()
        await server


@asynccontextmanager
async def _agent(
    running: Running, work: Path, runtime: str, cores: int | None, what: str
) -> AsyncIterator[None]:
    """``tangram agent --runtime runtime`` connected to ``running``, until the body ends."""
    port = running.url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "tangram.cli.main", "agent", "--scheduler",
            f"ws://127.0.0.1:{port}/v1/agents", "--runtime", runtime, "--node", NODE,
            "--state-dir", str(work / "agent")]  # fmt: skip
    if cores is not None:
        argv += ["--cores", str(cores)]
    agent = subprocess.Popen(
        argv,
        env={**os.environ, "TANGRAM_TOKEN_FILE": str(work / "tokens")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while NODE not in running.engine.hub.links:
            if agent.poll() is not None:
                raise InputError(f"bench {what}: the node agent exited ({agent.returncode})")
            if asyncio.get_running_loop().time() > deadline:
                raise InputError(f"bench {what}: the node agent did not connect in 60 s")
            await asyncio.sleep(0.05)
        yield
    finally:
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (a measured value, not one
    interpolated between two): with few samples, p99 is their largest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
