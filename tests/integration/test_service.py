"""The scheduler service end to end: real HTTP, a real agent over its WebSocket, real
processes in real cgroups (the process runtime), the real client."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.api.demand import AmdahlEfficiency, RangeDemand
from tangram.api.wire import EnvSpec
from tangram.cli.up import pool_reloader
from tangram.client import ActionResult, ActionStatus, Client, TangramError
from tangram.client.common import Call, exec_body
from tangram.node_agent.agent import NodeAgent
from tangram.service.api_calls import MAX_RESPONSE_BYTES
from tangram.service.auth import AGENT_TENANT, OPERATOR_TENANT, TokenStore
from tangram.service.config import ActionProfile, ApiEndpoint, EnvConfig, PoolConfig

from .http_stub import JsonHandler, http_serving
from .service_harness import on_processes, service, until

pytestmark = [pytest.mark.xdist_group("service")]
CORES = sorted(os.sched_getaffinity(0))

CONFIG = PoolConfig(
    envs={
        "shell": EnvConfig(
            spec=EnvSpec(name="shell", image="unused-by-the-process-runtime", memory_gb=0.1),
            profiles={
                "tests": ActionProfile(
                    command=("sh", "-c", "echo dop={dop} env=$TANGRAM_DOP"),
                    cpu=RangeDemand(min=1, max=len(CORES)),
                    t1_s=10.0,
                    efficiency=AmdahlEfficiency(amdahl=0.99),
                )
            },
        ),
        "capped": EnvConfig(
            spec=EnvSpec(name="capped", image="unused-by-the-process-runtime", memory_gb=0.1),
            profiles={"hang": ActionProfile(command=("sleep", "30"), timeout_s=0.3)},
            max_command_s=0.5,
        ),
    },
    apis=(ApiSpec(name="search", concurrency=1),),
)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    agent = NodeAgent.create(
        tmp_path / "agent", runtime="process", idle_cores=1, cores_for_actions=len(CORES)
    )
    with service(CONFIG, agent, tmp_path) as (running, token), Client(running.url, token) as c:
        yield c


def test_open_exec_close(client: Client) -> None:
    with client.trajectory("shell", labels={"job": "grpo-1"}) as t:
        assert t.info is not None and t.info.node and t.info.labels == {"job": "grpo-1"}
        r = t.exec(["sh", "-c", "echo hi; echo err >&2; exit 3"])
        assert r.status is ActionStatus.OK and r.exit_code == 3
        assert (r.stdout, r.stderr) == ("hi\n", "err\n")
        assert r.allocation.dop == 1 and len(r.allocation.cores) == 1
        assert r.timings.act_s >= r.timings.exec_s > 0
        assert client.get(t.id).actions == 1
    with pytest.raises(TangramError) as e:
        client.get(t.id)
    assert e.value.status == 404


def test_an_elastic_profile_gets_every_free_core(client: Client) -> None:
    with client.trajectory("shell") as t:
        r = t.exec(profile="tests")
        assert r.status is ActionStatus.OK
        assert r.stdout == f"dop={len(CORES)} env={len(CORES)}\n"
        assert r.allocation.cores == CORES and r.allocation.path == "process"


def test_a_timeout_counts_execution_only(client: Client) -> None:
    with client.trajectory("shell") as t:
        r = t.exec(["sleep", "30"], timeout_s=0.5)
        assert r.status is ActionStatus.TIMEOUT and r.exit_code is None, r.error


def test_no_command_runs_past_its_environments_max_command_seconds(client: Client) -> None:
    """An endless command given no timeout held its cores, and its trajectory (whose idle
    timeout waits for running actions), for good: a TrajectoryEnv's maxCommandSeconds
    bounds it. A timeout says which limit killed it."""
    with client.trajectory("capped") as t:
        r = t.exec(["sleep", "30"])
        assert r.status is ActionStatus.TIMEOUT and r.error is not None, r
        assert r.error.message == "killed after 0.5 s (TrajectoryEnv capped's maxCommandSeconds)"
        r = t.exec(profile="hang")
        assert r.error is not None, r
        assert r.error.message == "killed after 0.3 s (profile hang's timeoutSeconds)"
        r = t.exec(["sleep", "30"], timeout_s=0.2)
        assert r.error is not None and r.error.message == "killed after 0.2 s (timeout_s)", r
        r = t.exec(["sleep", "30"], timeout_s=60)  # (cut, not refused: E2B's SDK sends 60)
        said = "killed after 0.5 s (TrajectoryEnv capped's maxCommandSeconds; timeout_s asked 60 s)"
        assert r.error is not None and r.error.message == said, r
    with client.trajectory("shell") as t:  # no limit there
        assert t.exec(["sleep", "0.7"]).status is ActionStatus.OK


def test_idempotent_retries_run_once(client: Client, tmp_path: Path) -> None:
    with client.trajectory("shell") as t:
        first = t.exec(["sh", "-c", "echo x >> count; wc -l < count"], idempotency_key="k1")
        again = t.exec(["sh", "-c", "echo x >> count; wc -l < count"], idempotency_key="k1")
        assert first.id == again.id and first.stdout == again.stdout == "1\n"


def test_output_whose_encoding_is_over_the_links_frame_ends_only_its_own_action(
    client: Client,
) -> None:
    """11 MiB of NUL bytes is 66 MiB of JSON (each one \\u0000): sent whole, that reply
    ended the agent's link and every action of the node with it, the same on each retry.
    It is cut to what the link carries, and says so."""
    with client.trajectory("shell") as t, client.trajectory("shell") as other:
        beside: list[ActionResult] = []
        slow = threading.Thread(target=lambda: beside.append(other.exec(["sleep", "2"])))
        slow.start()
        r = t.exec(["head", "-c", str(11 << 20), "/dev/zero"], output_cap=16 << 20)
        slow.join(30)
        assert r.status is ActionStatus.OK and r.exit_code == 0, r.error
        assert r.stdout_truncated and 0 < len(r.stdout) < 11 << 20 and set(r.stdout) == {"\0"}
        assert beside[0].status is ActionStatus.OK, beside[0].error
        assert t.exec(["true"]).status is ActionStatus.OK  # the node is still there


def test_cancel_a_running_action_by_its_key(client: Client, tmp_path: Path) -> None:
    """A cancelled command is killed; its result keeps what it wrote and the time it ran
    as its exec_s (it was all lost, the run time counted as overhead)."""
    started = tmp_path / "started"
    with client.trajectory("shell") as t:
        box: list[ActionResult] = []
        argv = ["sh", "-c", f"echo before; echo err >&2; touch {started}; exec sleep 30"]
        worker = threading.Thread(target=lambda: box.append(t.exec(argv, idempotency_key="slow")))
        worker.start()
        until(started.exists, "the command did not start")
        assert client.cancel("key:slow")
        worker.join(20)
        (r,) = box
        assert r.status is ActionStatus.CANCELLED and r.error is None, r
        assert (r.stdout, r.stderr, r.allocation.path) == ("before\n", "err\n", "process"), r
        assert r.timings.exec_s > 0 and r.exit_code is None, r
        # The key's answer is the same one.
        again = t.exec(argv, idempotency_key="slow")
        assert (again.status, again.stdout) == (ActionStatus.CANCELLED, "before\n"), again


def test_api_leases_respect_the_quota(client: Client) -> None:
    first = client.lease("search")
    assert first.status is ActionStatus.OK and first.lease
    granted: list[tuple[float, ActionResult]] = []

    def wait_for_second() -> None:
        second = client.lease("search")
        granted.append((time.monotonic(), second))

    waiter = threading.Thread(target=wait_for_second)
    waiter.start()
    time.sleep(0.3)
    assert not granted  # concurrency 1: the second lease waits for the first
    released_at = time.monotonic()
    client.release(first.lease)
    waiter.join(10)
    ((got_at, second),) = granted
    assert got_at >= released_at and second.timings.queued_s > 0  # only after the release
    assert second.lease
    # Held: a lease that may wait only so long gives up, and takes nothing.
    late = client.lease("search", queue_timeout_s=0.2)
    assert late.status is ActionStatus.REJECTED and not late.lease, late
    client.release(second.lease)


def test_bad_input_is_a_400_naming_the_field(client: Client) -> None:
    with client.trajectory("shell") as t:
        with pytest.raises(TangramError) as e:
            client.exec(t.id, ["true"], cores=0)
        assert (e.value.status, e.value.field) == (400, "cpu")
        # The part of a demand that allows no core, as the request spells it (was "cpu").
        url, token = client._async.url, client._async._headers["Authorization"]
        for cpu, part in (({"min": 0, "max": 1}, "cpu.min"), ({"choices": [0, 2]}, "cpu.choices")):
            body = {"argv": ["true"], "cpu": cpu}
            answer = httpx.post(
                f"{url}/v1/trajectories/{t.id}/exec", json=body, headers={"Authorization": token}
            )
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["details"][0]["field"] == part
    with pytest.raises(TangramError) as e:
        client.open("no-such-env")
    assert e.value.status == 404 and e.value.field == "env"  # no such TrajectoryEnv
    with pytest.raises(TangramError) as e:
        client.exec("nope", ["true"])
    assert e.value.status == 404
    # A step count no trajectory has overflowed the orderings' arithmetic (500 on every
    # exec of it); a key with a newline could not be named by the cancel route.
    with pytest.raises(TangramError) as e:
        client.open("shell", expected_steps=10**400)
    assert (e.value.status, e.value.field) == (400, "expected_steps")
    with client.trajectory("shell") as t:
        with pytest.raises(TangramError) as e:
            t.exec(["true"], idempotency_key="job-1\n")
        assert (e.value.status, e.value.field) == (400, "idempotency_key")
        assert "control characters" in str(e.value)
        # What a check across the body finds names its field, not "body".
        for field, kw in (
            ("argv", {"argv": ["echo", "a\0b"]}),
            ("env", {"argv": ["true"], "env": {"1BAD": "x"}}),
            ("stdin", {"argv": ["cat"], "stdin": "a\0b"}),
        ):
            with pytest.raises(TangramError) as e:
                client.exec(t.id, **kw)
            assert (e.value.status, e.value.field) == (400, field), e.value


def test_metrics_and_health(client: Client) -> None:
    with client.trajectory("shell") as t:
        for _ in range(3):
            t.exec(["true"])
        url = client._async.url
        text = httpx.get(f"{url}/metrics").text
    count = [ln for ln in text.splitlines() if ln.startswith("tangram_action_act_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 3
    assert 'tangram_actions_total{kind="exec",pool="default",status="ok"}' in text
    assert (
        f'tangram_units_capacity{{node="{os.uname().nodename}",pool="default",resource="cpu"}}'
        in text
    )
    assert 'tangram_agents_connected{pool="default"} 1.0' in text
    # Nothing queued or running then: an idle node prices its cores at nothing. The
    # trajectory was still open and thinking, so the price's inputs were there.
    node = os.uname().nodename
    on_node = f'{{node="{node}",pool="default"}}'
    assert f"tangram_core_price{on_node} 0.0" in text
    assert f"tangram_core_price_return{on_node} 0.0" in text
    assert f"tangram_thinking_trajectories{on_node} 1.0" in text
    assert _gauge(text, f"tangram_offered_load{on_node}") > 0.0
    assert _gauge(text, 'tangram_think_seconds{pool="default"}') > 0.0
    assert httpx.get(f"{url}/healthz").text == "ok"
    assert httpx.get(f"{url}/readyz").status_code == 200
    # Closed, the trajectory leaves every state at 0, each series still there; "closed"
    # is no state a held trajectory is in (it was always 0): the counters say it.
    after = httpx.get(f"{url}/metrics").text
    for state in ("open", "away", "lost", "closing"):
        assert _gauge(after, f'tangram_trajectories{{pool="default",state="{state}"}}') == 0.0
    assert 'state="closed"' not in after
    # (the service is the module's: other tests' trajectories count too, all closed)
    opened = _gauge(after, 'tangram_trajectories_opened_total{pool="default"}')
    assert opened >= 1.0
    assert _gauge(after, 'tangram_trajectories_closed_total{pool="default"}') == opened


def _gauge(text: str, series: str) -> float:
    (line,) = (ln for ln in text.splitlines() if ln.startswith(series + " "))
    return float(line.split()[-1])


class _Provider(JsonHandler):
    """An API provider on 127.0.0.1 that wants a bearer credential."""

    def do_GET(self) -> None:  # noqa: N802 (http.server names it)
        ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
        body: object = {"path": self.path, "auth_ok": ok}
        if self.path.startswith("/dump"):  # more than a proxied answer may hold
            body = b"x" * (MAX_RESPONSE_BYTES + 1)
        self.answer(200 if ok else 401, body)


SECRET = "s3cret-credential-value"


def test_proxied_api_calls_use_the_credential_and_never_return_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    with http_serving(_Provider) as url:
        config = PoolConfig(
            apis=(
                ApiSpec(name="search", concurrency=1),
                ApiSpec(name="plain", concurrency=1),
                ApiSpec(name="later", concurrency=1),
            ),
            endpoints={
                "search": ApiEndpoint(url, SECRET),
                # As `tangram serve --kubernetes` starts when a secretRef names no Secret yet.
                "later": ApiEndpoint(url, unresolved="apis[later].secretRef: no Secret k"),
            },
        )
        with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
            # A pool of API quotas only needs no node to be ready.
            assert httpx.get(f"{running.url}/readyz").status_code == 200
            r = c.call("search", "/v1/find", query={"q": "tangram"})
            assert r.status is ActionStatus.OK and r.kind == "api"
            assert r.output is not None and r.output["status"] == 200
            assert r.output["body"] == {"path": "/v1/find?q=tangram", "auth_ok": True}
            assert SECRET not in r.model_dump_json()
            with pytest.raises(TangramError) as e:
                c.call("plain", "/")
            assert e.value.status == 400 and e.value.field == "api"
            with pytest.raises(TangramError) as e:
                c.call("later", "/")  # refused, saying why (not retried); not sent without its key
            assert e.value.status == 502 and "apis[later].secretRef: no Secret k" in str(e.value)
            leased = c.lease("later")  # leasing needs no credential
            assert leased.status is ActionStatus.OK and leased.lease is not None
            c.release(leased.lease)
            with pytest.raises(TangramError) as e:
                c._run(c._async._call(_raw_call("search", {"headers": {"Authorization": "x"}})))
            assert e.value.status == 400
            # An answer over the bound is an error naming it, not the scheduler's memory.
            big = c.call("search", "/dump")
            assert big.status is ActionStatus.ERROR and big.error is not None
            assert "over 16 MiB" in big.error.message and big.output is None
    assert SECRET not in caplog.text


def test_a_proxied_call_cannot_leave_its_endpoints_base_path(tmp_path: Path) -> None:
    """An endpoint scoped to a prefix of a gateway keeps its credential under it: dot
    segments, as written or percent-encoded (the HTTP client would normalise them away),
    are refused naming the path."""
    with http_serving(_Provider) as url:
        config = PoolConfig(
            apis=(ApiSpec(name="search", concurrency=1),),
            endpoints={"search": ApiEndpoint(url + "/api/v1", SECRET)},
        )
        with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
            r = c.call("search", "/find/.../x.y")  # (dots that are no segment of their own)
            assert r.output is not None and r.output["body"] == {
                "path": "/api/v1/find/.../x.y", "auth_ok": True}  # fmt: skip
            climbs = ("/../../admin", "/a/%2e%2e/%2E%2E/admin", "/a/..%2f..%2fadmin",
                      "/a/..;x/b", "/a/.%3b/..%3Bjsessionid=1/admin")  # fmt: skip
            for climbing in climbs:
                with pytest.raises(TangramError) as e:
                    c.call("search", climbing)
                assert e.value.status == 400 and e.value.field == "path", climbing


def _raw_call(api: str, body: dict[str, object]) -> Call:
    return Call("POST", f"/v1/apis/{api}/call", body)


def test_a_key_reused_for_another_operation_is_a_conflict(client: Client) -> None:
    with client.trajectory("shell") as t:
        t.exec(["true"], idempotency_key="same")
        with pytest.raises(TangramError) as e:
            client.exec("other-trajectory", ["true"], idempotency_key="same")
        assert e.value.status == 409 and e.value.field == "idempotency_key"


def test_a_key_reused_with_another_command_is_a_conflict_in_flight_and_after(
    client: Client, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    first = ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done; echo first"]
    with client.trajectory("shell") as t:
        got: list[ActionResult] = []
        running = threading.Thread(target=lambda: got.append(t.exec(first, idempotency_key="k")))
        running.start()
        opening = threading.Timer(10, gate.touch)  # a request that joined the run must end
        opening.start()
        while client.get(t.id).actions == 0:  # admitted: its key names it from now on
            time.sleep(0.01)
        with pytest.raises(TangramError) as e:
            t.exec(["echo", "second"], idempotency_key="k")
        assert e.value.status == 409 and e.value.field == "idempotency_key"
        assert "with another request (argv differs)" in str(e.value)
        opening.cancel()
        gate.touch()
        running.join()
        assert got[0].stdout == "first\n"
        for other in (["echo", "second"], [*first, "extra"]):
            with pytest.raises(TangramError) as e:
                t.exec(other, idempotency_key="k")
            assert e.value.status == 409 and "with another request" in str(e.value)
        with pytest.raises(TangramError) as e:  # the same command with other settings
            t.exec(first, idempotency_key="k", timeout_s=5)
        assert e.value.status == 409
        again = t.exec(first, idempotency_key="k")  # a true retry gets the first answer
        assert again.id == got[0].id and again.stdout == "first\n"
        assert client.get(t.id).actions == 1


def test_a_lease_of_n_units_holds_exactly_n(tmp_path: Path) -> None:
    config = PoolConfig(apis=(ApiSpec(name="search", concurrency=4),))
    with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
        whole = c.lease("search", units=4)
        assert whole.status is ActionStatus.OK and whole.lease
        c.release(whole.lease)
        with pytest.raises(TangramError) as e:
            c.lease("search", units=5)
        assert e.value.status == 400


def test_a_tenant_sees_and_touches_only_its_own_trajectories(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    alice, bob, agent_token = "a" * 24, "b" * 24, "c" * 24
    tokens = TokenStore({alice: "alice", bob: "bob", agent_token: AGENT_TENANT})
    agent = NodeAgent.create(tmp_path / "agent", runtime="process")
    with (
        service(CONFIG, agent, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, alice) as a,
        Client(running.url, bob) as b,
    ):
        mine = a.open("shell")
        for attempt in (
            lambda: b.get(mine.id),
            lambda: b.exec(mine.id, ["true"]),
            lambda: b.close(mine.id),
        ):
            with pytest.raises(TangramError) as e:
                attempt()
            assert e.value.status == 404  # another tenant's trajectory does not exist
        assert b.cancel("key:anything") is False
        assert a.exec(mine.id, ["true"]).status is ActionStatus.OK
        # Ids are per tenant: bob's trajectory of the same id is his own environment, and
        # opening it tells him nothing of alice's.
        his = b.open("shell", id=mine.id)
        assert his.id == mine.id
        with pytest.raises(TangramError) as e:
            b.open("shell", id=mine.id)
        assert e.value.status == 409  # his own id again
        a.exec(mine.id, ["sh", "-c", "echo alice > mark"])
        seen = b.exec(his.id, ["sh", "-c", "cat mark || echo none"])
        assert seen.trajectory == mine.id and seen.stdout.strip() == "none"
        b.close(his.id)
        assert a.exec(mine.id, ["cat", "mark"]).stdout.strip() == "alice"
        assert a.get(mine.id).state.value == "open"
        a.close(mine.id)


def test_cancelling_a_whole_trajectory_keeps_it_open(client: Client) -> None:
    with client.trajectory("shell") as t:
        box: list[ActionResult] = []
        worker = threading.Thread(target=lambda: box.append(t.exec(["sleep", "30"])))
        worker.start()
        deadline = time.monotonic() + 10
        while client.cancel_all(t.id) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        worker.join(20)
        assert box[0].status is ActionStatus.CANCELLED
        assert t.exec(["true"]).status is ActionStatus.OK  # still open


def test_a_batch_is_admitted_whole_or_not_at_all(client: Client, tmp_path: Path) -> None:
    with client.trajectory("shell") as t:
        results = client.batch(
            [
                {"trajectory": t.id, "exec": exec_body(["sh", "-c", "echo one"])},
                {"api": "search", "lease": {"units": 1, "hold_s": 1}},
                {"trajectory": t.id, "exec": exec_body(["sh", "-c", "echo two"])},
            ]
        )
        assert [r.kind for r in results] == ["exec", "api", "exec"]
        assert [results[0].stdout, results[2].stdout] == ["one\n", "two\n"]
        assert results[1].lease
        client.release(results[1].lease)
        marker = tmp_path / "ran"
        touch = {"trajectory": t.id, "exec": exec_body(["touch", str(marker)])}  # keyed
        with pytest.raises(TangramError) as e:
            client.batch([touch, {"trajectory": "no-such-trajectory", "exec": exec_body(["true"])}])
        assert e.value.status == 404
        time.sleep(0.3)
        assert not marker.exists()  # the first item was withdrawn with the batch
        (again,) = client.batch([touch])  # its key was forgotten too: a retry runs it
        assert again.status is ActionStatus.OK and marker.exists()


def test_the_operator_reloads_over_http_and_nobody_else_can(tmp_path: Path) -> None:
    user, operator = "u" * 24, "o" * 24
    tokens = TokenStore({user: "local", operator: OPERATOR_TENANT})
    config = PoolConfig(apis=(ApiSpec(name="search", concurrency=1),))
    with service(config, None, tmp_path, tokens=tokens) as (running, _):
        url = f"{running.url}/v1/admin/reload"
        # No valid token: 401; a valid one of another role: 403, saying whose it is.
        assert httpx.post(url, headers={"Authorization": f"Bearer {'x' * 24}"}).status_code == 401
        refused = httpx.post(url, headers={"Authorization": f"Bearer {user}"})
        assert refused.status_code == 403, refused.text
        assert "the token of local" in refused.json()["error"]["message"]
        bigger = PoolConfig(apis=(ApiSpec(name="search", concurrency=5),))
        running.engine.reloader = lambda _text: bigger
        answer = httpx.post(url, headers={"Authorization": f"Bearer {operator}"})
        assert answer.status_code == 200 and answer.json()["changes"]
        assert running.engine.core.quotas["search"].concurrency == 5
        # An operator token cannot submit work.
        refused = httpx.post(
            f"{running.url}/v1/apis/search/lease",
            json={},
            headers={"Authorization": f"Bearer {operator}"},
        )
        assert refused.status_code == 403, refused.text
        assert "is for the /v1/admin routes" in refused.json()["error"]["message"]


def test_the_idempotency_key_header_works_like_the_field(client: Client) -> None:
    url, token = client._async.url, client._async._headers["Authorization"]
    with client.trajectory("shell") as t:
        send = {"argv": ["sh", "-c", "echo x >> n; wc -l < n"]}
        headers = {"Authorization": token, "Idempotency-Key": "h1"}
        first = httpx.post(f"{url}/v1/trajectories/{t.id}/exec", json=send, headers=headers)
        again = httpx.post(f"{url}/v1/trajectories/{t.id}/exec", json=send, headers=headers)
        assert first.json()["id"] == again.json()["id"] and again.json()["stdout"] == "1\n"
        too_long = {**headers, "Idempotency-Key": "k" * 201}
        bad = httpx.post(f"{url}/v1/trajectories/{t.id}/exec", json=send, headers=too_long)
        assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["error"]["message"]
        # Another key in the body: refused, not one of them silently (which to retry with?)
        other = {**send, "idempotency_key": "b1"}
        both = httpx.post(f"{url}/v1/trajectories/{t.id}/exec", json=other, headers=headers)
        assert both.status_code == 400, both.text
        assert "'h1' is not the body's idempotency_key 'b1'" in both.json()["error"]["message"]
        same = httpx.post(
            f"{url}/v1/trajectories/{t.id}/exec", json={**send, "idempotency_key": "h1"},
            headers=headers,
        )  # fmt: skip
        assert same.json()["id"] == first.json()["id"]  # the same key both ways: fine


POOL_DOCUMENTS = """\
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: p, namespace: rl}
spec:
  cpu: {}
  apis: [{name: search, concurrency: 3}]
