"""``POST /v1/batch`` admission through the real service: a batch refused as a whole
leaves no trace and names its item, and a keyed batch sent again adds nothing to the
queue, so a full queue does not refuse it. A real agent (the noop runtime) and HTTP."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.wire import EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig, TenantLimits

from .service_harness import service, until

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(
    envs={"box": EnvConfig(spec=EnvSpec(name="box", image="unused", memory_gb=0.01))},
    apis=(ApiSpec(name="q", concurrency=1),),
    tenants={"team-a": TenantLimits(max_queued=3)},  # team-b: no limit
)


def _tokens() -> tuple[TokenStore, dict[str, str]]:
    tokens = {secrets.token_urlsafe(24): t for t in ("team-a", "team-b", AGENT_TENANT)}
    return TokenStore(tokens), {t: k for k, t in tokens.items()}


def _counted(url: str, name: str) -> dict[str, float]:
    """Every sample of metric ``name``: its labels -> its value."""
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            labels, _, value = line[len(name) :].rpartition(" ")
            samples[labels] = float(value)
    return samples


@pytest.mark.parametrize(
    ("last", "status", "field"),
    [
        pytest.param({"api": "nope", "lease": {}}, 404, "actions.5.api", id="unknown-quota"),
        # Checked by the core as it queues: the items before it are taken back.
        pytest.param(
            {"api": "q", "lease": {"units": 5}}, 400, "actions.5.lease.units", id="over-the-quota"
        ),
    ],
)
def test_a_batch_refused_for_one_item_names_it_and_leaves_no_trace(
    tmp_path: Path, last: dict[str, Any], status: int, field: str
) -> None:
    store, token = _tokens()
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=2)
    with service(CONFIG, agent, tmp_path, tokens=store) as (running, _):
        url, engine = running.url, running.engine
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {token['team-b']}"},
                          timeout=30) as a:  # fmt: skip
            tid = a.post("/v1/trajectories", json={"env": "box"}).json()["id"]
            execs = [{"trajectory": tid, "exec": {"argv": ["true"], "idempotency_key": f"e{i}"}}
                     for i in range(3)]  # fmt: skip
            leases = [{"api": "q", "lease": {"hold_s": 0.01, "idempotency_key": f"l{i}"}}
                      for i in range(2)]  # fmt: skip
            refused = [a.post("/v1/batch", json={"actions": [*execs, *leases, last]})
                       for _ in range(3)]  # fmt: skip
            assert [r.status_code for r in refused] == [status] * 3, refused[0].text
            # Nothing was submitted: nothing ended as cancelled, no key is kept.
            assert a.get(f"/v1/trajectories/{tid}").json()["actions"] == 0
            assert _counted(url, "tangram_actions_total") == {}
            assert engine.core.queued == 0 and not engine.state.actions
            assert not engine.state.idempotent.keys()  # a retry runs them: done below
            for r in refused:  # the refusal names the item
                error = r.json()["error"]
                assert error["details"][0]["field"] == field
                assert error["message"].startswith(f"{field}: ")
            results = a.post("/v1/batch", json={"actions": [*execs, *leases]}).json()["results"]
            assert [x["status"] for x in results] == ["ok"] * 5
            assert a.get(f"/v1/trajectories/{tid}").json()["actions"] == 3
            assert not any('status="cancelled"' in k for k in _counted(url, "tangram_actions"))


def test_a_keyed_batch_sent_again_adds_nothing_and_is_not_refused(tmp_path: Path) -> None:
    """team-a may have 3 actions waiting. Its keyed batch of 3 leases was granted; with 3
    others waiting, the same batch sent again (a retry after a lost answer) gets the same
    leases, not 429, and so does it with a key twice; one new item more is refused."""
    store, token = _tokens()
    with (
        service(CONFIG, None, tmp_path, tokens=store) as (running, _),
        httpx.Client(
            base_url=running.url, headers={"authorization": f"Bearer {token['team-a']}"}, timeout=30
        ) as a,  # fmt: skip
    ):
        url, engine = running.url, running.engine
        leases = [{"api": "q", "lease": {"hold_s": 0.01, "idempotency_key": f"k{i}"}}
                  for i in range(3)]  # fmt: skip
        first = a.post("/v1/batch", json={"actions": leases})
        assert first.status_code == 200, first.text
        ids = [x["id"] for x in first.json()["results"]]
        held = a.post("/v1/apis/q/lease", json={"hold_s": 60}).json()  # once those ended
        waiters = [threading.Thread(target=_lease_keyed, args=(url, token["team-a"], f"w-{i}"),
                                    daemon=True) for i in range(3)]  # fmt: skip
        for w in waiters:
            w.start()
        until(lambda: engine.core.queued_by_tenant.get("team-a") == 3, "three leases waiting")
        rejected = _counted(url, "tangram_admission_rejected_total")

        again = a.post("/v1/batch", json={"actions": leases})
        assert again.status_code == 200, again.text
        assert [x["id"] for x in again.json()["results"]] == ids
        twice = a.post("/v1/batch", json={"actions": [*leases, leases[0]]})
        assert twice.status_code == 200, twice.text
        assert [x["id"] for x in twice.json()["results"]] == [*ids, ids[0]]
        assert _counted(url, "tangram_admission_rejected_total") == rejected

        more = {"api": "q", "lease": {"idempotency_key": "k3"}}
        over = a.post("/v1/batch", json={"actions": [*leases, more]})
        assert over.status_code == 429, over.text
        changed = {"api": "q", "lease": {"hold_s": 1, "idempotency_key": "k0"}}
        conflict = a.post("/v1/batch", json={"actions": [leases[1], changed]})
        assert conflict.status_code == 409, conflict.text
        assert conflict.json()["error"]["details"][0]["field"] == "actions.1.lease.idempotency_key"
        for i, w in enumerate(waiters):  # nothing left waiting
            a.delete(f"/v1/actions/key:w-{i}")
            w.join(30)
            assert not w.is_alive()
        a.delete(f"/v1/leases/{held['lease']}")


def _lease_keyed(url: str, token: str, key: str) -> None:
    """A lease that waits in the queue until it is granted or cancelled by its key."""
    headers = {"authorization": f"Bearer {token}"}
    body = {"idempotency_key": key}
    httpx.post(f"{url}/v1/apis/q/lease", json=body, headers=headers, timeout=30)
