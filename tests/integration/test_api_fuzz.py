"""Bad input is never a 5xx: the service's OpenAPI spec fuzzed with schemathesis.

The real service runs with a real node agent (the process runtime), exactly as in
``test_service.py``. Schemathesis loads the schema from ``/openapi.json`` over HTTP on
127.0.0.1 and, for every operation, sends valid and invalid requests (examples, boundary
"coverage" cases and random ones); every answer must be below 500, and every 4xx must carry
the error body ``{"error": {"code", "message", "details"}}``.

Random trajectory ids, env names and API names would only ever reach the "does not exist"
answers, so some cases are steered into the service's interior: a trajectory that exists
(``TRAJECTORY``), the env ``shell`` and the API ``search``. Those run real commands as
whatever the fuzzer generated (random argv, session code, cores, timeouts), capped to
``EXEC_TIMEOUT_S`` so a generated ``cat`` or unbalanced session input cannot stall the run.

503 is a legitimate answer in one situation only: no node can take a new trajectory or the
scheduler is shutting down. Here one agent with plenty of memory is connected and the
service admits throughout, so no 503 is expected and none is excused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case, CheckContext, HookContext, Response
from schemathesis.checks import not_a_server_error

from tangram.api.cluster import ApiSpec
from tangram.api.demand import AmdahlEfficiency, RangeDemand
from tangram.api.wire import EnvSpec, ErrorBody
from tangram.node_agent.agent import NodeAgent
from tangram.service.auth import AGENT_TENANT, TokenStore
from tangram.service.config import ActionProfile, EnvConfig, PoolConfig

from .service_harness import service

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("service")]
CORES = sorted(os.sched_getaffinity(0))
TRAJECTORY = "fuzz-target"  # opened before fuzzing; cases are steered at it
EXEC_TIMEOUT_S = 2.0  # cap on the execution time of a fuzzed action that really runs
REQUEST_TIMEOUT_S = 30.0  # a request that takes longer than this is a hang: a failure
MAX_BODY = 1 << 20

CONFIG = PoolConfig(
    envs={
        "shell": EnvConfig(
            spec=EnvSpec(name="shell", image="unused-by-the-process-runtime", memory_gb=0.01),
            profiles={
                "tests": ActionProfile(
                    command=("sh", "-c", "echo dop={dop}"),
                    cpu=RangeDemand(min=1, max=len(CORES)),
                    t1_s=1.0,
                    efficiency=AmdahlEfficiency(amdahl=0.9),
                    timeout_s=EXEC_TIMEOUT_S,
                )
            },
        )
    },
    apis=(ApiSpec(name="search", concurrency=4),),
)


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    token: str  # a client's (tenant ``local``)
    agent_token: str  # the node agent's: it may not submit


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    tmp = tmp_path_factory.mktemp("fuzz")
    agent = NodeAgent.create(
        tmp / "agent", runtime="process", idle_cores=1, cores_for_actions=len(CORES)
    )
    with service(CONFIG, agent, tmp) as (running, token):
        agent_token = TokenStore.load(Path(tmp / "tokens")).token_for(AGENT_TENANT)
        assert agent_token is not None
        with httpx.Client(base_url=running.url, headers=_bearer(token)) as http:
            r = http.post("/v1/trajectories", json={"env": "shell", "id": TRAJECTORY})
            assert r.status_code == 201, r.text
        yield Target(running.url, token, agent_token)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def http(target: Target) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=target.url, headers=_bearer(target.token), timeout=30) as c:
        yield c


def _error_body(response: httpx.Response | Response) -> ErrorBody:
    """The error body of a 4xx, checked to have exactly the documented shape."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return ErrorBody.model_validate(body)


