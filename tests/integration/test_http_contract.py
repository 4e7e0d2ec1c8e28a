"""What the OpenAPI document promises, the service keeps: a wrong method names every method
of the path, a name that exists nowhere is a 404, and the schema says which keys a map
takes, so that a request valid by the schema is not refused for them."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tangram.api.cluster import ApiSpec
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


ARGV = {"argv": ["true"]}


def test_a_value_of_the_wrong_json_type_is_refused_naming_its_field(tmp_path: Path) -> None:
    """Never converted, on a route that reads its body as JSON (an exec) as on one FastAPI
    reads (a batch, a lease, a call, an open, the files API's): ``"yes"`` ran the command
    under a terminal, ``true`` on a core. Every refusal is a 400 naming the field, and
    nothing ran."""
    agent = NodeAgent.create(tmp_path / "agent", runtime="noop", cores_for_actions=2)
    config = PoolConfig(envs=CONFIG.envs, apis=(ApiSpec(name="search", concurrency=4),))
    with service(config, agent, tmp_path) as (running, token):
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=running.url, headers=auth) as http:
            tid = http.post("/v1/trajectories", json={"env": "box"}).json()["id"]
            exec_path = f"/v1/trajectories/{tid}/exec"
            cases = [
                *((exec_path, {**ARGV, "pty": v}, ["pty"]) for v in ("yes", "on", "1", 1, "true")),
                (exec_path, {**ARGV, "cpu": True}, ["cpu"]),
                (exec_path, {**ARGV, "cpu": "1"}, ["cpu"]),
                (exec_path, {**ARGV, "timeout_s": "5"}, ["timeout_s"]),
                (exec_path, {**ARGV, "output_cap": "100"}, ["output_cap"]),
                ("/v1/trajectories", {"env": "box", "expected_steps": "5"}, ["expected_steps"]),
                ("/v1/apis/search/lease", {"units": True, "hold_s": "1"}, ["units", "hold_s"]),
                ("/v1/batch", {"actions": [{"trajectory": tid, "exec": {**ARGV, "cpu": True}}]},
                 ["actions.0.exec.cpu"]),
                # The path the caller sent, not pydantic's (its unions' tags in it).
                (exec_path, {**ARGV, "efficiency": {"amdahl": 2}}, ["efficiency.amdahl"]),
                (exec_path, {**ARGV, "cpu": {"min": 3, "max": 2}}, ["cpu"]),
                (exec_path, {**ARGV, "cpu": {"choices": []}}, ["cpu.choices"]),
                # The other routes that take a JSON body.
                ("/v1/trajectories", {"env": "box", "labels": {"run": 1}}, ["labels.run"]),
                (exec_path, {"session": {"kind": "bash", "name": 1}, "code": "x"},
                 ["session.name"]),
                ("/v1/apis/search/call", {"path": "/", "timeout_s": "5"}, ["timeout_s"]),
                ("/v1/apis/search/call", {"query": {"q": 1}}, ["query.q"]),
                ("/v1/services/score/call", {"inputs": [1], "input_size": "5"}, ["input_size"]),
                (f"/v1/trajectories/{tid}/files/mkdir", {"path": 5}, ["path"]),
                (f"/v1/trajectories/{tid}/files/rename", {"path": "a", "to": ["b"]}, ["to"]),
            ]  # fmt: skip
            for path, body, fields in cases:
                answer = http.post(path, json=body)
                assert answer.status_code == 400, (body, answer.text)
                error = answer.json()["error"]
                assert error["code"] == "invalid"
                assert [d["field"] for d in error["details"]] == fields, (body, error)
                assert error["message"].startswith(f"{fields[0]}: "), error
            assert http.get(f"/v1/trajectories/{tid}").json()["actions"] == 0

            # What is right is taken: a JSON integer for seconds, a table's keys as JSON
            # writes them, on either kind of route.
            right = {**ARGV, "cpu": {"choices": [1, 2]}, "timeout_s": 5, "t1_s": 1,
                     "efficiency": {"table": {"1": 1, "2": 0.9}}, "pty": False}  # fmt: skip
            answer = http.post(exec_path, json=right)
            assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text
            lease = {"api": "search", "lease": {"units": 1, "hold_s": 1}}
            batch = {"actions": [{"trajectory": tid, "exec": right}, lease]}
            answer = http.post("/v1/batch", json=batch)
            assert answer.status_code == 200, answer.text
            assert [r["status"] for r in answer.json()["results"]] == ["ok", "ok"]


def _envelope(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return b"\0" + len(data).to_bytes(4, "big") + data


def _messages(body: bytes) -> list[dict[str, Any]]:
    """A Connect server stream's messages, its end's last."""
    found = []
    while body:
        size = int.from_bytes(body[1:5], "big")
        found.append(json.loads(body[5 : 5 + size]))
        body = body[5 + size :]
    return found


def _next_message(chunks: Iterator[bytes], held: bytearray) -> dict[str, Any]:
    """The next message of a Connect server stream being read (``held``: what was read
    of it past the last message)."""
    while len(held) < 5 or len(held) < 5 + int.from_bytes(held[1:5], "big"):
        held += next(chunks)
    size = int.from_bytes(held[1:5], "big")
    found: dict[str, Any] = json.loads(held[5 : 5 + size])
    del held[: 5 + size]
    return found


@contextmanager
def _sandbox(tmp: Path, runtime: str = "noop") -> Iterator[tuple[httpx.Client, str, str]]:
    """The service on a ``runtime`` agent, a client of its E2B API (the key sent), a
    sandbox of ``box`` made there and the key."""
    agent = NodeAgent.create(tmp / "agent", runtime=runtime, cores_for_actions=2)
    with (
        service(CONFIG, agent, tmp) as (running, token),
        httpx.Client(base_url=running.url, headers={"X-API-KEY": token}, timeout=30) as http,
    ):
        made = http.post("/sandboxes", json=SANDBOX)
        assert made.status_code == 201, made.text
        yield http, made.json()["sandboxID"], token


SANDBOX = {"templateID": "box", "timeout": 300, "metadata": {"run": "1"}, "envVars": {"A": "1"}}


def test_the_e2b_api_refuses_a_value_of_the_wrong_json_type_naming_its_field(
    tmp_path: Path,
) -> None:
    """As /v1, E2B's API takes a value only as the JSON type it is (E2B's own, in Go, does
    too): ``"timeout": "30"`` made a sandbox of 30 s, ``true`` one of 1 s. Each is a 400
    in E2B's shape naming the field, nothing opened or changed; what E2B's SDK sends is
    taken."""
    with _sandbox(tmp_path) as (http, sid, _):
        end = http.get(f"/sandboxes/{sid}").json()["endAt"]
        wrong = [
            ("/sandboxes", {**SANDBOX, "timeout": "30"}, "timeout"),
            ("/sandboxes", {**SANDBOX, "timeout": True}, "timeout"),
            ("/sandboxes", {**SANDBOX, "timeout": 30.0}, "timeout"),  # (Go's int32 refuses it)
            ("/v2/sandboxes", {**SANDBOX, "templateID": ["box"]}, "templateID"),
            ("/sandboxes", {**SANDBOX, "metadata": {"run": 1}}, "metadata.run"),
            ("/sandboxes", {**SANDBOX, "envVars": {"A": True}}, "envVars.A"),
            (f"/sandboxes/{sid}/timeout", {"timeout": "30"}, "timeout"),
            (f"/sandboxes/{sid}/timeout", {"timeout": False}, "timeout"),
            (f"/sandboxes/{sid}/connect", {"timeout": "600"}, "timeout"),
            (f"/v2/sandboxes/{sid}/connect", {"timeout": 600.5}, "timeout"),
        ]
        for path, body, field in wrong:
            answer = http.post(path, json=body)
            assert answer.status_code == 400, (path, body, answer.text)
            assert answer.json()["code"] == 400
            assert answer.json()["message"].startswith(f"{field}: "), (body, answer.text)
        assert [box["sandboxID"] for box in http.get("/sandboxes").json()] == [sid]
        assert http.get(f"/sandboxes/{sid}").json()["endAt"] == end

        # A whole number of seconds, as E2B's SDK sends it, is taken.
        assert http.post(f"/sandboxes/{sid}/timeout", json={"timeout": 30}).status_code == 204
        assert http.get(f"/sandboxes/{sid}").json()["endAt"] != end
        assert http.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 200


def test_envd_refuses_a_value_of_the_wrong_json_type_naming_its_field(tmp_path: Path) -> None:
    """envd's process calls take a field only as the JSON type its proto JSON has:
    ``"stdin": "no"`` was an open stdin, ``"pty": false`` a terminal, ``"cwd": 5`` a
    directory "5", ``"pid": true`` pid 1. Each is Connect's ``invalid_argument`` naming
    the field, and nothing runs; what E2B's SDK sends runs."""
    with _sandbox(tmp_path) as (http, sid, token):
        envd = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
        streamed = {**envd, "Content-Type": "application/connect+json"}
        command = {"cmd": "/bin/true"}
        refused: list[tuple[dict[str, Any], str]] = [
            ({"process": command, "stdin": "no"}, "stdin"),
            ({"process": command, "stdin": 0}, "stdin"),
            ({"process": command, "pty": False}, "pty"),
            ({"process": {**command, "cwd": 5}}, "process.cwd"),
            ({"process": command, "tag": 7}, "tag"),
        ]
        for msg, field in refused:
            answer = http.post("/process.Process/Start", content=_envelope(msg), headers=streamed)
            messages = _messages(answer.content)  # (Connect's streams answer 200)
            assert len(messages) == 1, (msg, messages)  # the end of the stream, no start
            error = messages[0]["error"]
            assert error["code"] == "invalid_argument", (msg, error)
            assert error["message"].startswith(f"{field}: "), (msg, error)
        v1 = {"authorization": f"Bearer {token}"}
        assert http.get(f"/v1/trajectories/{sid}", headers=v1).json()["actions"] == 0

        for selector, field in (({"pid": True}, "process.pid"), ({"pid": "one"}, "process.pid"),
                                ({"tag": 1}, "process.tag")):  # fmt: skip
            for method in ("CloseStdin", "SendSignal"):
                body = {"process": selector, "signal": "SIGNAL_SIGKILL"}
                answer = http.post(f"/process.Process/{method}", json=body, headers=envd)
                assert answer.status_code == 400, (method, selector, answer.text)
                assert answer.json()["code"] == "invalid_argument", answer.text
                assert answer.json()["message"].startswith(f"{field}: "), answer.text

        start = {"process": {**command, "cwd": "/", "args": []}, "stdin": False, "tag": "t"}
        answer = http.post("/process.Process/Start", content=_envelope(start), headers=streamed)
        events = _messages(answer.content)
        assert events[0] == {"event": {"start": {"pid": 1}}}, events
        assert events[-2]["event"]["end"]["exitCode"] == 0 and events[-1] == {}, events
        answer = http.post("/process.Process/CloseStdin", json={"process": {"pid": 1}},
                           headers=envd)  # fmt: skip
        assert answer.status_code == 404, answer.text  # (it has ended: read, then not found)