---
apiVersion: tangram.dev/v1alpha1
kind: TrajectoryEnv
metadata: {name: shell, namespace: rl}
spec: {poolRef: p, image: unused-by-the-process-runtime}
"""


USER_TOKEN, OPERATOR_TOKEN, AGENT_TOKEN = "u" * 24, "o" * 24, "g" * 24


def _operated(tmp_path: Path) -> tuple[TokenStore, NodeAgent]:
    """Tokens of a user (tenant local), the operator and the agent, and a process-runtime
    agent on every core: a pool as the operator runs it, for its admin calls."""
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    tokens = TokenStore(
        {USER_TOKEN: "local", OPERATOR_TOKEN: OPERATOR_TENANT, AGENT_TOKEN: AGENT_TENANT}
    )
    agent = NodeAgent.create(
        tmp_path / "agent", runtime="process", idle_cores=1, cores_for_actions=len(CORES)
    )
    return tokens, agent


def test_the_operator_pushes_documents_reads_figures_and_drains(tmp_path: Path) -> None:
    """The three admin calls the operator makes, against a real agent."""
    tokens, agent = _operated(tmp_path)
    user, operator = USER_TOKEN, OPERATOR_TOKEN
    with (
        service(CONFIG, agent, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, user) as client,
    ):
        running.engine.reloader = pool_reloader([], None)
        op = {"Authorization": f"Bearer {operator}"}
        status, reload, drain = (
            f"{running.url}/v1/admin/{x}" for x in ("status", "reload", "drain")
        )
        assert httpx.get(status, headers={"Authorization": f"Bearer {user}"}).status_code == 403
        figures = httpx.get(status, headers=op).json()
        assert (figures["nodes"], figures["cores"], figures["draining"]) == (1, len(CORES), False)

        bad = httpx.post(
            reload, content=POOL_DOCUMENTS.replace("concurrency: 3", "x: 1"), headers=op
        )
        assert bad.status_code == 400 and "spec.apis[0].x" in bad.json()["error"]["message"]
        (detail,) = bad.json()["error"]["details"]  # (each problem, a client need not parse)
        assert detail["field"] == "body" and "spec.apis[0].x: unknown field" in detail["message"]
        assert running.engine.core.quotas["search"].concurrency == 1  # the old config stays
        good = httpx.post(reload, content=POOL_DOCUMENTS, headers=op)
        assert good.status_code == 200, good.text
        assert running.engine.core.quotas["search"].concurrency == 3

        with client.trajectory("shell") as t:
            figures = httpx.post(drain, headers=op).json()
            assert figures["draining"] and figures["trajectories"] == 1
            with pytest.raises(TangramError) as refused:
                client.trajectory("shell").__enter__()
            assert refused.value.status == 503 and "being deleted" in str(refused.value)
            assert t.exec(["echo", "still served"]).stdout == "still served\n"
        assert httpx.get(status, headers=op).json()["trajectories"] == 0


def test_a_close_that_comes_while_the_environment_opens_closes_what_it_makes(
    tmp_path: Path,
) -> None:
    """DELETE while the agent still runs the env's setup: the close waits for the open, so
    the environment it makes is closed too (not left on the node, unaccounted), and the
    open answers 409 instead of a trajectory that is already closed."""
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    slow = EnvSpec(name="slow", image="unused", memory_gb=0.1, setup=[["sleep", "1"]])
    agent = NodeAgent.create(
        tmp_path / "agent", runtime="process", idle_cores=1, cores_for_actions=len(CORES)
    )
    with service(PoolConfig(envs={"slow": EnvConfig(spec=slow)}), agent, tmp_path) as (r, token):
        auth = {"Authorization": f"Bearer {token}"}
        opened: list[httpx.Response] = []

        def open_it() -> None:
            with httpx.Client(base_url=r.url, headers=auth, timeout=60) as http:
                opened.append(http.post("/v1/trajectories", json={"env": "slow", "id": "t1"}))

        opener = threading.Thread(target=open_it)
        opener.start()
        with httpx.Client(base_url=r.url, headers=auth, timeout=60) as http:
            until(lambda: http.get("/v1/trajectories/t1").status_code == 200, "the open")
            closed = http.delete("/v1/trajectories/t1")
        opener.join(60)
        assert closed.status_code == 200 and closed.json()["state"] == "closed"
        assert opened[0].status_code == 409, opened[0].text
        assert "closed while it opened" in opened[0].text
        assert agent.runtime.held() == []  # nothing of it left on the node
        assert r.engine.core.trajectories == {}


def test_the_end_of_a_deleted_pools_drain_ends_every_action_saying_so(tmp_path: Path) -> None:
    """The drain's time ran out with a trajectory open: its pool's objects were deleted
    under the scheduler, and its actions failed with what a missing sandbox says
    (``exec_failed``: the exec server's socket is gone). The operator ends them first."""
    tokens, agent = _operated(tmp_path)
    user, operator = USER_TOKEN, OPERATOR_TOKEN
    started = tmp_path / "started"
    got: list[ActionResult] = []
    with (
        service(CONFIG, agent, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, user, retries=0) as client,
    ):
        t = client.open("shell")
        long = ["sh", "-c", f"echo partial; touch {started}; exec sleep 60"]
        runs = [
            threading.Thread(target=lambda: got.append(client.exec(t.id, long, cores=len(CORES)))),
            threading.Thread(target=lambda: got.append(client.exec(t.id, ["echo", "queued"]))),
        ]
        runs[0].start()
        until(started.exists, "the command did not start")
        runs[1].start()
        until(lambda: running.engine.core.queued == 1, "the second did not queue")
        op = {"Authorization": f"Bearer {operator}"}
        ended = httpx.post(f"{running.url}/v1/admin/drain?end=true", headers=op, timeout=30)
        assert ended.status_code == 200, ended.text
        for run in runs:
            run.join(30)
        with pytest.raises(TangramError) as refused:
            client.exec(t.id, ["true"])
        assert refused.value.status == 503 and "ActionPool was deleted" in str(refused.value)
    by_output = {r.stdout: r for r in got}
    killed, never = by_output["partial\n"], by_output[""]
    for r, words in ((killed, "killed"), (never, "never ran")):
        assert r.status is ActionStatus.CANCELLED and r.error is not None, r
        assert r.error.code == "pool_deleted" and not r.error.retryable, r.error
        assert r.error.message == (
            f"the ActionPool was deleted and its drainSeconds ran out: {words}"
        )


def test_stopping_the_service_gives_actions_in_flight_their_grace(tmp_path: Path) -> None:
    """Ctrl-C of `tangram up`: an action already running finishes within the grace and
    its caller gets its answer, before the trajectories are closed."""
    got: list[ActionResult] = []
    started = tmp_path / "started"
    with on_processes(CONFIG, tmp_path, grace_s=30) as (url, token, _):
        client = Client(url, token, retries=0)
        t = client.open("shell")
        argv = ["sh", "-c", f"touch {started}; sleep 1; echo finished"]
        runner = threading.Thread(target=lambda: got.append(client.exec(t.id, argv)))
        runner.start()
        until(started.exists, "the action did not start")
    runner.join(30)  # the service has stopped (the context's end)
    client.shutdown()
    assert [(r.status, r.stdout) for r in got] == [(ActionStatus.OK, "finished\n")]


def test_a_command_still_running_when_the_grace_ends_is_said_to_be_stopped_by_it(
    tmp_path: Path,
) -> None:
    """Its caller could not tell it from a cancel of its own: no error at all (queued
    actions were told `shutdown`)."""
    got: list[ActionResult] = []
    started = tmp_path / "started"
    with on_processes(CONFIG, tmp_path, grace_s=0.5) as (url, token, _):
        client = Client(url, token, retries=0)
        t = client.open("shell")
        argv = ["sh", "-c", f"echo partial; touch {started}; exec sleep 60"]
        runner = threading.Thread(target=lambda: got.append(client.exec(t.id, argv)))
        runner.start()
        until(started.exists, "the action did not start")
    runner.join(30)
    client.shutdown()
    (r,) = got
    assert r.status is ActionStatus.CANCELLED and r.error is not None, r
    assert r.error.code == "shutdown" and not r.error.retryable, r.error
    assert r.stdout == "partial\n", r


def test_a_cancel_of_its_own_in_the_grace_is_no_shutdown(tmp_path: Path) -> None:
    """A caller's cancel while the service winds down (no longer admitting) was labelled
    as the grace's end (`shutdown`)."""
    got: list[ActionResult] = []
    started = tmp_path / "started"
    with on_processes(CONFIG, tmp_path) as (url, token, engine):
        client = Client(url, token, retries=0)
        t = client.open("shell")
        argv = ["sh", "-c", f"touch {started}; exec sleep 60"]
        run = threading.Thread(
            target=lambda: got.append(client.exec(t.id, argv, idempotency_key="k"))
        )
        run.start()
        until(started.exists, "the action did not start")
        engine.state.accepting = False  # (what a stop does first)
        assert client.cancel("key:k")
        run.join(30)
        engine.state.accepting = True
        client.shutdown()
    (r,) = got
    assert r.status is ActionStatus.CANCELLED and r.error is None, r


def test_an_unkeyed_lease_whose_client_left_is_cancelled_not_granted_to_nobody(
    tmp_path: Path,
) -> None:
    """A raw HTTP client (no idempotency key) waits for a lease behind another and closes
    its connection: nobody could ever learn that lease's id or release it, so the queued
    lease is cancelled; held, it would block the quota for its whole hold."""
    config = PoolConfig(apis=(ApiSpec(name="q", concurrency=1),))
    with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
        held = c.lease("q", hold_s=600)
        assert held.lease is not None
        state = running.engine.state
        body = b'{"hold_s": 600}'
        with socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as s:
            head = (f"POST /v1/apis/q/lease HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{token}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
            s.sendall(head.encode() + body)
            until(lambda: len(state.actions) == 2, "the second lease was not queued")
        until(lambda: len(state.actions) == 1, "the lease of the client that left stayed")
        c.release(held.lease)
        after = c.lease("q", hold_s=600)  # the unit is free
        assert after.status is ActionStatus.OK and list(state.leases) == [after.lease]


def test_a_batchs_unkeyed_items_whose_client_left_are_cancelled_and_their_leases_released(
    tmp_path: Path,
) -> None:
    """As for a single request: of a batch whose client closed its connection, the
    queued unkeyed item is cancelled and the lease already granted to another released
    (nobody could learn its id); the quota has only the lease held before."""
    config = PoolConfig(apis=(ApiSpec(name="q", concurrency=2),))
    with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
        held = c.lease("q", hold_s=600)
        assert held.lease is not None
        state = running.engine.state
        lease = {"api": "q", "lease": {"hold_s": 600}}
        body = json.dumps({"actions": [lease, lease]}).encode()
        with socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as s:
            head = (f"POST /v1/batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{token}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
            s.sendall(head.encode() + body)
            until(lambda: len(state.leases) == 2 and len(state.actions) == 3,
                  "one item was not granted and the other queued")  # fmt: skip
        until(lambda: len(state.actions) == 1, "the queued item of the client that left stayed")
        until(lambda: list(state.leases) == [held.lease], "the granted item's lease stayed held")


def test_a_batchs_lease_whose_client_left_is_released_before_its_slowest_item_ends(
    tmp_path: Path,
) -> None:
    """Of a batch whose client left, the lease granted to one item is released when the
    client goes, not once another item, a command still running, ends."""
    config = PoolConfig(envs=CONFIG.envs, apis=(ApiSpec(name="q", concurrency=1),))
    started = tmp_path / "started"
    with on_processes(config, tmp_path) as (url, token, engine), Client(url, token) as c:
        t = c.open("shell")
        slow = exec_body(["sh", "-c", f"touch {started}; sleep 600"])
        items = [{"api": "q", "lease": {"hold_s": 600}}, {"trajectory": t.id, "exec": slow}]
        body = json.dumps({"actions": items}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
            head = (f"POST /v1/batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{token}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
            s.sendall(head.encode() + body)
            until(lambda: started.exists() and len(engine.state.leases) == 1,
                  "the lease was not granted and the command not started")  # fmt: skip
        until(lambda: not engine.state.leases, "the lease waited for the running command")
        assert len(engine.state.actions) == 1  # the command runs on (it has started)
        after = c.lease("q", hold_s=1)
        assert after.status is ActionStatus.OK


def test_an_env_no_node_has_the_memory_for_fails_its_open_and_one_that_waits_is_told_to(
    tmp_path: Path,
) -> None:
    """More memory than any node has for sandboxes: 400 naming spec.memoryGiB and the
    largest node, noted against the TrajectoryEnv (its status shows it), not a 429 a
    client would retry. Memory that is only taken now: 429."""
    config = PoolConfig(
        envs={
            "huge": EnvConfig(spec=EnvSpec(name="huge", image="unused", memory_gb=1e6)),
        }
    )
    with on_processes(config, tmp_path) as (url, token, engine), Client(url, token) as c:
        (node,) = engine.state.core.cpu.nodes.values()
        with pytest.raises(TangramError) as never:
            c.open("huge")
        assert never.value.status == 400
        said = str(never.value)
        assert "(MemoryDoesNotFit)" in said and "TrajectoryEnv huge" in said
        assert "spec.memoryGiB 1e+06" in said
        assert f"(the most: {node.memory_gb:g} GiB, node {node.name})" in said
        (problem,) = engine.figures().problems
        assert (problem.reason, problem.subject) == ("MemoryDoesNotFit", "TrajectoryEnv huge")
        # "big" fits the node, but not twice over its memory: the second waits (429).
        big = EnvSpec(name="big", image="unused", memory_gb=node.memory_gb * 0.6)
        engine.state.config.envs["big"] = EnvConfig(spec=big)
        t = c.open("big")
        with pytest.raises(TangramError) as full:
            Client(url, token, retries=0).open("big")
        assert full.value.status == 429 and "GiB free for a new trajectory" in str(full.value)
        c.close(t.id)
