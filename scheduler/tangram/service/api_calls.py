"""API quotas: leases the caller uses itself, and calls the service makes for it.

A lease is granted when the round admits it and held until released or its hold limit
passes. A proxied call carries the quota's credential, which never goes back to the
caller, nor into logs or errors.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import secrets
import urllib.parse
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import aiohttp

from tangram.api.action import ActionSpec
from tangram.api.learned import MAX_LEASES, MAX_STARTS, LearnedLease
from tangram.api.resent import IDEMPOTENT_METHODS
from tangram.api.wire import ActionStatus, ApiCallRequest, ApiLeaseRequest, ErrorInfo
from tangram.scheduler.core.scheduler import SchedulingError
from tangram.service.config import ApiEndpoint
from tangram.service.outcomes import Outcomes
from tangram.service.records import ActionRecord, EngineError, err
from tangram.service.state import PoolState

log = logging.getLogger("tangram.service")

# A resent try may reach a scheduler started this long after the try went out (in transit).
RESENT_SLACK_S = 1.0

# A proxied call's answer is held whole (decoded, kept for its idempotency key, sent
# back): one larger than this is an error, not the scheduler's memory.
MAX_RESPONSE_BYTES = 16 << 20
# Connections of one quota's proxied calls at once, at most.
MAX_CONNECTIONS = 1024


# Response headers not passed back: those about the connection or the transfer, not the
# answer (which comes back whole and decoded); and the cookies a session opened for the
# pool's credential, which would let the caller use the API outside its quota.
_NOT_PASSED = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-connection", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "content-encoding", "set-cookie",
    "set-cookie2",
})  # fmt: skip


class _TooLargeError(Exception):
    """The endpoint's answer is over MAX_RESPONSE_BYTES."""


async def _body(resp: aiohttp.ClientResponse, api: str) -> bytes:
    """The answer's body, read no further than the bound."""
    raw = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        raw += chunk
        if len(raw) > MAX_RESPONSE_BYTES:
            raise _TooLargeError(
                f"{api}: the response is over {MAX_RESPONSE_BYTES >> 20} MiB; ask for less "
                "(a page, a range)"
            )
    return bytes(raw)


