"""spec.apis[].burst end to end: a pool read from its documents, served by the embedded
service on 127.0.0.1, and a sequence of leases over HTTP. The windows are an hour long, so
what is granted and what waits does not depend on how fast the test runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tangram.cli.manifests import load_text
from tangram.service.auth import TokenStore
from tangram.service.embedded import Running, free_port, run
from tangram.service.from_resources import choose_pool, pool_config

POOL = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: apis}
spec:
  apis:
    - {name: above, rate: 1, periodSeconds: 3600, burst: 3}  # 3 at once, then 3 h of none
    - {name: below, rate: 100, periodSeconds: 3600, burst: 2}  # 2 at once, then 72 s of none
    - {name: plain, rate: 2, periodSeconds: 3600}  # no burst: the rate's own window
"""
GUARD_S = 120.0  # a hang's bound, not a timing assertion


def _serve(tmp_path: Path, check: Any) -> None:
    resources = load_text(POOL, "pool.yaml")
    config = pool_config(resources, choose_pool(resources, None))
    tokens = TokenStore.create(tmp_path / "tokens")
    token = tokens.token_for("local")

    async def go() -> None:
        stop = asyncio.Event()
        ready: asyncio.Queue[Running] = asyncio.Queue()
        served = asyncio.create_task(
            run(config, tokens, None, stop, port=free_port(), on_ready=ready.put_nowait)
        )
        try:
            running = await asyncio.wait_for(ready.get(), GUARD_S)
            headers = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=running.url, headers=headers) as http:
                await check(http)
        finally:
            stop.set()
            await asyncio.wait_for(served, GUARD_S)

    asyncio.run(go())


async def _lease(http: httpx.AsyncClient, api: str, units: int = 1) -> dict[str, Any]:
    """One lease, waiting at most 1 s in the queue (a window an hour long reopens later)."""
    body = {"units": units, "hold_s": 3600, "queue_timeout_s": 1.0}
    r = await http.post(f"/v1/apis/{api}/lease", json=body, timeout=GUARD_S)
    out: dict[str, Any] = r.json()
    out["http"] = r.status_code
    return out


def _granted(result: dict[str, Any]) -> bool:
    return result["http"] == 200 and result.get("status") == "ok" and bool(result.get("lease"))


def _outcome(result: dict[str, Any]) -> str:
    return "lease" if _granted(result) else str((result.get("error") or {}).get("code"))


def test_leases_start_a_burst_at_once_and_no_more(tmp_path: Path) -> None:
    seen: dict[str, list[str]] = {}

    async def check(http: httpx.AsyncClient) -> None:
        for api, n in (("above", 4), ("below", 3), ("plain", 3)):
            results = [await _lease(http, api) for _ in range(n)]
            seen[api] = [_outcome(r) for r in results]
            for r in results:  # given back at once: the window counts starts, not holders
                if _granted(r):
                    assert (await http.delete(f"/v1/leases/{r['lease']}")).status_code == 200
        # More units than a burst are refused at once, not left waiting for ever.
        too_many = await _lease(http, "below", units=3)
        assert too_many["http"] == 400, too_many
        assert "3 units of below exceed its limit of 2" in too_many["error"]["message"]

    _serve(tmp_path, check)
    waits = "queue_timeout"  # (the window reopens in an hour: the lease waited its 1 s)
    assert seen == {
        "above": ["lease"] * 3 + [waits],  # a burst above the rate: 3 at once
        "below": ["lease"] * 2 + [waits],  # a burst below it: 2 at once, though 100 an hour
        "plain": ["lease"] * 2 + [waits],  # unset: the rate itself
    }
