"""Starting and stopping `tangram up`, `tangram serve` and `tangram agent`: an IPv6
--host, a scheduler URL no retry can reach, a start the agent never joins, and a stop that
says what it waits for, ends at a second Ctrl-C and closes environments together."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from tangram.cli.main import main
from tangram.cli.serve import scheduler_url
from tangram.client.aio import AsyncClient
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.link import SchedulerUrlError
from tangram.node_agent.link import serve as serve_link
from tangram.service import embedded
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.embedded import Running, free_port, url_host
from tangram.service.engine import Engine
from tangram.service.from_resources import choose_pool, pool_config
from tests import GPU_EXTRA

ROOT = Path(__file__).resolve().parents[2]
LOCAL_POOL = str(ROOT / "manifests" / "examples" / "local")
GUARD_S = 120.0  # a hang's bound, far above any run's time: never a timing assertion


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


class Lines:
    """A process's merged output, read on a thread, waited for line by line."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()

    def wait_for(self, text: str, proc: subprocess.Popen[str]) -> str:
        deadline = time.monotonic() + GUARD_S
        with self._cv:
            while True:
                found = [line for line in self.lines if text in line]
                if found:
                    return found[0]
                assert proc.poll() is None or self._thread.is_alive(), self.text()
                assert time.monotonic() < deadline, f"no {text!r} in:\n{self.text()}"
                self._cv.wait(0.2)

    def text(self) -> str:
        return "".join(self.lines)


def _tangram(*argv: str, tmp_path: Path) -> tuple[subprocess.Popen[str], Lines]:
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Lines(proc.stdout)


