"""A proxied API call across a scheduler restart: the scheduler makes it itself, so no
agent's journal remembers it. A client whose try may have reached the scheduler that died
sends it again saying so (``Tangram-Resent``); the restarted scheduler does not make a
POST a second time (``outcome_unknown``), makes an idempotent GET again, and a scheduler
that was up when the try went out makes the call as usual."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from tangram.api.resent import RESENT_HEADER
from tangram.client import ActionResult, ActionStatus, Client
from tangram.client.common import settings
from tests.integration.http_stub import JsonHandler, http_serving
from tests.integration.test_faults import Cluster, _wait

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("service")]

POOL = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {{name: resent}}
spec:
  cpu: {{idleCores: 1}}
  scheduler: {{agentGraceSeconds: 120}}
  apis: [{{name: pay, concurrency: 4, endpoint: "{url}"}}]
"""


class _Provider(JsonHandler):
    """Counts each request; the first one of each method waits for ``release``."""

    seen: ClassVar[list[tuple[str, str]]] = []
    release = threading.Event()

    def _handle(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        first = all(m != self.command for m, _ in self.seen)
        self.seen.append((self.command, self.path))
        if first:
            self.release.wait(60)
        self.answer(200, {"made": len(self.seen)})

    def do_GET(self) -> None:  # noqa: N802 (http.server names it)
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A scheduler (no agent: a pool of API quotas needs none) and its provider."""
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tmp_path / "tokens"))  # the clients' too
    _Provider.seen, _Provider.release = [], threading.Event()
    with http_serving(_Provider) as url:
        c = Cluster(tmp_path, pool=POOL.format(url=url))
        try:
            yield c
        finally:
            _Provider.release.set()
            c.stop()


def _cut_off(cluster: Cluster, method: str) -> ActionResult:
    """A call that reaches the provider, whose scheduler is killed (SIGKILL) while the
    provider holds it and started again: what the client's own retries get."""
    box: list[ActionResult | BaseException] = []

    def go() -> None:
        with Client(cluster.url) as client:  # the default retries ride out the restart
            try:
                box.append(client.call("pay", "/charge", method=method, body={"amount": 10}))
            except BaseException as e:  # surfaced below
                box.append(e)

    runner = threading.Thread(target=go)
    runner.start()
    _wait(lambda: _Provider.seen, "the call did not reach the provider")
    cluster.scheduler.kill()
    cluster.scheduler.wait()
    cluster.start_scheduler()
    runner.join(60)
    _Provider.release.set()  # (the first request's handler ends; its scheduler is gone)
    (got,) = box
    assert isinstance(got, ActionResult), got
    return got


def test_a_post_cut_off_by_a_restart_is_not_made_again(cluster: Cluster) -> None:
    got = _cut_off(cluster, "POST")
    assert got.status is ActionStatus.ERROR and got.error is not None
    assert got.error.code == "outcome_unknown" and not got.error.retryable
    assert "POST may have been made by the scheduler before a restart" in got.error.message
    assert _Provider.seen == [("POST", "/charge")]  # once


def test_a_get_cut_off_by_a_restart_is_made_again(cluster: Cluster) -> None:
    got = _cut_off(cluster, "GET")
    assert got.status is ActionStatus.OK and got.output is not None
    assert (got.output["status"], got.output["body"]) == (200, {"made": 2})
    assert _Provider.seen == [("GET", "/charge"), ("GET", "/charge")]


def test_a_scheduler_up_when_the_try_went_out_makes_a_resent_call(cluster: Cluster) -> None:
    """Its key unknown there, the try never reached it: made (once); a resent key it knows
    gets that call's answer; a header that says no age is refused naming it."""
    _Provider.release.set()
    auth = {"Authorization": f"Bearer {settings(cluster.url, None)[1]}"}
    url = f"{cluster.url}/v1/apis/pay/call"
    body = {"method": "POST", "path": "/charge", "idempotency_key": "k-1"}
    time.sleep(1.5)  # (up longer than the slack a resent try is allowed in transit)
    made = httpx.post(url, json=body, headers={**auth, RESENT_HEADER: "0.2"}, timeout=30)
    assert made.status_code == 200 and made.json()["status"] == "ok"
    again = httpx.post(url, json=body, headers={**auth, RESENT_HEADER: "999"}, timeout=30)
    assert again.json()["output"] == made.json()["output"]
    assert _Provider.seen == [("POST", "/charge")]
    fresh = {**body, "idempotency_key": "k-2"}
    unsure = httpx.post(url, json=fresh, headers={**auth, RESENT_HEADER: "999"}, timeout=30)
    assert unsure.json()["error"]["code"] == "outcome_unknown"
    assert unsure.json()["idempotency_key"] == "k-2"  # (the key to ask the API about)
    batch = httpx.post(
        f"{cluster.url}/v1/batch",
        json={"actions": [{"api": "pay", "call": fresh}, {"api": "pay", "lease": {}}]},
        headers={**auth, RESENT_HEADER: "999"},
        timeout=30,
    )
    first, second = batch.json()["results"]
    assert first["error"]["code"] == "outcome_unknown" and second["status"] == "ok"
    assert first["idempotency_key"] == "k-2"
    bad = httpx.post(url, json=fresh, headers={**auth, RESENT_HEADER: "soon"}, timeout=30)
    assert bad.status_code == 400
    assert json.loads(bad.content)["error"]["message"].startswith(f"header {RESENT_HEADER}")
    assert _Provider.seen == [("POST", "/charge")]
