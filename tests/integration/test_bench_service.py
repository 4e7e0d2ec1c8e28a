"""`tangram bench service` end to end: three real processes (shape, not speed)."""

from __future__ import annotations

import gc
import json
import os

import pytest

from tangram.cli.bench_service import cpu_placement
from tangram.cli.main import main

pytestmark = [pytest.mark.xdist_group("service")]


def test_bench_service_prints_the_design_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "service", "--trajectories", "5", "--think", "0.05"]
    allowed = os.sched_getaffinity(0)
    assert main([*argv, "--duration", "1", "--warmup", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trajectories"] == 5 and report["actions_per_s"] > 0
    assert 0 < report["p50_overhead_ms"] <= report["p99_overhead_ms"]
    assert [c["think_s"] for c in report["cases"]] == [0.05]
    assert gc.isenabled()  # the generator's collector is paused only while it measures
    # The generator gives back the CPUs it moved off to start the scheduler elsewhere.
    assert os.sched_getaffinity(0) == allowed
    placement = report["placement"]
    if len(allowed) >= 2:
        assert placement["scheduler_cpus"] == [min(allowed)]
        assert placement["agent_and_generator_cpus"] == sorted(allowed - {min(allowed)})
    else:
        assert placement == {"mode": "shared", "cpus": sorted(allowed)}


def test_dedicated_placement_gives_the_scheduler_one_cpu_of_its_own() -> None:
    assert cpu_placement("dedicated", {0, 1}) == ({0}, {1})
    assert cpu_placement("dedicated", {3, 5, 7}) == ({3}, {5, 7})
    assert cpu_placement("dedicated", {2}) is None  # nothing to dedicate: all share it
    assert cpu_placement("shared", {0, 1}) is None
