"""ServiceAccount tokens (a cluster's clients) on the exec path, which reviews them itself
rather than leaving every such exec to the slower canonical route: a reviewed token runs
its action; a review that fails is answered 503 after a single review; a token the pool
does not admit gets 403 naming the access fields; no token, 401. The TokenReview call is
the only stand-in: the API server behind it is the operator e2e's business."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import aiohttp
import httpx

from tangram.api.wire import EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.config import EnvConfig, PoolConfig
from tangram.service.reviews import ReviewError, TokenReviewer

from .service_harness import service, stream_socket

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


def test_every_frame_of_an_action_stream_is_admitted_as_a_request_is(tmp_path: Path) -> None:
    """The stream's token is reviewed (here: without a cache) for every frame; a frame it
    no longer admits gets each message refused with the status HTTP gives, and the stream
    goes on answering once it is admitted again."""
    says: dict[str, str | ReviewError | None] = {"worker": USERS["worker"]}

    async def review(token: str) -> str | None:
        answer = says.get(token)
        if isinstance(answer, ReviewError):
            raise answer
        return answer

    reviewer = TokenReviewer(review, ttl_s=0, negative_ttl_s=0)
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=1)
    with service(CONFIG, agent, tmp_path, reviewer=reviewer) as (running, _):
        with httpx.Client(base_url=running.url) as http:
            opened = http.post(
                "/v1/trajectories", json={"env": "noop"}, headers={"Authorization": "Bearer worker"}
            )
            tid = opened.json()["id"]

        async def go() -> list[tuple[int, str | None]]:
            seen: list[tuple[int, str | None]] = []
            async with (
                aiohttp.ClientSession(running.url) as session,
                stream_socket(session, "worker") as ws,
            ):
                for i, now in enumerate(
                    [USERS["worker"], ReviewError("down"), USERS["stranger"], None, USERS["worker"]]
                ):
                    says["worker"] = now
                    msg = {"id": i, "trajectory": tid, "exec": {"argv": ["true"]}}
                    await ws.send_bytes(json.dumps(msg).encode())
                    answer = json.loads((await ws.receive(timeout=30)).data)
                    assert answer["id"] == i
                    seen.append((answer["status"], (answer.get("error") or {}).get("code")))
            return seen

        assert asyncio.run(go()) == [
            (200, None),
            (503, "unavailable"),
            (403, "forbidden"),
            (401, "unauthorized"),
            (200, None),
        ]
