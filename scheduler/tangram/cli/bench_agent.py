"""The real scheduler service with a node agent in a process of its own, for benchmarks:
as in a cluster, the agent's work (process starts, a file's bytes) never stalls the
scheduler's event loop."""

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

from tangram.cli.files import InputError
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
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    port = free_port()
    server = asyncio.create_task(
        run(config, TokenStore(tokens), None, stop, port=port, on_ready=ready.set_result)
    )
    running = await ready
    running.engine.all_agents_joined()  # a fresh pool: no trajectory to wait for
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
        yield running, {t: k for k, t in tokens.items()}
    finally:
        stop.set()
        await server
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