def test_envd_takes_an_integer_as_proto_json_does_a_number_or_a_decimal_string(
    tmp_path: Path,
) -> None:
    """A ``uint32`` of envd's proto (a process's pid, ListDir's depth) is, in protobuf's
    canonical JSON mapping, a JSON number or a decimal string of one: ``"pid": "1"``
    names pid 1, as envd's own (Go's protojson) reads it. Anything else stays refused
    naming the field, never converted, and a refused call does nothing to the command
    (a SIGKILL sent with ``"pid": true`` does not reach pid 1)."""
    with _sandbox(tmp_path, runtime="process") as (http, sid, token):
        envd = {"E2b-Sandbox-Id": sid, "X-Access-Token": token}
        streamed = {**envd, "Content-Type": "application/connect+json"}
        start = {"process": {"cmd": "/bin/sh", "args": ["-c", "read line; echo got $line"]},
                 "stdin": True}  # fmt: skip
        with http.stream("POST", "/process.Process/Start", content=_envelope(start),
                         headers=streamed) as stream:  # fmt: skip
            chunks, held = stream.iter_bytes(), bytearray()
            assert _next_message(chunks, held) == {"event": {"start": {"pid": 1}}}
            for pid in (True, False, 1.5, "1.5", -1, "-1", 2**32, str(2**32), "one", " 1",
                        "0x1", "", [1], {"pid": 1}):  # fmt: skip
                body = {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}
                answer = http.post("/process.Process/SendSignal", json=body, headers=envd)
                assert answer.status_code == 400, (pid, answer.text)
                assert answer.json()["code"] == "invalid_argument", answer.text
                assert answer.json()["message"].startswith("process.pid: "), answer.text
                assert json.dumps(pid) in answer.json()["message"], answer.text
            line = {"stdin": base64.b64encode(b"it\n").decode()}
            answer = http.post("/process.Process/SendInput", headers=envd,
                               json={"process": {"pid": "1"}, "input": line})  # fmt: skip
            assert answer.status_code == 200, answer.text
            answer = http.post("/process.Process/CloseStdin", headers=envd,
                               json={"process": {"pid": "1e0"}})  # fmt: skip
            assert answer.status_code == 200, answer.text
            events = [_next_message(chunks, held)]
            while "end" not in events[-1].get("event", {}):
                events.append(_next_message(chunks, held))
        out = b"".join(base64.b64decode(e["event"]["data"]["stdout"]) for e in events[:-1])
        assert out == b"got it\n", events  # alive after the refusals, then read its line
        assert events[-1]["event"]["end"]["exitCode"] == 0, events

        def list_dir(depth: object) -> httpx.Response:
            return http.post("/filesystem.Filesystem/ListDir", headers=envd,
                             json={"path": "tree", "depth": depth})  # fmt: skip

        made = http.post("/filesystem.Filesystem/MakeDir", json={"path": "tree/a/b"},
                         headers=envd)  # fmt: skip
        assert made.status_code == 200, made.text
        for depth, names in (("2", ["a", "b"]), (2, ["a", "b"]), ("0", ["a"]), ("1", ["a"]),
                             (str(2**32 - 1), ["a", "b"]), (2.0, ["a", "b"])):  # fmt: skip
            answer = list_dir(depth)
            assert answer.status_code == 200, (depth, answer.text)
            assert sorted(e["name"] for e in answer.json()["entries"]) == names, depth
        for depth in (True, "2.5", 2.5, "-1", -1, str(2**32), 2**32, "two", "+2"):
            answer = list_dir(depth)
            assert answer.status_code == 400, (depth, answer.text)
            assert answer.json()["code"] == "invalid_argument", answer.text
            assert answer.json()["message"].startswith("depth: "), answer.text


