"""`tangram bench files` end to end against the real Docker Engine (shape, not speed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tangram.cli.bench_files import POOL
from tangram.cli.main import main
from tangram.node_agent.env_template import LABEL

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("docker")]


def test_bench_files_measures_both_ways_against_docker_cp(
    docker_client: Any, busybox: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "files.json"
    argv = ["bench", "files", "--sizes", "1", "--repeats", "1", "--json", "--out", str(out)]
    assert main([*argv, "--image", busybox]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    (row,) = report["sizes"]
    assert row["size_mb"] == 1 and row["repeats"] == 1
    for figure in ("upload", "download", "docker_cp_in", "docker_cp_out"):
        assert row[f"{figure}_mb_s"] > 0
    assert row["upload_vs_docker_cp"] > 0 and row["download_vs_docker_cp"] > 0
    tree = report["tree"]
    assert tree["files"] == 500 and tree["repeats"] == 1
    for figure in ("upload_vs_docker_cp", "upload_vs_one_write_per_file", "download_vs_docker_cp"):
        assert tree[figure] > 0
    assert report["live"]["runs"] == 4
    assert report["live"]["first_byte_p50_ms"] > 0 and report["live"]["echo_p50_ms"] > 0
    mine = {"label": f"{LABEL}/pool={POOL}"}  # (other tests' containers may be about)
    assert docker_client.containers.list(all=True, filters=mine) == []
