"""`tangram bench paper --quick` end to end: every experiment, its JSON, tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tangram.cli.main import main


@pytest.mark.slow
def test_quick_paper_bench_writes_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "paper", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "paper-quick.json").read_text())
    coding = report["coding_batch"]["rows"]
    assert set(coding) == {"128", "256"}
    for row in coding.values():
        assert set(row) == {
            "elastic",
            "elastic-paper",
            "elastic-doubling",
            "k8s-static",
            "fixed-dop-4",
            "fixed-dop-16",
        }
        # Pooling beats a pod per trajectory (single-process commands) on this workload.
        assert row["elastic"]["avg_act_s"] < row["k8s-static"]["avg_act_s"]
    assert set(report["mopd"]) == {
        "elastic",
        "elastic-unbatched",
        "static-gpu",
        "static-gpu-batch-1",
    }
    savings = report["gpu_savings"]
    assert savings["metric"] == "avg_act_service_s"
    assert set(savings["pooled"]) == {"4", "8", "40"}
    table = (tmp_path / "paper-quick.md").read_text()
    assert "### Coding" in table and "### MOPD" in table and "static-gpu on 40 GPUs" in table
    for png in ("coding-batch.png", "coding-capacity.png", "gpu-savings.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