def test_the_e2b_list_names_only_the_sandboxes_made_through_it(tmp_path: Path) -> None:
    """An E2B cleanup lists every sandbox and kills each: the list named the tenant's
    trajectories opened through /v1 too (an RL trainer's), and the cleanup killed them.
    Both lists name only the sandboxes made through E2B's API, whatever the query; a /v1
    trajectory is still a sandbox by its id (info, connect, envd, kill)."""
    with _sandbox(tmp_path) as (http, sid, token):
        v1 = {"authorization": f"Bearer {token}"}
        opened = http.post("/v1/trajectories", headers=v1,
                           json={"env": "box", "labels": {"run": "1"}})  # fmt: skip
        assert opened.status_code == 201, opened.text
        tid = opened.json()["id"]
        for path, query in (
            ("/sandboxes", {}),
            ("/sandboxes", {"metadata": "run=1"}),  # (the sandbox's metadata, the /v1 labels)
            ("/v2/sandboxes", {}),
            ("/v2/sandboxes", {"template": "box", "state": "running", "order": "asc"}),
            ("/v2/sandboxes", {"metadata": "run=1", "limit": "1"}),
        ):
            listed = http.get(path, params=query)
            assert listed.status_code == 200, listed.text
            assert [box["sandboxID"] for box in listed.json()] == [sid], (path, query)
            assert "X-Next-Token" not in listed.headers

        for box in http.get("/v2/sandboxes").json():  # the cleanup
            assert http.delete(f"/sandboxes/{box['sandboxID']}").status_code == 204
        assert http.get("/sandboxes").json() == []
        assert http.get(f"/v1/trajectories/{tid}", headers=v1).json()["state"] == "open"

        info = http.get(f"/sandboxes/{tid}")
        assert info.status_code == 200 and info.json()["metadata"] == {"run": "1"}, info.text
        assert http.post(f"/sandboxes/{tid}/connect", json={"timeout": 60}).status_code == 200
        envd = {"E2b-Sandbox-Id": tid, "X-Access-Token": token}
        assert http.get("/health", headers=envd).status_code == 204
        assert http.get("/sandboxes").json() == []  # (found by its id: still not listed)
        assert http.delete(f"/sandboxes/{tid}").status_code == 204
        assert http.get(f"/v1/trajectories/{tid}", headers=v1).status_code == 404  # closed