class ApiCalls:
    def __init__(self, state: PoolState, outcomes: Outcomes) -> None:
        self.s = state
        self.outcomes = outcomes
        # Each quota's calls go through an HTTP session of their own (made on its first
        # call): one quota's slow calls never hold another's connections (a shared pool of
        # aiohttp's default 100 did), and each quota's sockets are bounded.
        self._http: dict[str, aiohttp.ClientSession] = {}
        # The endpoints of quotas a reload removed while calls still queued for them: those
        # are made as admitted (``reconfigured``).
        self._retired: dict[str, ApiEndpoint] = {}
        self._wall_at_zero: float | None = None
        self._born = state.clock()  # (what a resent call's age is compared with)

    def spec(self, api: str, req: ApiLeaseRequest | ApiCallRequest) -> ActionSpec:
        """A lease of ``req.units`` of quota ``api``, or one call through it, as an action."""
        config = self.s.config
        configured = {a.name for a in config.apis}
        if api not in configured or api not in self.s.core.quotas:
            known = ", ".join(sorted(configured)) or "none"
            raise EngineError("not_found", "api", f"unknown API quota {api!r} (known: {known})")
        if isinstance(req, ApiCallRequest):
            endpoint = config.endpoints.get(api)
            if endpoint is None:
                why = f"quota {api!r} has no endpoint: lease it and call it yourself"
                raise EngineError("invalid", "api", why)
            if endpoint.unresolved is not None:  # (502: not retried; a Secret is not seconds away)
                raise EngineError("failed", "api", _unresolved(api, endpoint.unresolved))
        for other in req.quotas:
            if other == api:
                raise EngineError("invalid", "quotas", f"quotas: names {api!r}, whose units are "
                                  "this request's own (units)")  # fmt: skip
            if other not in configured or other not in self.s.core.quotas:
                known = ", ".join(sorted(configured))
                raise EngineError("invalid", "quotas", f"quotas: unknown API quota {other!r} "
                                  f"(known: {known})")  # fmt: skip
        units = req.units if isinstance(req, ApiLeaseRequest) else 1
        # ``quotas`` are units beyond the one an api action holds anyway.
        held = {api: units - 1} if units > 1 else {}
        return ActionSpec(kind="api", api=api, quotas=held | dict(req.quotas))

    def unsure(self, tenant: str, req: ApiCallRequest, resent_s: float) -> ErrorInfo | None:
        """Why a call sent again, ``resent_s`` after its earlier try went out, is not made:
        a scheduler before this one may have made it, and lost its answer with it. None when
        it may be made: its key is known here (the usual answer follows), its method is
        idempotent, or this scheduler was up when the try went out (then the try reached
        this one or none, and a key unknown here never reached it)."""
        key = req.idempotency_key
        if key is None or (tenant, key) in self.s.idempotent:
            return None
        if req.method in IDEMPOTENT_METHODS:
            return None
        if self.s.clock() - self._born > resent_s + RESENT_SLACK_S:
            return None
        return err("outcome_unknown", f"idempotency_key {key!r}: this {req.method} may have "
                   "been made by the scheduler before a restart, and its answer lost with "
                   "it; it is not made a second time. Ask the API whether it took effect; "
                   "to make it anyway, call again with a new key")  # fmt: skip

    def start(self, rec: ActionRecord) -> Coroutine[Any, Any, None] | None:
        """The round granted the quota: the call to make, or None: the lease is granted."""
        if rec.expiry is not None:
            rec.expiry.cancel()
        if isinstance(rec.request, ApiCallRequest):
            return self._proxy(rec, rec.request)
        assert isinstance(rec.request, ApiLeaseRequest)
        self._grant(rec, f"l-{secrets.token_hex(8)}", rec.request.hold_s)
        return None

    def _grant(self, rec: ActionRecord, lease: str, hold_s: float) -> None:
        """``rec`` holds its units as ``lease``, for ``hold_s`` more at most."""
        self.s.leases[lease] = rec.id
        rec.lease = lease
        rec.expiry = asyncio.get_running_loop().call_later(hold_s, self.outcomes.end_lease, rec)
        if not rec.done.done():
            rec.done.set_result(self.outcomes.result(rec, ActionStatus.OK, lease=lease))

    # ---- across a restart ----------------------------------------------------------
    def _wall(self) -> float:
        """Unix seconds at the engine clock's zero (taken once: saved times stay put)."""
        if self._wall_at_zero is None:
            self._wall_at_zero = self.s.wall() - self.s.clock()
        return self._wall_at_zero

    def kept(self) -> tuple[list[LearnedLease], dict[str, list[float]]]:
        """What the next scheduler needs of the quotas: the leases held (the newest
        ``MAX_LEASES``), and the starts each rate window counts (the newest ``MAX_STARTS``
        in all), in unix seconds."""
        s, zero = self.s, self._wall()
        leases: list[LearnedLease] = []
        for lease, aid in s.leases.items():
            rec = s.actions.get(aid)
            req = rec.request if rec is not None else None
            if rec is None or rec.started is None or not isinstance(req, ApiLeaseRequest):
                continue
            assert rec.assignment is not None
            leases.append(
                LearnedLease(
                    lease=lease,
                    tenant=rec.tenant,
                    api=rec.assignment.quotas[0][0],  # (its api first)
                    units=req.units,
                    quotas=dict(req.quotas),
                    started_at=max(0.0, round(zero + rec.started, 3)),
                    hold_s=req.hold_s,
                    key=req.idempotency_key,
                    digest=rec.digest,
                )
            )
        leases = sorted(leases, key=lambda held: (held.started_at, held.lease))[-MAX_LEASES:]
        windows, room = {}, MAX_STARTS
        for name, starts in s.core.windows(s.clock()).items():
            newest = starts[-room:] if room else []
            if newest:
                windows[name] = [max(0.0, round(zero + t, 3)) for t in newest]
                room -= len(newest)
        return leases, windows

    def resume(self, leases: Sequence[LearnedLease], windows: Mapping[str, Sequence[float]]) -> int:
        """Take back what an earlier scheduler saved (``kept``): its rate windows count here,
        and each lease whose hold has not ended holds its units again, under its id (its
        release works) and its idempotency key (a retry gets it), until released or ended.
        Returns how many leases were taken back."""
        s, zero, now = self.s, self._wall(), self.s.clock()
        taken = 0
        for held in leases:
            # A time ahead of this clock (another host's, a hand-edited document) counts as
            # now: a lease never outlives its hold_s from here, nor a start its period.
            started = min(held.started_at - zero, now)
            left = started + held.hold_s - now
            if left <= 0 or held.lease in s.leases:
                continue
            req = ApiLeaseRequest(units=held.units, hold_s=held.hold_s, idempotency_key=held.key,
                                  quotas=held.quotas)  # fmt: skip
            try:
                spec = self.spec(held.api, req)
                for name, units in {held.api: held.units, **held.quotas}.items():
                    quota = s.core.quotas[name]
                    if quota.concurrency is not None and quota.in_use + units > quota.concurrency:
                        raise EngineError("conflict", "api", f"its {units} unit(s) of {name} "
                                          f"are over its concurrency {quota.concurrency} "
                                          f"({quota.in_use} held again already)")  # fmt: skip
                rec = s.record(held.tenant, None, "api", req, None, target=f"lease of {held.api}")
                asg = s.core.adopt(rec.id, s.holder(held.tenant, "leases"), spec, units=1,
                                   started_at=started, granted=True)  # fmt: skip
            except (EngineError, SchedulingError) as e:
                log.warning("lease %s of %s is not held again: %s", held.lease, held.api, e)
                continue
            rec.submitted, rec.started, rec.assignment = started, started, asg
            rec.digest = held.digest
            s.actions[rec.id] = rec
            if held.key is not None and (held.tenant, held.key) not in s.idempotent:
                s.idempotent.remember(held.tenant, held.key, rec)
            self._grant(rec, held.lease, left)
            taken += 1
        s.core.resume_windows(
            {name: [min(t - zero, now) for t in ts] for name, ts in windows.items()}
        )
        s.wake.set()
        return taken

    async def _proxy(self, rec: ActionRecord, req: ApiCallRequest) -> None:
        """Make the call with the quota's credential; the answer goes back, the credential
        never does (nor into logs or errors)."""
        s = self.s
        assert rec.assignment is not None
        api = rec.assignment.quotas[0][0] if rec.assignment.quotas else ""
        endpoint = s.config.endpoints.get(api) or self._retired.get(api)
        t0 = s.clock()
        status, output, error = ActionStatus.ERROR, None, None
        try:
            if endpoint is None:
                raise EngineError("invalid", "api", f"quota {api!r} lost its endpoint")
            # The credential's header is the service's alone, whatever its capitalisation.
            headers = {k: v for k, v in req.headers.items() if k.lower() != endpoint.header.lower()}
            if endpoint.credential is not None:
                headers[endpoint.header] = f"Bearer {endpoint.credential}"
            async with self._session(api).request(
                req.method,
                endpoint.url.rstrip("/") + req.path,
                params=req.query,
                json=req.body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=req.timeout_s),
                allow_redirects=False,  # a redirect would carry the credential elsewhere
            ) as resp:
                output = _answer(resp, await _body(resp, api), endpoint)
                status = ActionStatus.OK
        except asyncio.CancelledError:
            status, error = ActionStatus.CANCELLED, s.stop_ended(rec)
        except TimeoutError:
            status = ActionStatus.TIMEOUT
            error = err("timeout", f"no answer within {req.timeout_s:g} s (timeout_s)"
                        + _maybe_made(req.method))  # fmt: skip
        except (aiohttp.ClientConnectorError, EngineError) as e:  # it never reached the API
            error = err("api_failed", _scrub(str(e), endpoint), retryable=True)
        except aiohttp.ClientError as e:  # sent, and its answer cut off
            why = _scrub(str(e) or type(e).__name__, endpoint)
            if req.method in IDEMPOTENT_METHODS:
                error = err("api_failed", why, retryable=True)
            else:  # a second try could make it twice
                error = err("outcome_unknown", f"{why}{_maybe_made(req.method)}: ask the "
                            "API whether it was; to make it anyway, call again with a new "
                            "key")  # fmt: skip
        except _TooLargeError as e:  # the same request would get the same answer
            error = err("api_failed", str(e))
        except Exception as e:  # anything else must still end the call and free its unit
            error = err("api_failed", _scrub(f"{type(e).__name__}: {e}", endpoint))
        self.outcomes.end(rec, status, error=error, exec_s=s.clock() - t0, output=output)

    def reconfigured(self, old: Mapping[str, ApiEndpoint], new: Mapping[str, ApiEndpoint]) -> None:
        """A reload replaced the endpoints (``old`` by ``new``): a removed quota's calls
        still queued are made through its last endpoint, as its quota stays for them
        (``Scheduler.set_quotas``); forgotten once the quota is gone."""
        self._retired.update((name, e) for name, e in old.items() if name not in new)
        self._retired = {
            name: e
            for name, e in self._retired.items()
            if name not in new and name in self.s.core.quotas
        }

    def _session(self, api: str) -> aiohttp.ClientSession:
        session = self._http.get(api)
        if session is None:
            # Connections up to MAX_CONNECTIONS: more than a quota's concurrency lets run
            # (which the scheduler holds it to), a bound for one of a rate alone whose API
            # hangs. No cookie jar: it would hand one tenant's cookies to every other's.
            connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS)
            session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar()
            )
            self._http[api] = session
        return session

    async def close(self) -> None:
        sessions, self._http = list(self._http.values()), {}
        for session in sessions:
            await session.close()


