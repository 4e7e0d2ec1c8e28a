"""ServiceAccount tokens (a cluster's clients) on the exec path, which reviews them itself
rather than leaving every such exec to the slower canonical route: a reviewed token runs
its action; a review that fails is answered 503 after a single review; a token the pool
does not admit gets 403 naming the access fields; no token, 401. The TokenReview call is
the only stand-in: the API server behind it is the operator e2e's business."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx

from tangram.api.wire import EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.reviews import ReviewError, TokenReviewer

from .service_harness import service

CONFIG = PoolConfig(
    name="coding",
    namespace="rl",
    envs={"noop": EnvConfig(spec=EnvSpec(name="noop", image="none"))},
)
USERS = {"worker": "system:serviceaccount:rl:worker", "stranger": "system:serviceaccount:x:y"}


def test_service_account_tokens_on_the_exec_path(tmp_path: Path) -> None:
    asked: Counter[str] = Counter()

    async def review(token: str) -> str | None:  # what the API server's TokenReview says
        asked[token] += 1
        if token == "down":
            raise ReviewError("the API server did not answer")
        return USERS.get(token)

    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)
    with (
        service(CONFIG, agent, tmp_path, reviewer=TokenReviewer(review)) as (running, _),
        httpx.Client(base_url=running.url) as http,
    ):

        def post(path: str, token: str | None, body: object) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return http.post(path, json=body, headers=headers)

        tid = post("/v1/trajectories", "worker", {"env": "noop"}).json()["id"]
        ran = post(f"/v1/trajectories/{tid}/exec", "worker", {"argv": ["true"]})
        assert ran.status_code == 200 and ran.json()["status"] == "ok"
        assert asked["worker"] == 1  # one review, cached for the exec

        down = post(f"/v1/trajectories/{tid}/exec", "down", {"argv": ["true"]})
        assert down.status_code == 503 and down.headers["retry-after"] == "1"
        assert down.json()["error"]["details"][0]["field"] == "authorization"
        assert asked["down"] == 1  # not reviewed again by the canonical route

        stranger = post(f"/v1/trajectories/{tid}/exec", "stranger", {"argv": ["true"]})
        assert stranger.status_code == 403 and "spec.access" in stranger.text
        assert post(f"/v1/trajectories/{tid}/exec", None, {"argv": ["true"]}).status_code == 401