def _stopped(proc: subprocess.Popen[str]) -> int:
    try:
        return proc.wait(GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("still running long after it was told to stop")


def test_urls_bracket_an_ipv6_host() -> None:
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"
    assert scheduler_url("http://[::1]:8080") == "ws://[::1]:8080/v1/agents"


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_up_serves_on_the_ipv6_loopback_and_stops_on_ctrl_c(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    port = free_port("::1")
    proc, out = _tangram(
        "up", "-f", LOCAL_POOL, "--host", "::1", "--port", str(port), "--runtime", "noop",
        "--state-dir", str(tmp_path / "state"), tmp_path=tmp_path,
    )  # fmt: skip
    reaped.append(proc)
    banner = out.wait_for("ready at", proc)
    assert f"http://[::1]:{port}" in banner
    assert httpx.get(f"http://[::1]:{port}/readyz").status_code == 200
    proc.send_signal(signal.SIGINT)
    assert _stopped(proc) == 0, out.text()
    assert "Traceback" not in out.text()


def test_the_agent_link_ends_at_once_on_a_url_no_retry_can_reach(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", idle_cores=1)

    async def go(url: str) -> None:
        await asyncio.wait_for(serve_link(agent, url, "t" * 22, asyncio.Event()), GUARD_S)

    try:
        for url in ("http://127.0.0.1:9/v1/agents", "ws://::1:9/v1/agents"):
            with pytest.raises(SchedulerUrlError, match="is not a scheduler URL"):
                asyncio.run(go(url))
    finally:
        asyncio.run(agent.shutdown())


def test_a_stop_before_the_local_agent_joins_ends_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that never joins (a scheduler it cannot reach) must not make the start,
    and with it Ctrl-C, wait for ever."""

    async def never_joins(agent: Any, url: str, token: str, stop: asyncio.Event) -> None:
        await stop.wait()

    monkeypatch.setattr(embedded, "serve_agent", never_joins)
    from tangram.cli.manifests import load_documents

    resources = load_documents([LOCAL_POOL])
    config = pool_config(resources, choose_pool(resources, None))
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", idle_cores=1)
    ready: list[Running] = []

    async def go() -> None:
        stop = asyncio.Event()

        async def signal_soon() -> None:
            await asyncio.sleep(0.5)  # (any time: the start waits for the agent until stop)
            stop.set()

        task = asyncio.create_task(signal_soon())
        await asyncio.wait_for(
            embedded.run(config, tokens, agent, stop, port=free_port(), on_ready=ready.append),
            GUARD_S,
        )
        await task

    asyncio.run(go())
    assert ready == []


def test_serve_prints_the_agents_ws_url_and_the_agent_takes_an_http_one(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    port = free_port()
    serve, out = _tangram(
        "serve", "-f", LOCAL_POOL, "--port", str(port), "--learned-file", "", tmp_path=tmp_path
    )
    reaped.append(serve)
    line = out.wait_for("agents at", serve)
    assert line.rstrip().endswith(f"agents at ws://127.0.0.1:{port}/v1/agents")
    assert scheduler_url(f"http://127.0.0.1:{port}") == f"ws://127.0.0.1:{port}/v1/agents"
    agent, agent_out = _tangram(
        "agent", "--scheduler", f"http://127.0.0.1:{port}/v1/agents", "--runtime", "noop",
        "--node", "n1", "--state-dir", str(tmp_path / "agent"), tmp_path=tmp_path,
    )  # fmt: skip
    reaped.append(agent)
    deadline = time.monotonic() + GUARD_S
    while httpx.get(f"http://127.0.0.1:{port}/readyz").status_code != 200:
        assert agent.poll() is None, agent_out.text()
        assert time.monotonic() < deadline, agent_out.text()
        time.sleep(0.1)
    assert "Traceback" not in agent_out.text()
    for p in (agent, serve):
        p.send_signal(signal.SIGINT)
        assert _stopped(p) == 0


def test_the_agent_refuses_a_scheduler_url_it_could_never_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("a" * 22 + f" {AGENT_TENANT}\n")
    for url in ("ftp://127.0.0.1:9/v1/agents", "ws://::1:9/v1/agents", "127.0.0.1:9"):
        code = main(["agent", "--scheduler", url, "--runtime", "noop", "--token-file",
                     str(tokens), "--state-dir", str(tmp_path / "state")])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and "--scheduler" in err and "is not a scheduler URL" in err
    code = main(["agent", "--scheduler", "http://", "--runtime", "noop", "--token-file",
                 str(tokens), "--state-dir", str(tmp_path / "state")])  # fmt: skip
    assert "http:// is not a scheduler URL (no host)" in capsys.readouterr().err  # not scheme
    code = main(["agent", "--scheduler", "ftp://127.0.0.1:9", "--runtime", "noop",
                 "--token-file", str(tokens), "--state-dir", str(tmp_path / "state")])  # fmt: skip
    err = capsys.readouterr().err  # quoted as given: not with the /v1/agents it would get
    assert code == 2 and "ftp://127.0.0.1:9 is not a scheduler URL" in err, err
    assert not (tmp_path / "state").exists()  # refused before any agent was made


@pytest.mark.skipif(os.geteuid() != 0, reason="the process runtime writes cgroups: needs root")
def test_ctrl_c_says_what_the_stop_waits_for_and_a_second_one_stops_now(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    port, started = free_port(), tmp_path / "started"
    proc, out = _tangram(
        "up", "-f", LOCAL_POOL, "--port", str(port), "--runtime", "process", "--grace", "3600",
        "--state-dir", str(tmp_path / "state"), "--learned-file", "", tmp_path=tmp_path,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for("ready at", proc)
    url = f"http://127.0.0.1:{port}"

    token = TokenStore.load(tmp_path / "tokens").token_for("local")

    results: list[Any] = []

    async def run_forever() -> None:
        async with AsyncClient(url, token) as client:
            t = await client.open("sandbox")
            argv = [
                "sh",
                "-c",
                f"echo $$ > {started}.pid; mv {started}.pid {started}; exec sleep 3600",
            ]
            results.append(await client.exec(t.id, argv, timeout_s=3600))

    runner = threading.Thread(target=lambda: _quietly(run_forever()), daemon=True)
    runner.start()
    deadline = time.monotonic() + GUARD_S
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, out.text()
        time.sleep(0.05)
    try:
        proc.send_signal(signal.SIGINT)
        said = out.wait_for("stopping:", proc)
        assert "waiting up to 3600 s for 1 action" in said and "Ctrl-C again to stop now" in said
        assert proc.poll() is None  # it waits: the action has its grace
        proc.send_signal(signal.SIGINT)
        assert _stopped(proc) == 0, out.text()
        assert "every environment was removed" in out.text()
        runner.join(GUARD_S)
        (result,) = results  # killed by the second Ctrl-C: not said to have had its grace
        assert result.error.code == "shutdown", result
        assert result.error.message.endswith("(a second stop signal cut its grace short)")
    finally:  # (a failed run leaves the command behind)
        _kill_if("sleep", started.read_text().strip())


@pytest.mark.torch
@pytest.mark.parametrize("build", ["build_stuck", "build_busy"])
def test_up_stops_within_its_grace_while_a_service_call_cannot_end(
    tmp_path: Path, reaped: list[subprocess.Popen[str]], build: str
) -> None:
    """A RewardService call whose score never returns is abandoned at the stop: the
    process exits (its GPU call threads hold nothing), rather than say it stopped, let go
    of its state directory and live on until the call returns. One inside a torch op
    (``build_busy``) aborted the exit (SIGABRT) as the interpreter tore down under it."""
    pytest.importorskip("torch", reason=GPU_EXTRA)
    from tests.fixtures.tiny_reward import weights

    weights(str(tmp_path / "stuck.pt"))
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "pool.yaml").write_text(
        "apiVersion: tangram.dev/v1alpha1\nkind: ActionPool\nmetadata: {name: gp}\n"
        "spec: {gpu: {gpusPerNode: 1}}\n---\n"
        "apiVersion: tangram.dev/v1alpha1\nkind: RewardService\nmetadata: {name: stuck}\n"
        f"spec: {{poolRef: gp, entrypoint: 'tests.fixtures.odd_reward:{build}', "
        f"weights: '{tmp_path / 'stuck.pt'}', gpuMemoryGiB: 0.01}}\n"
    )
    port = free_port()
    proc, out = _tangram(
        "up", "-f", str(pool), "--port", str(port), "--runtime", "noop", "--gpus", "cpu:1",
        "--grace", "0", "--state-dir", str(tmp_path / "state"), "--learned-file", "", "-v",
        tmp_path=tmp_path,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for("ready at", proc)
    token = TokenStore.load(tmp_path / "tokens").token_for("local")
    results: list[Any] = []

    async def call() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", token) as client:
            results.append(await client.score("stuck", [[0.0] * 16]))

    caller = threading.Thread(target=lambda: _quietly(call()), daemon=True)
    caller.start()
    deadline = time.monotonic() + GUARD_S
    while not _gpus_in_use(port):  # the call runs on the GPU
        assert proc.poll() is None and time.monotonic() < deadline, out.text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert _stopped(proc) == 0, out.text()
    assert "every environment was removed" in out.text() and "Traceback" not in out.text()
    # The stop's own leaving (logged with -v) is no node lost: nobody waits for its agent.
    # (The call ended `shutdown` at the grace's end, before or as its node left.)
    assert re.search(r"node vm left as the scheduler stops: [01] actions ended", out.text())
    assert "trajectories wait" not in out.text()
    caller.join(GUARD_S)
    (result,) = results
    assert result.error.code == "shutdown", result


def _gpus_in_use(port: int) -> bool:
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return any(
        line.startswith("tangram_units_in_use{") and 'resource="gpu"' in line
        and not line.endswith(" 0.0")
        for line in metrics.splitlines()
    )  # fmt: skip


def _kill_if(command: str, pid: str) -> None:
    """Kill ``pid`` if it still runs ``command`` (not a process that took its number)."""
    with contextlib.suppress(OSError, ValueError):
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == command.encode():
            os.kill(int(pid), signal.SIGKILL)


def _quietly(coro: Any) -> None:
    with contextlib.suppress(Exception):  # the client sees the stop; the test reads the server
        asyncio.run(coro)


def test_environments_are_closed_together_at_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each close waits until every close has begun: one at a time (each with its own
    grace) they would never end."""
    from tangram.cli.manifests import load_documents

    n = 3
    entered: list[str] = []
    all_in = asyncio.Event()
    close = Engine.close_trajectory

    async def together(self: Engine, tenant: str, tid: str) -> Any:
        entered.append(tid)
        if len(entered) == n:
            all_in.set()
        await all_in.wait()
        return await close(self, tenant, tid)

    monkeypatch.setattr(Engine, "close_trajectory", together)
    resources = load_documents([LOCAL_POOL])
    config = pool_config(resources, choose_pool(resources, None))
    tokens = TokenStore.create(tmp_path / "tokens")
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", idle_cores=1)
    told: list[embedded.Stopping] = []

    async def go() -> None:
        stop = asyncio.Event()
        ready: asyncio.Queue[Running] = asyncio.Queue()
        served = asyncio.create_task(
            embedded.run(
                config,
                tokens,
                agent,
                stop,
                port=free_port(),
                grace_s=3600,
                on_ready=ready.put_nowait,
                on_stopping=told.append,
            )
        )
        running = await asyncio.wait_for(ready.get(), GUARD_S)
        async with AsyncClient(running.url, tokens.token_for("local")) as client:
            for _ in range(n):
                await client.open("sandbox")
        stop.set()
        await asyncio.wait_for(served, GUARD_S)

    asyncio.run(go())
    assert len(entered) == n
    assert [(s.running, s.environments) for s in told] == [(0, n)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_agent_signalled_to_stop_logs_its_stop_and_ends_cleanly(
    tmp_path: Path, reaped: list[subprocess.Popen[str]], sig: signal.Signals
) -> None:
    """``tangram agent`` ended at SIGTERM with nothing in its log but an unretrieved
    CancelledError's traceback, and SIGHUP killed it silently (rc 129). Both stop it now,
    as said in its log, with exit status 0 (here while its link is down: nothing runs)."""
    TokenStore.create(tmp_path / "tokens")
    with socket.socket() as s:  # a port nothing listens on: the agent retries its link
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, out = _tangram(
        "agent", "--scheduler", f"ws://127.0.0.1:{port}/v1/agents", "--runtime", "noop",
        "--cores", "1", "--state-dir", str(tmp_path / "state"), "--node", "n1",
        tmp_path=tmp_path,
    )  # fmt: skip
    reaped.append(proc)
    out.wait_for("retrying in", proc)  # (its signal handlers are in place by then)
    proc.send_signal(sig)
    assert _stopped(proc) == 0, out.text()
    out.wait_for("stopped", proc)
    assert "stopping: 0 request(s) in flight" in out.text()
    assert "never retrieved" not in out.text() and "Traceback" not in out.text()
    if sig == signal.SIGHUP:
        assert "SIGHUP: stopping as for SIGTERM" in out.text()


_HANGUP_DURING_THE_START = """
import os, signal, sys
from tangram.cli import serve
from tangram.cli.main import main

made = serve.make_agent


def hung_up_meanwhile(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGHUP)  # (the terminal gone while it reads its state)
    return made(*args, **kwargs)


serve.make_agent = hung_up_meanwhile
sys.exit(main(sys.argv[1:]))
"""


def test_an_agent_hung_up_on_during_its_start_stops_once_started(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    """The agent's SIGHUP handler came with its loop: one during its start (reading its
    state, adopting pods) killed it silently (rc 129). It stops it now, as once running."""
    TokenStore.create(tmp_path / "tokens")
    with socket.socket() as s:  # a port nothing listens on: the agent retries its link
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _HANGUP_DURING_THE_START, "agent", "--scheduler",
         f"ws://127.0.0.1:{port}/v1/agents", "--runtime", "noop", "--cores", "1",
         "--state-dir", str(tmp_path / "state"), "--node", "n1"],
        cwd=ROOT, env={**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    reaped.append(proc)
    code = _stopped(proc)
    said = proc.stdout.read() if proc.stdout is not None else ""
    assert code == 0, said
    assert "SIGHUP: stopping as for SIGTERM" in said and "agent n1 stopped" in said, said
