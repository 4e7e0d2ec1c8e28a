"""`tangram bench exec` end to end against the real Docker Engine (shape, not speed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tangram.cli.main import main

pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]


def test_bench_exec_prints_the_design_shape(
    docker_client: Any,
    busybox: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["bench", "exec", "--actions", "5", "--opens", "2", "--json"]
    assert main([*argv, "--image", busybox, "--state-dir", str(tmp_path / "state")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["actions"] == 5
    for path in ("fast", "portable"):
        assert 0 < report[path]["p50_ms"] <= report[path]["p99_ms"]
    assert report["open"]["opens"] == 2
    assert {"cold", "warm"} <= report["open"].keys()
    assert not (tmp_path / "state" / "run").exists()  # no socket directory on the host
    assert docker_client.containers.list(all=True, filters={"name": "tangram-t-bench"}) == []
