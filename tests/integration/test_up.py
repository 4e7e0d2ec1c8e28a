"""The README's path: `tangram up -f manifests/examples/local`, then the example rollout
driver against it, then Ctrl-C — as separate processes, over 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tangram.node_agent.execution import owner_id
from tangram.service.embedded import free_port

pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]
ROOT = Path(__file__).resolve().parents[2]


def test_up_serves_the_example_pool_to_the_example_driver(
    docker_client: Any, busybox: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tangram.cli.main",
            "up",
            "-f",
            "manifests/examples/local",
            "--port",
            str(port),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        driver = subprocess.run(
            [
                sys.executable,
                "examples/rollout.py",
                "--url",
                f"http://127.0.0.1:{port}",
                "-n",
                "4",
                "--steps",
                "4",
                "--think",
                "0",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert driver.returncode == 0, driver.stderr
        assert "16 actions" in driver.stdout
        for kind in ("shell", "tests", "api"):
            assert any(line.startswith(kind) for line in driver.stdout.splitlines())
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "every environment was removed" in out
    owner = owner_id(tmp_path / "state" / "docker")  # this agent's containers, no one else's
    left = docker_client.containers.list(all=True, filters={"label": f"dev.tangram/owner={owner}"})
    assert left == []
