"""The client against a scheduler of an earlier release: one whose opens take no
idempotency key refuses the field (its models forbid unknown ones), and the client opens
unkeyed from then on instead of failing every open. The old scheduler is a stand-in on
127.0.0.1 that answers as that release did: its OpenTrajectory model, its error shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from tangram.client import Client
from tangram.service.answers import invalid

from .http_stub import JsonHandler, http_serving


class _OldOpen(BaseModel):
    """OpenTrajectory as it was: no idempotency_key, and unknown fields refused."""

    model_config = ConfigDict(extra="forbid")
    env: str
    id: str | None = None
    labels: dict[str, str] = {}
    expected_steps: int | None = None


class _OldScheduler(JsonHandler):
    opened: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server names it)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            _OldOpen.model_validate(body)
        except ValidationError as e:  # as its request validation answered
            errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
            self.answer(400, invalid(errors, skip=1))
            return
        self.opened.append(body)
        info = {"id": "t-1", "env": body["env"], "node": "n1", "state": "open",
                "opened_at": time.time()}  # fmt: skip
        self.answer(201, info)


@pytest.fixture
def old_scheduler() -> Iterator[str]:
    _OldScheduler.opened = []
    with http_serving(_OldScheduler) as url:
        yield url


def test_opens_on_a_scheduler_that_takes_no_key_go_unkeyed(old_scheduler: str) -> None:
    with Client(old_scheduler, "t" * 24, stream=False) as client:
        assert client.open("shell").id == "t-1"
        assert client.open("shell", id="mine").env == "shell"
    assert [("idempotency_key" in body) for body in _OldScheduler.opened] == [False, False]
