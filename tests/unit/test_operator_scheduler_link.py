"""How the operator reads a scheduler's answers: anything that is not one is a
SchedulerError, which the reconciler handles (as no answer), never another exception."""

from __future__ import annotations

import pytest

from tangram.operator.scheduler_link import SchedulerError, SchedulerLink
from tests.integration.http_stub import JsonHandler, http_serving


class NotAScheduler(JsonHandler):
    """Answers every POST with 200 and a JSON body no scheduler sends (a proxy's page,
    another service behind a stale endpoints entry)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server names it)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer(200, ["not", "a", "scheduler"])


def test_a_drain_answered_by_something_else_is_a_scheduler_error() -> None:
    """Otherwise pydantic's ValidationError escapes the finalizer, which then fails on
    every retry, past drainSeconds, and the pool is never removed."""
    with http_serving(NotAScheduler) as base, pytest.raises(SchedulerError, match="drain"):
        SchedulerLink().drain(base, "operator-token")


def test_a_reload_answered_by_something_else_is_a_scheduler_error() -> None:
    with http_serving(NotAScheduler) as base, pytest.raises(SchedulerError, match="reload"):
        SchedulerLink().reload(base, "operator-token", "kind: ActionPool\n")
