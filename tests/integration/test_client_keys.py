"""The idempotency key a submission ran under reaches its caller: on the result, also
from a scheduler of an earlier release that leaves it out of its answers, and on the
``ServiceUnreachableError`` of a submission whose answers were all lost (it may have been
submitted and run: retried under that key, it never runs twice). The scheduler is a
stand-in on 127.0.0.1 that answers as told."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from tangram.api.wire import ActionResult, ActionStatus
from tangram.client import Client, ServiceUnreachableError

from .http_stub import JsonHandler, http_serving

TOKEN = "t" * 24


def _old_result(kind: str = "exec") -> dict[str, Any]:
    """A result as an earlier release wrote it: no idempotency_key."""
    answer = ActionResult(id="a-1", kind=kind, status=ActionStatus.OK, exit_code=0)
    return answer.model_dump(mode="json", exclude={"idempotency_key"})


class _Stub(JsonHandler):
    """Answers as an earlier release (``lose`` False), or loses every answer: it reads the
    request, then drops the connection (``lose``)."""

    lose: ClassVar[bool] = False
    bodies: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server names it)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append((self.path, body))
        if self.lose:
            self.close_connection = True
            return
        if self.path == "/v1/batch":
            self.answer(200, {"results": [_old_result() for _ in body["actions"]]})
        else:
            self.answer(200, _old_result("api" if "/apis/" in self.path else "exec"))

    def do_GET(self) -> None:  # noqa: N802
        self.close_connection = True  # (lost)


@pytest.fixture
def stub() -> Iterator[str]:
    _Stub.lose, _Stub.bodies = False, []
    with http_serving(_Stub) as url:
        yield url


def _sent_keys(path: str) -> list[str]:
    return [b["idempotency_key"] for p, b in _Stub.bodies if p == path]


def test_results_name_the_key_the_client_made_when_the_scheduler_does_not(stub: str) -> None:
    with Client(stub, TOKEN, stream=False) as client:
        made = client.exec("t-1", ["true"])
        given = client.exec("t-1", ["true"], idempotency_key="mine")
        lease = client.lease("search")
        batch = client.batch([{"trajectory": "t-1", "exec": {"argv": ["true"]}}])
    assert [made.idempotency_key, given.idempotency_key] == _sent_keys("/v1/trajectories/t-1/exec")
    assert made.idempotency_key and given.idempotency_key == "mine"
    assert [lease.idempotency_key] == _sent_keys("/v1/apis/search/lease")
    ((_, sent),) = [(p, b) for p, b in _Stub.bodies if p == "/v1/batch"]
    assert [r.idempotency_key for r in batch] == [sent["actions"][0]["exec"]["idempotency_key"]]


def test_a_submission_whose_answers_were_all_lost_names_its_key(stub: str) -> None:
    """Every try of the exec reached the stand-in and lost its answer: the error says it
    may have been submitted and run, and names the one key all its tries carried; a
    request that submits nothing (a get) says neither."""
    _Stub.lose = True
    with Client(stub, TOKEN, stream=False, retries=1, backoff_s=0.01) as client:
        with pytest.raises(ServiceUnreachableError) as lost:
            client.exec("t-1", ["true"])
        with pytest.raises(ServiceUnreachableError) as unkeyed:
            client.get("t-1")
    (key,) = set(_sent_keys("/v1/trajectories/t-1/exec"))
    assert len(_sent_keys("/v1/trajectories/t-1/exec")) == 2  # (a first try and a retry)
    assert lost.value.idempotency_keys == [key]
    said = str(lost.value)
    assert said.startswith(f"cannot reach the ARL-Tangram service at {stub}: ")
    assert f"the action with idempotency key {key!r} may have been submitted and may " in said
    assert f"cancel('key:{key}')" in said
    assert unkeyed.value.idempotency_keys == [] and "may have been submitted" not in (
        str(unkeyed.value)
    )
