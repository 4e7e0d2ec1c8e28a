"""Every action's result names the idempotency key it ran under, so that a caller whose
client made the key can retry under it, or cancel by it."""

from __future__ import annotations

from typing import Any

import httpx

from tangram.api.wire import ActionResult, ActionStatus, AgentReply, ExecOutcome, OpenTrajectory
from tangram.service.app import create_app
from tangram.service.auth import TokenStore
from tangram.service.engine import Engine
from tests.fixtures.fake_agent import Agent, answer_all, connect, hello, run


def _ran(msg: dict[str, Any]) -> AgentReply | None:
    if msg["op"] != "exec":
        return answer_all(msg)
    out = ExecOutcome(exit_code=0, stdout="", stderr="", stdout_truncated=False,
                      stderr_truncated=False, timed_out=False, setup_s=0.0, exec_s=0.1,
                      teardown_s=0.0, path="fast")  # fmt: skip
    return AgentReply(rid=0, ok=True, result=out)


def test_every_result_carries_the_key_it_ran_under_over_http_and_in_its_replay() -> None:
    """An exec's answer names its key (the body's, or the Idempotency-Key header's), and
    the answer kept for a retry of that key names it too; one without a key has none."""
    token = "t" * 20

    async def scenario(engine: Engine) -> None:
        await connect(engine, Agent(hello(), _ran))
        await engine.open_trajectory("u", OpenTrajectory(env="e", id="t1"))
        app = create_app(engine, TokenStore({token: "u"}))
        auth = {"Authorization": f"Bearer {token}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as h:
            path = "/v1/trajectories/t1/exec"
            answers = [
                await h.post(path, json={"argv": ["true"], "idempotency_key": "k-1"}),
                await h.post(path, json={"argv": ["true"], "idempotency_key": "k-1"}),
                await h.post(path, json={"argv": ["true"]}, headers={"Idempotency-Key": "k-2"}),
                await h.post(path, json={"argv": ["true"]}),
            ]
            items = [
                {"trajectory": "t1", "exec": {"argv": ["true"], "idempotency_key": "k-3"}},
                {"trajectory": "t1", "exec": {"argv": ["true"]}},
            ]
            batch = await h.post("/v1/batch", json={"actions": items})
        results = [ActionResult.model_validate_json(r.content) for r in answers]
        assert [r.status for r in results] == [ActionStatus.OK] * 4
        assert [r.idempotency_key for r in results] == ["k-1", "k-1", "k-2", None]
        assert results[0].id == results[1].id  # (the replay)
        assert [r["idempotency_key"] for r in batch.json()["results"]] == ["k-3", None]

    run(scenario)
