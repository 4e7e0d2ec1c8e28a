"""examples/rollout.py against `tangram up`: the banner says how many cores go where and
gives a `try:` line for rollout.py that runs against the pool served (its defaults fit
only manifests/examples/local), or none where it cannot run; a rollout whose trajectory
fails closes every other before it ends."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tangram.cli.manifests import load_documents
from tangram.cli.up import cores_note, rollout_flags
from tangram.service.embedded import free_port
from tangram.service.from_resources import choose_pool, pool_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "manifests" / "examples"
GUARD_S = 120.0  # a hang's bound, far above any run's time: never a timing assertion


def _flags(example: str, pool: str | None = None) -> list[str] | None:
    resources = load_documents([str(EXAMPLES / example)])
    return rollout_flags(pool_config(resources, choose_pool(resources, pool)))


def test_the_core_line_gives_counts_and_cpu_lists() -> None:
    assert cores_note([1], [0]) == "1 core for actions (CPU 1), 1 core for idle sandboxes (CPU 0)"
    assert cores_note(range(1024), [1024], virtual=True) == (
        "1024 cores for actions (virtual CPUs 0-1023), 1 core for idle sandboxes (virtual CPU 1024)"
    )


def test_the_rollout_hint_names_the_pools_env_profiles_and_quota() -> None:
    assert _flags("local") == []  # its names are rollout.py's defaults
    assert _flags("coding") == ["--env swe", "--tests-profile pytest", "--api ''"]
    assert _flags("deepsearch", "deepsearch-cpu") == [
        "--env scratch",
        "--shell-profile python",
        "--tests-profile ''",
        "--api ''",
    ]
    assert _flags("deepsearch", "deepsearch") is None  # API quotas only: no trajectory
    assert _flags("mopd") is None  # RewardServices only


def _banner(proc: subprocess.Popen[str]) -> str:
    """The banner's lines, up to its last ('Ctrl-C stops'), read off a thread (a start
    that hangs fails at GUARD_S, not never)."""
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + GUARD_S
    while not seen or "Ctrl-C stops" not in seen[-1]:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        assert line is not None, "".join(seen)
        seen.append(line)
    return "".join(seen)


@contextmanager
def _up(example: str, pool: str | None, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """`tangram up` of an example with the noop runtime: its banner and the environment
    its clients need; stopped with Ctrl-C at the end."""
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")}
    argv = ["up", "-f", str(EXAMPLES / example), "--runtime", "noop", "--port", str(free_port()),
            "--state-dir", str(tmp_path / "state"), "--learned-file", ""]  # fmt: skip
    up = subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", *argv, *(["--pool", pool] if pool else [])],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield _banner(up), env
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(GUARD_S)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def _rollout(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "examples/rollout.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=GUARD_S, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("example", "pool"), [("local", None), ("coding", None), ("deepsearch", "deepsearch-cpu")]
)
def test_the_banners_try_line_runs(example: str, pool: str | None, tmp_path: Path) -> None:
    with _up(example, pool, tmp_path) as (banner, env):
        assert "cores for actions (virtual CPUs " in banner, banner
        (hint,) = [line for line in banner.splitlines() if line.strip().startswith("try:")]
        command = shlex.split(hint.split("try:", 1)[1])
        assert command[:2] == [".venv/bin/python", "examples/rollout.py"], hint
        done = _rollout(*command[2:], "-n", "2", "--steps", "4", "--think", "0", env=env)
        assert done.returncode == 0, f"{hint}\n{done.stderr}"
        assert "8 actions" in done.stdout, done.stdout


def test_a_failed_trajectory_ends_the_rollout_with_every_other_closed(tmp_path: Path) -> None:
    with _up("local", None, tmp_path) as (banner, env):
        url = banner.split("ready at ", 1)[1].split()[0]
        # Each trajectory's third step leases a quota the pool lacks: the first to get
        # there fails while the others think (seeded, apart), and they must close.
        done = _rollout("--url", url, "-n", "8", "--steps", "4", "--think", "1", "--api", "nope",
                        env=env)  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("rollout: 404 not_found: api: unknown API quota 'nope'")
        assert "closing trajectory" not in done.stderr, done.stderr
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tangram_trajectories{pool="local",state="open"} 0.0' in metrics, metrics
