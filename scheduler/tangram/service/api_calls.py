"""API quotas: leases the caller uses itself, and calls the service makes for it.

A lease is granted when the round admits it and held until released or its hold limit
passes. A proxied call carries the quota's credential, which never goes back to the
caller, nor into logs or errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Coroutine
from typing import Any

import aiohttp

from tangram.api.action import ActionSpec
from tangram.api.wire import ActionStatus, ApiCallRequest, ApiLeaseRequest
from tangram.service.config import ApiEndpoint
from tangram.service.outcomes import Outcomes
from tangram.service.records import ActionRecord, EngineError, err
from tangram.service.state import PoolState

log = logging.getLogger("tangram.service")

# A proxied call's answer is held whole (decoded, kept for its idempotency key, sent
# back): one larger than this is an error, not the scheduler's memory.
MAX_RESPONSE_BYTES = 16 << 20


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
    def __init__(
        self, state: PoolState, outcomes: Outcomes, http: aiohttp.ClientSession | None = None
    ) -> None:
        """``http``: the session outbound calls use; without one, the first call makes
        one that :meth:`close` closes."""
        self.s = state
        self.outcomes = outcomes
        self._http = http
        self._own_http = http is None

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
        units = req.units if isinstance(req, ApiLeaseRequest) else 1
        # ``quotas`` are units beyond the one an api action holds anyway.
        return ActionSpec(kind="api", api=api, quotas={api: units - 1} if units > 1 else {})

    def start(self, rec: ActionRecord) -> Coroutine[Any, Any, None] | None:
        """The round granted the quota: the call to make, or None: the lease is granted."""
        if rec.expiry is not None:
            rec.expiry.cancel()
        if isinstance(rec.request, ApiCallRequest):
            return self._proxy(rec, rec.request)
        assert isinstance(rec.request, ApiLeaseRequest)
        lease = f"l-{secrets.token_hex(8)}"
        self.s.leases[lease] = rec.id
        rec.lease = lease
        rec.expiry = asyncio.get_running_loop().call_later(
            rec.request.hold_s, self.outcomes.end_lease, rec
        )
        if not rec.done.done():
            rec.done.set_result(self.outcomes.result(rec, ActionStatus.OK, lease=lease))
        return None

    async def _proxy(self, rec: ActionRecord, req: ApiCallRequest) -> None:
        """Make the call with the quota's credential; the answer goes back, the credential
        never does (nor into logs or errors)."""
        s = self.s
        assert rec.assignment is not None
        api = rec.assignment.quotas[0][0] if rec.assignment.quotas else ""
        endpoint = s.config.endpoints.get(api)
        t0 = s.clock()
        status, output, error = ActionStatus.ERROR, None, None
        try:
            if endpoint is None:
                raise EngineError("invalid", "api", f"quota {api!r} lost its endpoint")
            # The credential's header is the service's alone, whatever its capitalisation.
            headers = {k: v for k, v in req.headers.items() if k.lower() != endpoint.header.lower()}
            if endpoint.credential is not None:
                headers[endpoint.header] = f"Bearer {endpoint.credential}"
            async with self._session().request(
                req.method,
                endpoint.url.rstrip("/") + req.path,
                params=req.query,
                json=req.body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=req.timeout_s),
                allow_redirects=False,  # a redirect would carry the credential elsewhere
            ) as resp:
                raw = await _body(resp, api)
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                output = {"status": resp.status, "body": body}
                status = ActionStatus.OK
        except asyncio.CancelledError:
            status = ActionStatus.CANCELLED
        except TimeoutError:
            status = ActionStatus.TIMEOUT
        except (aiohttp.ClientError, EngineError) as e:
            error = err("api_failed", _scrub(str(e), endpoint), retryable=True)
        except _TooLargeError as e:  # the same request would get the same answer
            error = err("api_failed", str(e))
        except Exception as e:  # anything else must still end the call and free its unit
            error = err("api_failed", _scrub(f"{type(e).__name__}: {e}", endpoint))
        self.outcomes.end(rec, status, error=error, exec_s=s.clock() - t0, output=output)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()


def _unresolved(api: str, why: str) -> str:
    return f"quota {api!r} cannot be called until its credential can be read: {why}"


def _scrub(text: str, endpoint: ApiEndpoint | None) -> str:
    """An error message without the credential, whatever the library put in it."""
    if endpoint is not None and endpoint.credential:
        text = text.replace(endpoint.credential, "***")
    return text