def _answer(resp: aiohttp.ClientResponse, raw: bytes, endpoint: ApiEndpoint) -> dict[str, Any]:
    """The answer as the caller gets it: ``status``; ``headers`` (names in lower case, a
    repeated header's values joined by ", "); ``body``: the JSON decoded, else the text,
    else (not UTF-8) None with the bytes in ``body_base64``. An API that echoes the
    request (its headers) does not return the credential."""
    raw = _scrub_bytes(raw, endpoint)
    headers: dict[str, str] = {}
    for raw_name, raw_value in resp.headers.items():
        name = raw_name.lower()
        if name not in _NOT_PASSED:
            value = _scrub(raw_value, endpoint)
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
    out: dict[str, Any] = {"status": resp.status, "headers": headers}
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return out | {"body": None, "body_base64": base64.b64encode(raw).decode()}
    try:
        out["body"] = json.loads(text) if text else None
    except ValueError:
        out["body"] = text
    return out


def _maybe_made(method: str) -> str:
    """What a caller must know of a call cut off after it was sent: nothing for a method
    whose repeat has the effect of one."""
    return "" if method in IDEMPOTENT_METHODS else f"; the {method} may have been made"


def _unresolved(api: str, why: str) -> str:
    return f"quota {api!r} cannot be called until its credential can be read: {why}"


