"""Proxied API calls (``POST /v1/apis/{api}/call``) against a real HTTP provider on
127.0.0.1: what the caller gets back of the answer, how a call cut off is reported, and
what calls of different quotas and tenants share (nothing)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tangram.api.cluster import ApiSpec
from tangram.client import ActionResult, ActionStatus, AsyncClient, Client
from tangram.service.auth import OPERATOR_TENANT, TokenStore
from tangram.service.config import ApiEndpoint, PoolConfig

from .http_stub import JsonHandler, http_serving
from .service_harness import service, until

pytestmark = [pytest.mark.xdist_group("service")]

SECRET = "proxy-test-credential"
HANG_GUARD_S = 60.0  # a call that has not ended by then hangs: a failure, not a wait
BINARY = bytes(range(256))


class _Provider(JsonHandler):
    """An API: ``/gate`` answers once the test opens the gate (counting the calls in
    flight), ``/login`` sets a cookie, ``/whoami`` says which cookie it got, ``/echo``
    repeats the request's headers (``/escaped`` its credential, JSON-escaped), ``/bin``
    answers bytes that are not UTF-8, ``/redirect`` and ``/limited`` answer with headers
    the caller needs, ``/close`` hangs up after reading the request, ``/slow`` answers
    after 30 s."""

    gate = threading.Event()
    lock = threading.Lock()
    in_flight = 0
    peak = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server names it)
        self._serve()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._serve()

    def _serve(self) -> None:
        path = self.path
        if path.startswith("/gate"):
            with _Provider.lock:
                _Provider.in_flight += 1
                _Provider.peak = max(_Provider.peak, _Provider.in_flight)
            _Provider.gate.wait(HANG_GUARD_S)
            with _Provider.lock:
                _Provider.in_flight -= 1
            self.answer(200, {"gated": True})
        elif path.startswith("/login"):
            self.send_response(200)
            self.send_header("Set-Cookie", "session=alice; Path=/")
            self.send_header("Set-Cookie", "theme=dark; Path=/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path.startswith("/whoami"):
            self.answer(200, {"cookie": self.headers.get("Cookie")})
        elif path.startswith("/echo"):
            echoed = dict(self.headers.items())
            self.send_response(200)
            self.send_header("X-Seen-Authorization", self.headers.get("Authorization", ""))
            data = json.dumps(echoed).encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path.startswith("/escaped"):
            auth = self.headers.get("Authorization", "").replace("-", "\\u002D")
            self.answer(200, f'{{"authorization": "{auth}"}}'.encode())
        elif path.startswith("/bin"):
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(BINARY)))
            self.end_headers()
            self.wfile.write(BINARY)
        elif path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "https://example.invalid/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path.startswith("/limited"):
            self.send_response(429)
            self.send_header("Retry-After", "7")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path.startswith("/close"):
            self.close_connection = True  # read, never answered
        elif path.startswith("/slow"):
            _Provider.gate.wait(30)
            self.answer(200, {})
        else:
            self.answer(404, {"path": path})


@pytest.fixture
def provider() -> Iterator[str]:
    _Provider.gate.clear()
    _Provider.in_flight = _Provider.peak = 0
    with http_serving(_Provider) as url:
        try:
            yield url
        finally:
            _Provider.gate.set()


def _pool(url: str, **concurrency: int) -> PoolConfig:
    return PoolConfig(
        apis=tuple(ApiSpec(name=n, concurrency=c) for n, c in concurrency.items()),
        endpoints={n: ApiEndpoint(url, SECRET) for n in concurrency},
    )


def test_the_answer_comes_back_with_its_headers_and_bytes_and_never_the_credential(
    provider: str, tmp_path: Path
) -> None:
    """Bytes that are not UTF-8 came back as U+FFFD, a redirect without its Location and a
    429 without its Retry-After; an API that echoes the request returned the credential."""
    with (
        service(_pool(provider, api=2), None, tmp_path) as (running, token),
        Client(running.url, token) as c,
    ):
        binary = c.call("api", "/bin").output
        assert binary is not None and binary["body"] is None
        assert base64.b64decode(binary["body_base64"]) == BINARY
        assert binary["headers"]["content-type"] == "application/octet-stream"
        moved = c.call("api", "/redirect").output
        assert moved is not None and moved["status"] == 302
        assert moved["headers"]["location"] == "https://example.invalid/elsewhere"
        limited = c.call("api", "/limited").output
        assert limited == {"status": 429, "headers": limited["headers"], "body": None}
        assert limited["headers"]["retry-after"] == "7"
        assert "content-length" not in limited["headers"]  # (the transfer's, not the answer's)
        logged_in = c.call("api", "/login").output  # a session of the pool's credential
        assert logged_in is not None and "set-cookie" not in logged_in["headers"]
        echoed = c.call("api", "/echo", headers={"X-Mine": "1"})
        assert echoed.output is not None and echoed.output["body"]["X-Mine"] == "1"
        assert echoed.output["body"]["Authorization"] == "Bearer ***"
        assert echoed.output["headers"]["x-seen-authorization"] == "Bearer ***"
        assert SECRET not in echoed.model_dump_json()
        escaped = c.call("api", "/escaped").output  # JSON that escapes what it need not
        assert escaped is not None and escaped["body"] == {"authorization": "Bearer ***"}


def test_one_tenants_cookies_never_go_with_another_tenants_calls(
    provider: str, tmp_path: Path
) -> None:
    """The service's HTTP session kept a cookie jar: a cookie one tenant's call was given
    went with every later call to that host, other tenants' included."""
    alice, bob = "a" * 24, "b" * 24
    tokens = TokenStore({alice: "alice", bob: "bob"})
    # A host name: the jar keeps no cookies for an IP address.
    host = provider.replace("127.0.0.1", "localhost")
    with (
        service(_pool(host, api=2), None, tmp_path, tokens=tokens) as (running, _),
        Client(running.url, alice) as a,
        Client(running.url, bob) as b,
    ):
        assert a.call("api", "/login").status is ActionStatus.OK
        for who in (b, a):
            seen = who.call("api", "/whoami").output
            assert seen == {"status": 200, "headers": seen["headers"],
                            "body": {"cookie": None}}  # fmt: skip


