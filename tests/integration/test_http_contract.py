"""What the OpenAPI document promises, the service keeps: a wrong method names every method
of the path, a name that exists nowhere is a 404, and the schema says which keys a map
takes, so that a request valid by the schema is not refused for them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent.agent import NodeAgent
from tangram.service.config import EnvConfig, PoolConfig

from .service_harness import service

pytestmark = [pytest.mark.xdist_group("service")]

CONFIG = PoolConfig(envs={"box": EnvConfig(spec=EnvSpec(name="box", image="-", memory_gb=0.01))})


def test_the_schema_and_the_answers_agree(tmp_path: Path) -> None:
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=2)
    with service(CONFIG, agent, tmp_path) as (running, token):
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=running.url, headers=auth) as http:
            wrong = http.request("OPTIONS", "/v1/trajectories/t-1")
            assert wrong.status_code == 405
            assert wrong.headers["allow"] == "DELETE, GET"  # both routes of the path
            assert wrong.json()["error"]["code"] == "method_not_allowed"

            for path, body in (
                ("/v1/trajectories", {"env": "no-such-env"}),
                ("/v1/apis/%C3%BE%12/lease", {}),  # a name no quota can have
                ("/v1/services/no-such-service/call", {"inputs": [1]}),
            ):
                answer = http.post(path, json=body)
                assert answer.status_code == 404, (path, answer.text)

            schemas = http.get("/openapi.json").json()["components"]["schemas"]
    env = schemas["ExecRequest"]["properties"]["env"]
    assert env["propertyNames"]["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"
    headers = schemas["ApiCallRequest"]["properties"]["headers"]
    assert "propertyNames" in headers and "pattern" in headers["additionalProperties"]
    assert schemas["ChoicesDemand"]["properties"]["choices"]["uniqueItems"] is True
    assert schemas["TableEfficiency"]["properties"]["table"]["propertyNames"] == {
        "pattern": "^[1-9][0-9]*$"
    }


def test_a_batch_item_is_one_kind_in_the_schema_as_in_the_service(tmp_path: Path) -> None:
    """The document states which fields each kind of batch item gives (a ``oneOf``), so a
    fuzzer's schema-valid item is one the service reads, and a mix of kinds is invalid in
    both."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=2)
    with service(CONFIG, agent, tmp_path) as (running, token):
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=running.url, headers=auth) as http:
            item = http.get("/openapi.json").json()["components"]["schemas"]["BatchItem"]
            kinds = [tuple(branch["required"]) for branch in item["oneOf"]]
            assert kinds == [("trajectory", "exec"), ("api", "lease"), ("api", "call"),
                             ("service", "score")]  # fmt: skip
            for branch in item["oneOf"]:
                others = [f for f, s in branch["properties"].items() if s == {"type": "null"}]
                assert sorted(others + branch["required"]) == sorted(item["properties"])
            bodies = {
                ("trajectory", "exec"): {"argv": ["true"]},
                ("api", "lease"): {},
                ("api", "call"): {"path": "/"},
                ("service", "score"): {"inputs": [1]},
            }
            for (name, kind), body in bodies.items():
                one = {name: "nothing-by-this-name", kind: body, "lease" if kind != "lease"
                       else "call": None}  # fmt: skip
                answer = http.post("/v1/batch", json={"actions": [one]})
                assert answer.status_code == 404, (kind, answer.text)  # read, then not found
            mixed = {"trajectory": "t", "exec": {"argv": ["true"]}, "api": "a", "lease": {}}
            answer = http.post("/v1/batch", json={"actions": [mixed]})
            assert answer.status_code == 400 and "exactly one" in answer.text
