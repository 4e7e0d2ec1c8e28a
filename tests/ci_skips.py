"""Under CI a skip is a failure (loaded for tests/ and e2e/ by the root conftest.py).

A test that skips because a tool is missing passes silently, and the last newcomer run was
green with 14 tests skipped for want of debootstrap. ``.ci/run`` installs every tool the
tests need, so under ``CI=true`` a skip fails the run, unless its reason is one that no
package can fix on a CI machine (listed below). Outside CI a skip stays a skip, and the
summary (``-ra``) names its reason.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

# Skips a CI machine cannot avoid, by the start of their reason. PyTorch's tests skip in
# `make test` with the default extras; `make test-gpu` (CI's second step) installs the gpu
# extra and runs them, where this reason no longer occurs.
UNAVOIDABLE = (
    "no CUDA device",  # CI machines have no GPU; the device tool runs these
    "an NVIDIA driver is present",  # the reverse: a GPU machine runs the CUDA variant
    "needs PyTorch (the gpu extra)",  # tests.GPU_EXTRA
    "needs two cores",
)


def _ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _strict(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if reason.startswith(UNAVOIDABLE):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI, where .ci/run installs every tool the tests need: {reason}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    _strict(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report: pytest.CollectReport = yield
    _strict(report)  # a module-level skip (importorskip) skips at collection
    return report
