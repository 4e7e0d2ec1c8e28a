"""`tangram bench service` end to end: three real processes (shape, not speed)."""

from __future__ import annotations

import gc
import json

import pytest

from tangram.cli.main import main

pytestmark = [pytest.mark.xdist_group("service")]


def test_bench_service_prints_the_design_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "service", "--trajectories", "5", "--think", "0.05"]
    assert main([*argv, "--duration", "1", "--warmup", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trajectories"] == 5 and report["actions_per_s"] > 0
    assert 0 < report["p50_overhead_ms"] <= report["p99_overhead_ms"]
    assert [c["think_s"] for c in report["cases"]] == [0.05]
    assert gc.isenabled()  # the generator's collector is paused only while it measures