# ---- explicit negative cases ---------------------------------------------------------
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer not-a-token-of-this-service",
        "Basic dXNlcjpwYXNz",
        "Bearer",
        "Bearer tökén-with-latin-1",  # sent as latin-1 bytes, as HTTP allows
        "agent",  # the node agent's token: agents do not submit
    ],
)
def test_without_a_valid_token_it_is_401(target: Target, authorization: str | None) -> None:
    headers = {}
    if authorization == "agent":
        headers["Authorization"] = f"Bearer {target.agent_token}"
    elif authorization is not None:
        headers["Authorization"] = authorization
    with httpx.Client(base_url=target.url, timeout=30) as c:
        r = c.post(
            "/v1/trajectories",
            json={"env": "shell"},
            headers={k.encode(): v.encode("latin-1") for k, v in headers.items()},
        )
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert _error_body(r).error.code == "unauthorized"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/trajectories", b'{"env": "shell"'),
        (f"/v1/trajectories/{TRAJECTORY}/exec", b'{"argv": ["true"],}'),
        ("/v1/batch", b"\xff\xfe not json"),
        ("/v1/apis/search/lease", b"{'units': 1}"),
    ],
)
def test_malformed_json_is_400(http: httpx.Client, path: str, body: bytes) -> None:
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = _error_body(r).error
    assert err.code == "invalid" and err.details


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_1_mib_is_413(http: httpx.Client, chunked: bool) -> None:
    big = b'{"argv": ["echo", "' + b"x" * MAX_BODY + b'"]}'
    content: bytes | Iterator[bytes] = big
    if chunked:  # no Content-Length: the limit must hold while the body streams in
        content = iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
    r = http.post(
        f"/v1/trajectories/{TRAJECTORY}/exec",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert _error_body(r).error.code == "too_large"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/trajectories", {"env": "shell", "expected_steps": "many"}, "expected_steps"),
        ("/v1/trajectories", {"env": 7}, "env"),
        ("/v1/trajectories", {"env": "shell", "labels": {"a": 1}}, "labels.a"),
        (f"/v1/trajectories/{TRAJECTORY}/exec", {"argv": "ls"}, "argv"),
        (f"/v1/trajectories/{TRAJECTORY}/exec", {"argv": ["true"], "timeout_s": "1s"}, "timeout_s"),
        (f"/v1/trajectories/{TRAJECTORY}/exec", {"argv": ["true"], "output_cap": -1}, "output_cap"),
        ("/v1/apis/search/lease", {"units": "two"}, "units"),
        ("/v1/batch", {"actions": [{"trajectory": TRAJECTORY, "exec": []}]}, "actions.0.exec"),
    ],
)
def test_a_wrong_typed_field_is_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = _error_body(r).error
    assert err.code == "invalid"
    assert field in [d.field for d in err.details], err.details
    assert field in err.message


# ---- the fuzzer ----------------------------------------------------------------------
def error_body_shape(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx carries ``{"error": {"code", "message", "details"}}``."""
    if 400 <= response.status_code < 500:
        _error_body(response)
    return None


@pytest.fixture
def api_schema(target: Target, request: pytest.FixtureRequest) -> BaseSchema:
    # schemathesis 4.32's lazy schemas rename the test item through ``_nodeid``, which
    # pytest 9.2 no longer has (it is ``_id`` there): give it back the attribute it reads.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", timeout=30)
    schema.config.update(headers=_bearer(target.token), request_timeout=REQUEST_TIMEOUT_S)

    @schema.hook("flatmap_path_parameters")  # type: ignore[untyped-decorator]
    def existing_ids(ctx: HookContext, params: dict[str, Any]) -> st.SearchStrategy[Any]:
        op = ctx.operation
        steered = dict(params)
        if "trajectory" in params and op is not None and op.method.upper() != "DELETE":
            steered["trajectory"] = TRAJECTORY  # closing it would leave nothing to steer at
        if "api" in params:
            steered["api"] = "search"
        return st.sampled_from([params, steered])

    @schema.hook("flatmap_body")  # type: ignore[untyped-decorator]
    def existing_names(ctx: HookContext, body: Any) -> st.SearchStrategy[Any]:
        if not isinstance(body, dict):
            return st.just(body)
        steered = dict(body)
        if isinstance(body.get("env"), str):
            steered["env"] = "shell"
        if isinstance(body.get("actions"), list):
            steered["actions"] = [
                {**item, "trajectory": TRAJECTORY} if isinstance(item, dict) else item
                for item in body["actions"]
            ]
        return st.sampled_from([body, steered])

    return schema


fuzzed = schemathesis.pytest.from_fixture("api_schema")


def _cap_execution(body: Any) -> None:
    """Cap how long a fuzzed command may really run (a generated ``cat`` would wait on its
    input forever): ``timeout_s`` where the body has a valid one or none."""
    items = [body]
    if isinstance(body, dict) and isinstance(body.get("actions"), list):
        items = [i.get("exec") for i in body["actions"] if isinstance(i, dict)]
    for item in items:
        if isinstance(item, dict) and (
            item.get("timeout_s") is None
            or (isinstance(item["timeout_s"], int | float) and item["timeout_s"] > EXEC_TIMEOUT_S)
        ):
            item["timeout_s"] = EXEC_TIMEOUT_S


@fuzzed.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_bad_input_is_never_a_server_error(case: Case, target: Target) -> None:
    if case.path.endswith("/exec") or case.path == "/v1/batch":
        _cap_execution(case.body)
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, error_body_shape])
    lease = response.json().get("lease") if response.status_code == 200 else None
    if lease:  # give quota units back at once rather than after the generated hold_s
        with httpx.Client(base_url=target.url, headers=_bearer(target.token)) as c:
            c.delete(f"/v1/leases/{lease}")
