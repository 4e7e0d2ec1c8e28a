"""Under CI a skip fails the run, unless no package could prevent it (tests.ci_skips)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = """
import pytest

def test_a_missing_tool():
    pytest.skip("debootstrap is not installed")

def test_no_gpu():
    pytest.skip("no CUDA device")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

def test_runs():
    pass
"""
PYTEST = [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA"]
MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_module_here")\n'


def _run(tmp_path: Path, ci: str | None, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [*PYTEST, str(tmp_path / "test_cases.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_outside_ci_a_skip_is_a_skip_with_its_reason(tmp_path: Path) -> None:
    done = _run(tmp_path, None, CASES)
    assert done.returncode == 0, done.stdout
    assert "2 skipped" in done.stdout and "debootstrap is not installed" in done.stdout


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_skip_for_a_missing_tool_fails(tmp_path: Path, ci: str) -> None:
    done = _run(tmp_path, ci, CASES)
    assert done.returncode == 1, done.stdout
    assert "1 failed" in done.stdout and "1 skipped" in done.stdout, done.stdout
    assert "skipped under CI" in done.stdout and "debootstrap is not installed" in done.stdout
    assert "1 xfailed" in done.stdout  # an expected failure is no skip


def test_under_ci_a_module_skipped_at_collection_fails(tmp_path: Path) -> None:
    done = _run(tmp_path, "true", MODULE_SKIP)
    assert done.returncode == 2, done.stdout  # a collection error, not "no tests" (5)
    assert "skipped under CI" in done.stdout and "no_such_module_here" in done.stdout


def test_ci_false_is_not_ci(tmp_path: Path) -> None:
    assert _run(tmp_path, "false", CASES).returncode == 0