@functools.lru_cache(maxsize=256)
def _spellings(credential: str) -> tuple[str, ...]:
    r"""How an answer may spell the credential, longest first: as it is, JSON-escaped
    (``\/``, ``\u002b`` and the like) and URL-encoded. Worked out once per credential,
    not per header of every answer."""
    escaped = json.dumps(credential, ensure_ascii=False)[1:-1]
    return tuple(sorted({credential, escaped, escaped.replace("/", "\\/"),
                         json.dumps(credential)[1:-1],  # (non-ASCII as \uXXXX)
                         *("".join(f"\\u{ord(c):{case}}" if not c.isalnum() else c
                                   for c in credential) for case in ("04x", "04X")),
                         urllib.parse.quote(credential, safe="")},
                        key=len, reverse=True))  # fmt: skip


def _scrub(text: str, endpoint: ApiEndpoint | None) -> str:
    """Text without the credential, whatever the library or the API put in it."""
    if endpoint is not None and endpoint.credential:
        for spelling in _spellings(endpoint.credential):
            text = text.replace(spelling, "***")
    return text


def _scrub_bytes(raw: bytes, endpoint: ApiEndpoint) -> bytes:
    if endpoint.credential:
        for spelling in _spellings(endpoint.credential):
            raw = raw.replace(spelling.encode(), b"***")
    return raw
