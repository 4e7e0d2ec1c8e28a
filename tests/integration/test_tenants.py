"""Tenants through the real service: per-tenant limits answered over HTTP, and one
tenant's action started ahead of another's backlog. A real agent (the noop runtime: the
queue is what is measured here, not the commands) and the real client."""

from __future__ import annotations

import asyncio
import secrets
import threading
from pathlib import Path

import aiohttp
import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.wire import AGENT_SUBPROTOCOL, STREAM_PATH, EnvSpec
from tangram.client import AsyncClient, Client, TangramError
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import EnvConfig, PoolConfig, TenantLimits

from .service_harness import service, stream_socket, until

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(
    envs={"box": EnvConfig(spec=EnvSpec(name="box", image="unused", memory_gb=0.01))},
    apis=(ApiSpec(name="search", concurrency=1),),
    tenants={"team-a": TenantLimits(max_trajectories=1, max_queued=2, max_streams=1)},
)


def _tokens() -> tuple[TokenStore, dict[str, str]]:
    tokens = {secrets.token_urlsafe(24): t for t in ("team-a", "team-b", AGENT_TENANT)}
    return TokenStore(tokens), {t: k for k, t in tokens.items()}


def test_a_tenants_limits_answer_429_naming_the_field_and_spare_the_others(
    tmp_path: Path,
) -> None:
    store, token = _tokens()
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    with (
        service(CONFIG, agent, tmp_path, tokens=store) as (running, _),
        Client(running.url, token["team-a"], retries=0) as a,
        Client(running.url, token["team-b"], retries=0) as b,
    ):
        a.open("box")
        with pytest.raises(TangramError) as refused:
            a.open("box")
        assert refused.value.status == 429 and "maxTrajectories" in str(refused.value)
        b.open("box")
        b.open("box")  # team-b has no limit

        # The quota's one unit is held by a lease: two more of team-a's wait behind it.
        held = a.lease("search", hold_s=60)
        assert held.lease is not None
        waiters = [threading.Thread(target=_lease_keyed, args=(running.url, token["team-a"], k),
                                    daemon=True) for k in ("w-0", "w-1")]  # fmt: skip
        for w in waiters:
            w.start()
        until(lambda: running.engine.core.queued_by_tenant.get("team-a") == 2, "two leases waiting")
        with pytest.raises(TangramError) as full:
            a.lease("search")
        assert full.value.status == 429 and "maxQueued" in str(full.value)
        assert "team-b" not in running.engine.core.queued_by_tenant
        for w, key in zip(waiters, ("w-0", "w-1"), strict=True):  # nothing left waiting
            assert a.cancel(f"key:{key}")
            w.join(30)
            assert not w.is_alive()


def test_an_open_past_max_trajectories_is_refused_at_once_not_retried(tmp_path: Path) -> None:
    """That 429 clears only when the tenant closes one of its own ("close one first"):
    the client retried it for 25 s, as if a queue would drain, before it surfaced."""
    store, token = _tokens()
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    with (
        service(CONFIG, agent, tmp_path, tokens=store) as (running, _),
        Client(running.url, token["team-a"], retries=3, backoff_s=0.01) as a,
    ):
        a.open("box")
        with pytest.raises(TangramError) as refused:
            a.open("box")
        assert (refused.value.status, refused.value.field) == (429, "trajectory")
        assert not refused.value.retryable
        counted = running.engine.state.metrics.rejected.labels(CONFIG.name, "trajectory")
        assert counted._value.get() == 1  # asked once


def test_a_tenants_action_streams_past_its_limit_are_refused_and_it_goes_on_over_http(
    tmp_path: Path,
) -> None:
    """``maxStreams``: each stream may hold answers its client has not read, so a tenant
    opens no more than its limit; the next handshake is 429 naming the field, another
    tenant is not counted, and the client of the one refused submits over HTTP."""
    store, token = _tokens()
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)

    async def scenario(url: str) -> None:
        async with (
            aiohttp.ClientSession(url) as session,
            AsyncClient(url, token["team-a"], retries=0) as first,
            AsyncClient(url, token["team-a"], retries=0) as second,
        ):
            t = await first.open("box")
            live = await first.exec_live(t.id, ["true"])  # its stream: team-a's one
            assert (await live.result()).exit_code == 0
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await stream_socket(session, token["team-a"])
            assert refused.value.status == 429
            answer = await asyncio.to_thread(_handshake, url, token["team-a"])
            assert answer.status_code == 429 and "Retry-After" in answer.headers
            assert "spec.access.tenants[].maxStreams" in answer.json()["error"]["message"]
            assert (await second.exec(t.id, ["true"])).exit_code == 0  # over HTTP
            with pytest.raises(TangramError, match="needs the action stream"):
                await second.exec_live(t.id, ["true"])
            async with stream_socket(session, token["team-b"]):  # not team-a's to count
                pass
            await first.aclose()  # its stream closes: team-a may open one again
            for _ in range(100):
                try:
                    async with stream_socket(session, token["team-a"]):
                        return
                except aiohttp.WSServerHandshakeError as e:
                    assert e.status == 429
                    await asyncio.sleep(0.1)
            raise AssertionError("team-a's stream was still counted after it closed")

    with service(CONFIG, agent, tmp_path, tokens=store) as (running, _):
        asyncio.run(scenario(running.url))


def _handshake(url: str, token: str) -> httpx.Response:
    """A stream's handshake as plain HTTP: the answer of one refused, body and headers."""
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
               "Sec-WebSocket-Protocol": AGENT_SUBPROTOCOL}  # fmt: skip
    with httpx.Client(base_url=url) as http:
        return http.get(STREAM_PATH, headers={"Authorization": f"Bearer {token}", **upgrade})


def _lease_keyed(url: str, token: str, key: str) -> None:
    """A lease that waits in the queue until it is granted or cancelled by its key."""
    headers = {"authorization": f"Bearer {token}"}
    body = {"idempotency_key": key}
    httpx.post(f"{url}/v1/apis/search/lease", json=body, headers=headers, timeout=30)


def test_an_action_over_what_its_tenants_share_may_hold_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """team-a may hold half the pool: 2 of the agent's 4 cores, 2 of the quota's 4 units.
    Asking more is answered 400 naming the request's field, not left waiting forever."""
    store, token = _tokens()
    config = PoolConfig(
        envs=CONFIG.envs,
        apis=(ApiSpec(name="wide", concurrency=4),),
        tenants={"team-a": TenantLimits(max_share=0.5)},
    )
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=4)
    with (
        service(config, agent, tmp_path, tokens=store) as (running, _),
        Client(running.url, token["team-a"], retries=0) as a,
        Client(running.url, token["team-b"], retries=0) as b,
    ):
        # (A queue timeout only so that a wait, the fault this guards against, ends.)
        lease = httpx.post(f"{running.url}/v1/apis/wide/lease", timeout=60,
                           headers={"authorization": f"Bearer {token['team-a']}"},
                           json={"units": 3, "queue_timeout_s": 30})  # fmt: skip
        assert lease.status_code == 400, lease.text
        (detail,) = lease.json()["error"]["details"]
        assert detail["field"] == "units" and "maxShare" in detail["message"]
        tid = a.open("box").id
        with pytest.raises(TangramError) as wide:
            a.exec(tid, ["true"], cores=3, queue_timeout_s=30)
        assert (wide.value.status, wide.value.field) == (400, "cpu")
        assert "maxShare" in wide.value.message
        assert a.exec(tid, ["true"], cores=2).status == "ok"  # at its share: it runs
        held = b.lease("wide", units=3)  # team-b is not capped
        assert held.lease is not None
        b.release(held.lease)