def test_a_quota_waits_for_no_other_quotas_calls(provider: str, tmp_path: Path) -> None:
    """Every quota's calls went through one HTTP connection pool of 100: 120 calls of a
    quota of 150 reached the API 100 at a time, and a call of an idle quota waited for
    them."""
    config = _pool(provider, wide=150, idle=1)
    with service(config, None, tmp_path) as (running, token):

        async def go() -> tuple[list[ActionResult], ActionResult]:
            async with AsyncClient(running.url, token) as c:
                wide = [asyncio.ensure_future(c.call("wide", "/gate")) for _ in range(120)]
                while _Provider.in_flight < 120:  # all at the API at once
                    await asyncio.sleep(0.02)
                    assert not any(w.done() for w in wide), [w.result() for w in wide if w.done()]
                alone = await c.call("idle", "/whoami")  # answered while they all wait
                assert _Provider.in_flight == 120
                _Provider.gate.set()
                return await asyncio.gather(*wide), alone

        wide, alone = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    assert alone.status is ActionStatus.OK
    assert all(r.status is ActionStatus.OK for r in wide) and _Provider.peak == 120


def test_a_call_cut_off_after_it_was_sent_is_retryable_only_when_a_repeat_is_harmless(
    provider: str, tmp_path: Path
) -> None:
    """The API hung up after it read the request: a POST may have taken effect, so it is
    not retryable (it was, and a caller trusting that could make it twice); a GET is. A
    timeout says so, and whether the request may have been made."""
    with (
        service(_pool(provider, api=4), None, tmp_path) as (running, token),
        Client(running.url, token) as c,
    ):
        post = c.call("api", "/close", method="POST", body={"charge": 5})
        assert post.status is ActionStatus.ERROR and post.error is not None
        assert post.error.code == "outcome_unknown" and not post.error.retryable
        assert "the POST may have been made" in post.error.message
        got = c.call("api", "/close")
        assert got.error is not None and got.error.code == "api_failed"
        assert got.error.retryable
        late = c.call("api", "/slow", method="POST", timeout_s=0.2)
        assert late.status is ActionStatus.TIMEOUT and late.error is not None
        assert late.error.message == (
            "no answer within 0.2 s (timeout_s); the POST may have been made"
        )
        late_get = c.call("api", "/slow", timeout_s=0.2)
        assert late_get.error is not None
        assert late_get.error.message == "no answer within 0.2 s (timeout_s)"


def test_a_call_queued_for_a_quota_a_reload_removed_is_still_made(
    provider: str, tmp_path: Path
) -> None:
    """The quota stayed while a call waited for it, but its endpoint went with the
    reload: the call waited its turn and then failed, retryable, and a retry was refused
    (404). It is made through the quota's last endpoint now."""
    user, operator = "u" * 24, "o" * 24
    tokens = TokenStore({user: "local", operator: OPERATOR_TENANT})
    with service(_pool(provider, api=1), None, tmp_path, tokens=tokens) as (running, _):
        results: list[ActionResult] = []
        with Client(running.url, user) as c:
            calls = [
                threading.Thread(target=lambda: results.append(c.call("api", "/gate")))
                for _ in range(2)
            ]
            for call in calls:
                call.start()
            until(lambda: _Provider.in_flight == 1 and running.engine.core.queued == 1,
                  "one call at the API, one queued")  # fmt: skip
            running.engine.reloader = lambda _text: PoolConfig()  # the quota removed
            answer = httpx.post(f"{running.url}/v1/admin/reload",
                                headers={"Authorization": f"Bearer {operator}"})  # fmt: skip
            assert answer.status_code == 200, answer.text
            _Provider.gate.set()
            for call in calls:
                call.join(HANG_GUARD_S)
    assert [r.status for r in results] == [ActionStatus.OK, ActionStatus.OK], results
    assert all(r.output is not None and r.output["body"] == {"gated": True} for r in results)


def test_a_call_holds_the_other_quotas_it_names_while_it_runs(
    provider: str, tmp_path: Path
) -> None:
    config = PoolConfig(
        apis=(ApiSpec(name="api", concurrency=1), ApiSpec(name="parse", concurrency=1)),
        endpoints={"api": ApiEndpoint(provider, SECRET)},
    )
    with service(config, None, tmp_path) as (running, token), Client(running.url, token) as c:
        results: list[ActionResult] = []
        call = threading.Thread(
            target=lambda: results.append(c.call("api", "/gate", quotas={"parse": 1}))
        )
        call.start()
        parse = running.engine.core.quotas["parse"]
        until(lambda: _Provider.in_flight == 1, "the call at the API")
        assert parse.in_use == 1  # held with it
        _Provider.gate.set()
        call.join(HANG_GUARD_S)
        (result,) = results
        assert result.status is ActionStatus.OK and parse.in_use == 0
