"""``tangram bench gpu-pool`` end to end on CPU-backed devices: the real schedulers, agents
and PyTorch worker, a small trace; what must hold whatever the timings."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import GPU_EXTRA, TANGRAM_CLI

pytest.importorskip("torch", reason=GPU_EXTRA)
pytestmark = pytest.mark.torch


def _bench(tmp: Path, *args: str) -> dict[str, Any]:
    """A small run: 2 services, one pooled device holding one of them, 2 rounds of 1 s,
    every service in each; the report it printed, which --out wrote too."""
    out = tmp / "pool.json"
    small = ["--services", "2", "--pooled", "1", "--per-device", "1", "--rounds", "2"]
    small += ["--round-s", "1", "--active", "1", "--size-mb", "32"]
    done = subprocess.run(
        [*TANGRAM_CLI, "bench", "gpu-pool", "--json", "--out", str(out), *small, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, Any] = json.loads(done.stdout)
    assert json.loads(out.read_text()) == report
    return report


def test_pooled_and_static_serve_the_same_calls_and_pooling_restores(tmp_path: Path) -> None:
    report = _bench(tmp_path, "--burst", "3", "--compute-ms", "20")
    static, pooled = report["sides"]["static"], report["sides"]["pooled-1"]
    assert static["calls"] == pooled["calls"] == report["calls"] > 0
    assert (static["devices"], pooled["devices"]) == (2, 1)
    # A deployment per service never restores; two services taking turns on one device
    # that holds one of them must (every call answered its own model's checksum).
    assert static["restores"] == 0 and static["hit_rate"] == 1.0
    assert pooled["restores"] >= 1 and pooled["evictions"] >= 1
    for side in (static, pooled):  # a device is never busy with two calls at once
        assert 0 < side["gpu_seconds_busy"] <= side["gpu_seconds_held"]


def test_decoding_batched_calls_the_static_side_runs_alone_and_busy_counts_a_pass_once(
    tmp_path: Path,
) -> None:
    decode = ["--compute", "decode", "--batch", "4", "--devices", "cpu"]
    report = _bench(tmp_path, "--burst", "4", "--compute-ms", "10", *decode)
    assert (report["compute"], report["batch"]) == ("decode", 4)
    assert report["decode_step_ms"] > 0 and "real compute" in report["device"]
    assert "static deployments run one after another" in report["device"]
    static, pooled = report["sides"]["static"], report["sides"]["pooled-1"]
    assert static["calls"] == pooled["calls"] == report["calls"] > 0
    assert static["restores"] == 0 and pooled["restores"] >= 1
    for side in (static, pooled):  # calls sharing a pass keep the device busy once
        assert 0 < side["gpu_seconds_busy"] <= side["gpu_seconds_held"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--batch", "2000"], "--batch: 2000"),
        (["--step-ms", "0.2"], "--step-ms: only --compute decode"),
        (["--step-ms", "0.2", "--compute", "batched"], "--step-ms: only --compute decode"),
    ],
)
def test_options_that_cannot_apply_are_refused(args: list[str], said: str) -> None:
    done = subprocess.run(
        [*TANGRAM_CLI, "bench", "gpu-pool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and said in done.stderr
