"""The asyncio client."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import socket
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from types import SimpleNamespace, TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import aiohttp

from tangram.api.resent import RESENT_HEADER, resent_header
from tangram.api.wire import (
    ActionResult,
    ActionStatus,
    BatchResponse,
    TrajectoryInfo,
    TrajectoryState,
)
from tangram.client.common import (
    BATCH_KINDS,
    OUT_OF_FILES,
    RETRY_STATUS,
    ActionTimeoutError,
    Call,
    CallTimeoutError,
    ClientClosedError,
    Reply,
    ServiceUnreachableError,
    StreamClosedError,
    TangramError,
    TooManyOpenFilesError,
    backoff,
    check,
    data,
    default_max_connections,
    encode_json,
    exec_body,
    keyed,
    missing,
    named_keys,
    no_token_found,
    open_body,
    refusal,
    result,
    retry_after,
    settings,
    stream_error,
    trajectory_info,
    with_key,
)
from tangram.client.files import AsyncFiles
from tangram.client.stream import ExecStream, LiveAction, NoStreamError

log = logging.getLogger("tangram.client")
T = TypeVar("T")

# 0.1 s doubling to 10 s: about 23 s of retries, what a scheduler pod's restart takes.
RETRIES = 8
STREAM_RETRY_S = 30.0  # after a refused stream handshake, HTTP alone for this long
# A connect that gets no SYN-ACK (a host gone, a partition) fails after this and is retried;
# without it the kernel tries for about two minutes.
CONNECT_S = 10.0
# An HTTP exec's answer may take as long as its command: no read timeout. TCP keepalive
# instead ends a connection whose peer vanished (no FIN): idle 30 s, then 3 probes 10 s
# apart. A live host's kernel answers probes, however long the exec runs.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
CANCEL_S = 5.0  # for the best-effort cancel of an action the caller gave up on
ABANDON_AT_ONCE = 32  # cancels in flight at once for a batch given up on
_JSON = {"Content-Type": "application/json"}


def _keepalive_socket(addr: tuple[Any, ...]) -> socket.socket:
    """A socket for the connector, with TCP keepalive on (aiohttp's ``socket_factory``)."""
    family, kind, proto = addr[0], addr[1], addr[2]
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):  # (Linux; other systems keep their defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


def _connector(limit: int) -> aiohttp.TCPConnector:
    kw: dict[str, Any] = {"limit": limit}  # (0: none)
    if "socket_factory" in inspect.signature(aiohttp.TCPConnector).parameters:  # 3.12+
        kw["socket_factory"] = _keepalive_socket
    return aiohttp.TCPConnector(**kw)


async def _counted(_: Any, ctx: SimpleNamespace, __: Any) -> None:
    """Counts each time a request went out, aiohttp's own resend of a DELETE or PUT after
    a dropped connection included (see ``_exchange``)."""
    sends = ctx.trace_request_ctx
    if isinstance(sends, _Sends):
        sends.count += 1


class _Sends:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class AsyncClient:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        retries: int = RETRIES,
        backoff_s: float = 0.1,
        timeout_s: float | None = None,
        stream: bool = True,
        max_connections: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``stream``: execs go over one WebSocket (``/v1/stream``) rather than a request
        each, which under load costs the client and the scheduler about half as much
        (docs/benchmarks.md); a service without it is asked over HTTP. ``timeout_s``
        bounds each request, a streamed exec's wait for its answer included: past it, an
        action is cancelled by its idempotency key and ``ActionTimeoutError`` (a
        ``TimeoutError``) raised. Without it a request waits as long as its action runs;
        a scheduler that vanishes is noticed by the stream's pings and TCP keepalive.
        ``max_connections``: HTTP connections open at once, at most (a request past them
        waits for one; an HTTP exec holds one while it runs); by default half the
        process's soft limit on open files (RLIMIT_NOFILE), from 16 to 4096; 0 for no
        bound. The cancels of actions given up on have up to 32 more of their own.
        Retries (``retries``, waits from ``backoff_s``) are logged at INFO on the
        ``tangram.client`` logger; each wait is stretched at random by up to half, drawn
        from ``rng`` (a seeded ``random.Random`` repeats them; by default one of its
        own)."""
        self.url, tok = settings(url, token)
        self._headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        self._no_token = None if tok else no_token_found(token)  # (said with a 401)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_S)
        self.max_connections = (
            default_max_connections() if max_connections is None else max_connections
        )
        if self.max_connections < 0:
            raise ValueError(f"max_connections: 0 (no bound) or more, not {max_connections}")
        self._session: aiohttp.ClientSession | None = None  # made on the loop that uses it
        # The cancels of what was given up: their own connections, so that requests
        # holding every one of the session's (HTTP execs) cannot hold them up.
        self._cancel_session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # that loop
        self._closing = False  # aclose has begun: no call starts any more
        self._closed = False  # and has closed the connections
        # The tasks inside a call (how deep: a call made by a call), which aclose ends.
        self._calls: dict[asyncio.Task[Any], int] = {}
        self._ended: set[asyncio.Task[Any]] = set()  # those aclose cancelled
        self._drained: asyncio.Future[None] | None = None  # aclose's: no call left
        self._shut: asyncio.Future[None] | None = None  # aclose's: and all is closed
        self.retries, self.backoff_s = retries, backoff_s
        self._rng = rng if rng is not None else random.Random()
        self._open_keys = True  # False against a scheduler that takes no key on opens
        self.stream = stream
        self._stream: ExecStream | None = None
        self._stream_lock = asyncio.Lock()
        self._stream_refused_until = 0.0  # a refused handshake is not asked again before

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections. Every call still under way (an exec, a file's read or
        write, an open, anything) raises ``ClientClosedError``; first it is cancelled as
        a task of it would be, so its action is cancelled by key, and a trajectory an
        open may have opened is closed, as far as the service can be asked (they would
        go on with nobody to read their results). Calls after it raise it too. A second
        aclose while one is under way returns once that one is done (its calls wound
        down, the connections closed), even when that one is cut short."""
        if self._closing:
            if self._shut is not None and not self._shut.done():
                await asyncio.shield(self._shut)
            return
        self._closing = True
        self._shut = shut = asyncio.get_running_loop().create_future()
        self.stream = False  # what is still retrying goes over HTTP, on no new stream
        calls = [task for task in self._calls if task is not asyncio.current_task()]
        for task in calls:
            if not task.cancelling():  # (one cancelled already ends by itself)
                self._ended.add(task)
                task.cancel()
        try:
            if calls:
                self._drained = asyncio.get_running_loop().create_future()
                try:  # (each call's cancels are bounded by CANCEL_S)
                    async with asyncio.timeout(2 * CANCEL_S):
                        await asyncio.shield(self._drained)
                except TimeoutError:
                    log.warning("closing the client: %d calls still under way", len(self._calls))
        finally:  # (cut short, it closes them still: another aclose waits for that)
            self._closed = True
            # Shielded: cancelled again, it does not leave the closing half done either.
            closing = asyncio.ensure_future(self._close_connections())
            closing.add_done_callback(lambda _: shut.set_result(None))
            await asyncio.shield(closing)

    async def _close_connections(self) -> None:
        """Close the stream and both sessions: each of them, even when closing one before
        it fails (an error is raised once the rest are closed: the last, the earlier ones
        chained to it as its context)."""
        async with contextlib.AsyncExitStack() as closing:  # (called last to first)
            if self._cancel_session is not None:
                closing.push_async_callback(self._cancel_session.close)
            if self._session is not None:
                closing.push_async_callback(self._session.close)
            if self._stream is not None:
                closing.push_async_callback(self._stream.aclose)

    def _tracking(self) -> _Tracked:
        """``with self._tracking():`` around each call, so that ``aclose`` can end it."""
        if self._closing and not self._calls.get(asyncio.current_task()):  # type: ignore[arg-type]
            raise ClientClosedError("this client was closed: make a new one")
        return _Tracked(self)

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ClientClosedError("this client was closed: make a new one")
        if self._session is not None and self._loop is not asyncio.get_running_loop():
            # (its connections and stream belong to a loop that has ended: "Event loop is
            # closed" came from deep inside aiohttp, after a request may have gone out)
            raise RuntimeError(
                "this AsyncClient was made for another event loop (an earlier asyncio.run): "
                "make one per loop, or use Client, which runs its own"
            )
        if self._session is None:
            sends = aiohttp.TraceConfig()
            sends.on_request_headers_sent.append(_counted)
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                self.url,
                headers=self._headers,
                timeout=self._timeout,
                connector=_connector(self.max_connections),
                trace_configs=[sends],
            )
        return self._session

    def _cancels(self) -> aiohttp.ClientSession:
        """The session of the cancels (``_abandon``, ``_close_opened``)."""
        self._http()  # (closed, or of another loop: said as for any call)
        if self._cancel_session is None:
            self._cancel_session = aiohttp.ClientSession(
                self.url,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=CANCEL_S, sock_connect=CONNECT_S),
                connector=_connector(ABANDON_AT_ONCE),
            )
        return self._cancel_session

    async def _call(self, call: Call) -> Reply:
        return check((await self._exchange(call))[0])

    async def _exchange(self, call: Call) -> tuple[Reply, bool]:
        """The last answer, unchecked, and whether an earlier try may have reached the
        service and had its answer lost (then a 404 may answer a retry of what that try
        did: a file removed, a lease released)."""
        with self._tracking():
            return await self._exchanged(call)

    async def _exchanged(self, call: Call) -> tuple[Reply, bool]:
        session = self._http()
        sends = _Sends()
        lost_at: float | None = None  # when the first try that may have got through went out
        turned_away = 0  # tries answered with a 429 or 503 to try again (they took nothing)
        # Encoded once, before anything is sent (a text it cannot carry is refused here).
        data = call.content if call.body is None else encode_json(call.body)
        base = call.headers if call.body is None else {**(call.headers or {}), **_JSON}
        for attempt in range(self.retries + 1):
            reply: Reply | None = None
            before, went = sends.count, time.monotonic()
            headers = base
            if lost_at is not None:  # (a restarted scheduler may not know what that try did)
                age = resent_header(time.monotonic() - lost_at)
                headers = {**(headers or {}), RESENT_HEADER: age}
            try:
                async with session.request(
                    call.method,
                    call.path,
                    data=data,
                    params=call.params,
                    headers=headers,
                    trace_request_ctx=sends,
                ) as response:
                    reply = Reply(response.status, await response.read(), response.headers)
                # (more than one send in a try: aiohttp sent a DELETE or PUT again itself)
                if lost_at is None and sends.count - before > 1:
                    lost_at = went
                if reply.status == 401 and self._no_token is not None:
                    raise _sent_no_token(reply, self._no_token)
                if reply.status not in RETRY_STATUS or attempt == self.retries:
                    return reply, lost_at is not None
                refused = refusal(reply)
                if not refused.retryable:  # (waiting will not clear it)
                    return reply, lost_at is not None
                why: Exception = refused
                if refused.code != "http":  # the service's own: it took nothing
                    turned_away += 1
                elif lost_at is None:  # a proxy's (a gateway's reset upstream, say), which
                    lost_at = went  # may have passed the request on before it failed
            # An answer cut off in the middle (ClientPayloadError) is one lost as well: the
            # request is sent again, as after a connection dropped before its answer.
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                self._out_of_files(e)
                if lost_at is None and sends.count > before:  # sent, and no answer came
                    lost_at = went
                if attempt == self.retries:
                    raise ServiceUnreachableError(
                        self.url,
                        e,
                        cut_off=isinstance(e, aiohttp.ClientPayloadError),
                        maybe_sent=lost_at is not None,
                        tries=attempt + 1,
                        refused=turned_away,
                    ) from e
                why = e
            except TimeoutError as e:  # (aiohttp's for the whole request: timeout_s)
                if self._timeout.total is None:
                    raise
                raise CallTimeoutError(call.name, self._timeout.total) from e
            wait = retry_after(reply, attempt, self.backoff_s, self._rng)
            self._retrying(call.name, attempt, why, wait)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def _retrying(self, what: str, attempt: int, why: Exception, wait: float) -> None:
        log.info(
            "%s: try %d of %d failed (%s): trying again in %.2f s",
            what, attempt + 1, self.retries + 1, why, wait,
            extra={"attempt": attempt + 1, "retries": self.retries, "wait_s": wait},
        )  # fmt: skip

    def _out_of_files(self, e: Exception) -> None:
        """A connection this process had no file descriptor for: said at once, as what it
        is (no retry would find one, and the service is not to blame)."""
        code = getattr(e, "errno", None)
        if code in OUT_OF_FILES:
            raise TooManyOpenFilesError(self.url, code, self.max_connections) from e

    async def _keyed(self, keys: Sequence[str], work: Coroutine[Any, Any, T]) -> T:
        """``work``'s answer. When the caller gives up on it (its task cancelled, or the
        client's ``timeout_s`` passed) the action would go on with nobody to find it: it
        is cancelled by its idempotency keys, as far as the service can be asked."""
        try:
            tracked = self._tracking()
        except ClientClosedError:
            work.close()  # (never to be awaited)
            raise
        with tracked:
            try:
                return await work
            except asyncio.CancelledError:
                if not self._closed:  # (aclose's cancel comes before it closes)
                    await self._abandon(keys)
                raise
            except TimeoutError as e:
                total = self._timeout.total
                if total is None or isinstance(e, aiohttp.ClientError):  # not the client's own
                    raise
                raise ActionTimeoutError(keys, total, await self._abandon(keys)) from e
            except ServiceUnreachableError as e:
                if e.idempotency_keys:
                    raise
                # It may have been submitted before the service went (or was certainly not,
                # as its tries say): said, with its keys.
                raise e.replaced(keys=keys) from e.__cause__

    async def _submit(self, call: Call) -> ActionResult:
        """The result of one keyed submission (its key in its body), naming its key."""
        assert call.body is not None
        key = call.body["idempotency_key"]
        return with_key(result(await self._keyed([key], self._call(call))), key)

    async def _abandon(self, keys: Sequence[str]) -> int | None:
        """Cancel the actions of ``keys``, once each, briefly (the caller is leaving): how
        many were cancelled, None when the service could not be asked."""
        room = asyncio.Semaphore(ABANDON_AT_ONCE)  # a batch's keys at once, not one by one

        async def one(key: str) -> bool:
            async with room:
                reply = check(await _delete(session, _item_path("actions", f"key:{key}")))
            return bool(data(reply).get("cancelled"))

        try:  # (from the session on: a client closed meanwhile must not hide the caller's
            session = self._cancels()  # error with its own, as in _close_opened)
            async with asyncio.timeout(CANCEL_S):
                return sum(await asyncio.gather(*(one(key) for key in keys)))
        except Exception as e:  # (a closed session, the service away, ...): best effort
            said = named_keys(keys)
            log.warning("could not cancel what was given up, by idempotency key %s: %s", said, e)
            return None

    # ---- trajectories --------------------------------------------------------------
    async def open(
        self,
        env: str,
        *,
        id: str | None = None,
        labels: Mapping[str, str] | None = None,
        expected_steps: int | None = None,
        env_vars: Mapping[str, str] | None = None,
    ) -> TrajectoryInfo:
        """Open a trajectory of TrajectoryEnv ``env``; ``env_vars`` go to each of its
        commands (a command's own ``env`` overrides them). Given up (its task cancelled,
        the client's ``timeout_s`` passed, the client closed), or every answer lost (a
        ``ServiceUnreachableError`` whose tries may have reached the service), the open
        may still have reached the service: the trajectory it opened, or is opening, is
        closed by the open's idempotency key, as far as the service can be asked; past
        ``timeout_s`` the ``CallTimeoutError`` says what became of it, and a note on the
        ``ServiceUnreachableError`` does."""
        body = open_body(env, id, labels, expected_steps, env_vars)
        call = Call("POST", "/v1/trajectories", body, what=f"open({env!r})")
        with self._tracking():
            try:
                return await self._open(call)
            except (asyncio.CancelledError, CallTimeoutError) as e:
                then = await self._close_opened(body.get("idempotency_key"))
                if isinstance(e, CallTimeoutError):
                    raise CallTimeoutError(call.name, e.timeout_s, f": {then}") from e
                log.info("%s given up: %s", call.name, then)
                raise
            except ServiceUnreachableError as e:
                if e.maybe_sent:  # (a try reached the service, and its answer was lost)
                    then = await self._close_opened(body.get("idempotency_key"))
                    log.info("%s unanswered: %s", call.name, then)
                    e.add_note(f"{call.name} may have reached the service: {then}")
                raise

    async def _open(self, call: Call) -> TrajectoryInfo:
        body = call.body
        assert body is not None
        if not self._open_keys:
            body.pop("idempotency_key")
        try:
            return trajectory_info(await self._call(call))
        except TangramError as e:
            # A scheduler of a release before opens took a key refuses the field: opened
            # unkeyed from now on (a retry after a lost answer may then open twice).
            if e.field != "idempotency_key" or e.status != 400 or "idempotency_key" not in body:
                raise
            self._open_keys = False
            del body["idempotency_key"]
            return trajectory_info(await self._call(call))

    async def _close_opened(self, key: str | None) -> str:
        """Close what the open of ``key`` opened or is opening (it was given up on),
        briefly (the caller is leaving): what became of it, in words."""
        if key is None:  # (opened unkeyed: a scheduler that takes no key on opens)
            return "what it may have opened is closed after its idle timeout (no key)"
        try:
            session = self._cancels()
            async with asyncio.timeout(CANCEL_S):
                reply = await _delete(session, _item_path("trajectories", f"key:{key}"))
            if missing(reply, "idempotency_key"):
                later = "an open of it that comes later is refused"
                return f"it had opened nothing (idempotency key {key!r}; {later})"
            info = trajectory_info(check(reply))
        except Exception as e:  # (the service away, one without the route, ...): best effort
            log.warning("could not close what the open of key %r opened: %s", key, e)
            return (
                f"closing what it may have opened (idempotency key {key!r}) failed ({e}): "
                "that is closed after its TrajectoryEnv's idleTimeoutSeconds"
            )
        if info.state is TrajectoryState.CLOSING:
            return f"trajectory {info.id}, which it was opening, is closed once made"
        return f"trajectory {info.id}, which it opened, was closed"

    async def get(self, trajectory: str) -> TrajectoryInfo:
        call = Call("GET", f"/v1/trajectories/{trajectory}", what=f"get({trajectory!r})")
        return trajectory_info(await self._call(call))

    async def close(self, trajectory: str) -> TrajectoryInfo:
        call = Call("DELETE", f"/v1/trajectories/{trajectory}", what=f"close({trajectory!r})")
        return trajectory_info(await self._call(call))

    def trajectory(self, env: str, **kw: Any) -> AsyncTrajectory:
        """``async with client.trajectory(env) as t``: opened on entry, closed on exit."""
        return AsyncTrajectory(self, env, kw)

    def files(self, trajectory: str) -> AsyncFiles:
        """The files of a trajectory's environment (``t.files`` of an open ``t``)."""
        return AsyncFiles(self, trajectory)

    # ---- actions -----------------------------------------------------------------------
    async def exec(
        self, trajectory: str, argv: Sequence[str] | None = None, **kw: Any
    ) -> ActionResult:
        """Run a command; see ``tangram.client.common.exec_body`` for the options.

        Its result names the idempotency key it ran under (``result.idempotency_key``: the
        one given, else a fresh one). A result ``outcome_unknown`` (its node was lost after
        the command was sent there: it may have run, and may still run) is not to be
        submitted again as a new command: under that key, a retry is never run twice and
        answers the run's outcome once its node is back. ``node_lost`` with
        ``error.retryable`` means it never ran: a retry runs it. A
        ``ServiceUnreachableError`` raised once it may have been submitted names the key
        too (``idempotency_keys``)."""
        body = exec_body(argv, **kw)
        key = body["idempotency_key"]
        return with_key(await self._keyed([key], self._exec(trajectory, body)), key)

    async def _exec(self, trajectory: str, body: dict[str, Any]) -> ActionResult:
        streamed = _Streamed()
        if self.stream:
            answer = await self._stream_exec(trajectory, body, streamed)
            if answer is not None:
                return answer
        call = Call("POST", f"/v1/trajectories/{trajectory}/exec", body)
        try:
            return result(await self._call(call))
        except ServiceUnreachableError as e:
            if e.maybe_sent or not streamed.maybe_sent:
                raise
            # The stream may have carried it before the service refused the stream.
            raise e.replaced(maybe_sent=True) from e.__cause__

    async def exec_live(
        self,
        trajectory: str,
        argv: Sequence[str] | None = None,
        *,
        interactive: bool = False,
        **kw: Any,
    ) -> LiveAction:
        """Run a command with its output streamed as it is produced
        (``async for fd, text in action.output()``), its stdin open when ``interactive``
        (``action.write``, ``action.close_stdin``), signals (``action.signal("SIGINT")``),
        and ``await action.result()`` at its end. ``pty=True`` gives it a terminal. It
        needs the action stream, and is not retried: a dropped stream fails it, and the
        service cancels it then (its output has nowhere to go), unless it was given an
        ``idempotency_key``: then it runs on, and ``exec`` under that key gets its result."""
        body = exec_body(argv, **kw)
        if kw.get("idempotency_key") is None:
            del body["idempotency_key"]  # (one of its own would only keep it running)
        stream = await self._open_stream()  # (a closed client says so here)
        if stream is None:
            raise TangramError(
                0, "no_stream", "a live exec needs the action stream (/v1/stream)", []
            )
        return stream.live(trajectory, body, interactive=interactive)

    async def _stream_exec(
        self, trajectory: str, body: dict[str, Any], streamed: _Streamed
    ) -> ActionResult | None:
        """The exec's result over the stream; None when the service refuses the stream
        (HTTP then answers, canonically: a bad token's 401, an earlier release's route).
        ``streamed`` is told when a try may have sent it, or was refused for now."""
        for attempt in range(self.retries + 1):
            answer = None
            try:
                stream = await self._open_stream()
                if stream is None:
                    return None
                streamed.maybe_sent = True  # (posted on the stream: its answer may be lost)
                try:
                    answer = await asyncio.wait_for(
                        stream.exec(trajectory, body), self._timeout.total
                    )
                except NoStreamError:  # too large for a frame: HTTP says 413 or runs it
                    streamed.maybe_sent = False  # (nor was it by a try before: the same body)
                    return None
                if answer.status == 200 and answer.result is not None:
                    return answer.result
                refused = stream_error(answer)
                if not refused.retryable or attempt == self.retries:
                    raise refused
                why: Exception = refused
                streamed.refused += 1
            # The stream dropped, or its handshake went unanswered: again, same key.
            except (aiohttp.ClientConnectionError, StreamClosedError) as e:
                self._out_of_files(e)
                if attempt == self.retries:
                    raise ServiceUnreachableError(
                        self.url,
                        e,
                        maybe_sent=streamed.maybe_sent,
                        tries=attempt + 1,
                        refused=streamed.refused,
                    ) from e
                why = e
            given = answer.retry_after if answer is not None else None
            wait = backoff(given, attempt, self.backoff_s, self._rng)
            key = body.get("idempotency_key")
            self._retrying(f"exec on trajectory {trajectory} (key {key!r})", attempt, why, wait)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _open_stream(self) -> ExecStream | None:
        with self._tracking():
            return await self._opened_stream()

    async def _opened_stream(self) -> ExecStream | None:
        stream = self._stream
        if stream is not None and not stream.closed:
            return stream
        async with self._stream_lock:  # one handshake, however many execs wait on it
            loop = asyncio.get_running_loop()
            if not self.stream or loop.time() < self._stream_refused_until:
                return None
            if self._stream is None or self._stream.closed:
                try:
                    self._stream = await ExecStream.connect(self._http(), self._headers)
                except aiohttp.ClientConnectionError as e:
                    self._out_of_files(e)
                    raise
                except NoStreamError as e:
                    if e.status in (400, 404):  # an earlier release, or a proxy in the way
                        self.stream = False
                    else:  # HTTP answers it (a bad token's 401); the stream again later
                        self._stream_refused_until = loop.time() + STREAM_RETRY_S
                    return None
            return self._stream

    async def batch(self, items: Sequence[dict[str, Any]]) -> list[ActionResult]:
        """Many actions in one request, admitted all or none, e.g.
        ``{"trajectory": t, "exec": exec_body(["make"])}``, ``{"api": "search",
        "lease": {"units": 1}}`` or ``{"service": "judge", "score": {"inputs": [...]}}``;
        results in the same order."""
        actions = [keyed(item) for item in items]
        keys = [body["idempotency_key"] for a in actions for body in _bodies(a)]
        reply = await self._keyed(keys, self._call(Call("POST", "/v1/batch", {"actions": actions})))
        results = BatchResponse.model_validate_json(reply.body).results
        return [with_key(r, k) for r, k in zip(results, keys, strict=True)]

    async def cancel(self, action: str) -> bool:
        """Cancel by action id, or by idempotency key as ``key:<key>`` (any key: it is
        quoted into the path)."""
        call = Call("DELETE", _item_path("actions", action), what=f"cancel({action!r})")
        return bool(data(await self._call(call))["cancelled"])

    async def cancel_all(self, trajectory: str) -> int:
        """Cancel every queued and running action of a trajectory (it stays open)."""
        what = f"cancel_all({trajectory!r})"
        reply = await self._call(Call("POST", f"/v1/trajectories/{trajectory}/cancel", what=what))
        return int(data(reply)["cancelled"])

    async def lease(
        self,
        api: str,
        units: int = 1,
        hold_s: float = 300.0,
        *,
        queue_timeout_s: float | None = None,
        quotas: Mapping[str, int] | None = None,
    ) -> ActionResult:
        """``units`` of the quota for up to ``hold_s`` (give them back with ``release``);
        ``queue_timeout_s``: give up if not granted by then (status ``rejected``);
        ``quotas``: units of other quotas held with it, all granted together (a step that
        calls two rate-limited APIs)."""
        # Keyed like every submission: a retry after a lost answer takes no second lease.
        body: dict[str, Any] = {"units": units, "hold_s": hold_s}
        if queue_timeout_s is not None:
            body["queue_timeout_s"] = queue_timeout_s
        if quotas:
            body["quotas"] = dict(quotas)
        body["idempotency_key"] = uuid.uuid4().hex
        return await self._submit(Call("POST", f"/v1/apis/{api}/lease", body))

    async def call(
        self,
        api: str,
        path: str = "/",
        *,
        method: str = "GET",
        query: dict[str, str] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        queue_timeout_s: float | None = None,
        quotas: Mapping[str, int] | None = None,
    ) -> ActionResult:
        """Have the service make the request, with the quota's credential, when the quota
        admits it; ``result.output`` is ``{"status", "headers", "body"}``.
        ``queue_timeout_s``: give up if the quota has not admitted it by then (status
        ``rejected``); ``quotas``: units of other quotas held while it runs."""
        req: dict[str, Any] = {"method": method, "path": path, "timeout_s": timeout_s}
        if quotas:
            req["quotas"] = dict(quotas)
        if query:
            req["query"] = query
        if body is not None:
            req["body"] = body
        if headers:
            req["headers"] = headers
        if queue_timeout_s is not None:
            req["queue_timeout_s"] = queue_timeout_s
        req["idempotency_key"] = uuid.uuid4().hex
        return await self._submit(Call("POST", f"/v1/apis/{api}/call", req))

    async def release(self, lease: str) -> ActionResult:
        """Give a lease's units back. Sent again after a lost answer, it may find the lease
        already released by the first try: that is an ``ok`` result naming the lease, with
        neither id nor timings (they were in the lost answer)."""
        call = Call("DELETE", f"/v1/leases/{lease}", what=f"release({lease!r})")
        reply, resent = await self._exchange(call)
        if resent and missing(reply, "lease"):
            return ActionResult(id="", kind="api", status=ActionStatus.OK, lease=lease)
        return result(check(reply))

    async def score(
        self,
        service: str,
        inputs: Sequence[Any],
        *,
        input_size: int | None = None,
        gpu: int | dict[str, Any] | None = None,
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> ActionResult:
        """One call of a RewardService: ``inputs`` scored together on the GPUs the
        scheduler gives the call; ``result.output`` holds one output per input.
        ``input_size`` (e.g. tokens) picks the RewardService's profile for that size;
        ``gpu`` narrows the DoP (``2`` or ``{"choices": [1, 2]}``). Retried safely: the
        request carries an idempotency key (a fresh one unless given), and a call running
        when the scheduler restarts answers its retries once it ends."""
        key = idempotency_key or uuid.uuid4().hex
        req: dict[str, Any] = {"inputs": list(inputs), "idempotency_key": key}
        optional = {
            "input_size": input_size,
            "gpu": gpu,
            "timeout_s": timeout_s,
            "queue_timeout_s": queue_timeout_s,
        }
        req.update({k: v for k, v in optional.items() if v is not None})
        return await self._submit(Call("POST", f"/v1/services/{service}/call", req))


class AsyncTrajectory:
    def __init__(self, client: AsyncClient, env: str, open_kw: dict[str, Any]) -> None:
        self.client, self.env, self._open_kw = client, env, open_kw
        self.info: TrajectoryInfo | None = None

    @property
    def id(self) -> str:
        if self.info is None:
            raise TangramError(0, "not_open", "the trajectory is not open", [])
        return self.info.id

    async def __aenter__(self) -> Self:
        self.info = await self.client.open(self.env, **self._open_kw)
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.info is None:
            return
        try:
            await self.client.close(self.info.id)
        except Exception as e:
            if exc is None:
                raise
            # The body's error is the one to see; the failed close is noted on it.
            log.warning("closing trajectory %s failed: %s", self.info.id, e)
            exc.add_note(f"then closing trajectory {self.info.id} failed: {e!r}")

    async def exec(self, argv: Sequence[str] | None = None, **kw: Any) -> ActionResult:
        return await self.client.exec(self.id, argv, **kw)

    async def exec_live(
        self, argv: Sequence[str] | None = None, *, interactive: bool = False, **kw: Any
    ) -> LiveAction:
        """A command with its output streamed as it is produced (``AsyncClient.exec_live``)."""
        return await self.client.exec_live(self.id, argv, interactive=interactive, **kw)

    @property
    def files(self) -> AsyncFiles:
        """The environment's files: ``await t.files.write("/work/a.py", "print(1)")``."""
        return self.client.files(self.id)

    async def bash(self, code: str, name: str = "main", **kw: Any) -> ActionResult:
        """Run ``code`` in the trajectory's persistent bash session."""
        return await self.client.exec(
            self.id, session={"kind": "bash", "name": name}, code=code, **kw
        )

    async def python(self, code: str, name: str = "main", **kw: Any) -> ActionResult:
        """Run ``code`` in the trajectory's persistent Python session."""
        return await self.client.exec(
            self.id, session={"kind": "python", "name": name}, code=code, **kw
        )


class _Streamed:
    """What the tries of an exec on the stream did (``AsyncClient._stream_exec``)."""

    __slots__ = ("maybe_sent", "refused")

    def __init__(self) -> None:
        self.maybe_sent = False  # a try may have reached the service, its answer lost
        self.refused = 0  # tries answered with a 429 or 503 to try again


class _Tracked:
    """A call under way (``AsyncClient._tracking``): its task is known to ``aclose``,
    which cancels it, and the call then raises ``ClientClosedError``."""

    __slots__ = ("client", "depth", "task")

    def __init__(self, client: AsyncClient) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.client, self.task = client, task
        self.depth = client._calls.get(task, 0)

    def __enter__(self) -> None:
        self.client._calls[self.task] = self.depth + 1

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        client, task = self.client, self.task
        if self.depth:  # a call within a call: the outer one says how it ended
            client._calls[task] = self.depth
            return
        del client._calls[task]
        ended = task in client._ended
        client._ended.discard(task)
        if not client._calls and client._drained is not None and not client._drained.done():
            client._drained.set_result(None)
        if ended:
            task.uncancel()  # (aclose's cancel: this error stands for it)
        if exc is None or isinstance(exc, ClientClosedError):
            return
        if ended or (client._closed and isinstance(exc, Exception)):
            # Ended by aclose, or under it (a connection closed under a call left when
            # aclose stopped waiting: aiohttp's "Session is closed").
            raise ClientClosedError("the client was closed while this call waited") from exc


def _sent_no_token(reply: Reply, why: str) -> TangramError:
    """The service's 401, saying that no token was found to send, and where."""
    e = refusal(reply)
    return TangramError(e.status, e.code, f"{e.message}: {why}", e.details)


def _item_path(collection: str, name: str) -> str:
    """``/v1/<collection>/<name>``, the name quoted whole: a key (``key:<key>``) may hold
    '/', '?', '#' or '%'."""
    return f"/v1/{collection}/" + quote(name, safe=":")


async def _delete(session: aiohttp.ClientSession, path: str) -> Reply:
    """The answer to one ``DELETE`` of ``path``, unchecked and not retried: a cancel of
    what the caller gave up on (``_abandon``, ``_close_opened``), on the cancels' session."""
    async with session.delete(path) as response:
        return Reply(response.status, await response.read(), {})


def _bodies(item: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The action bodies of a batch item (one)."""
    return [b for kind in BATCH_KINDS if isinstance(b := item.get(kind), Mapping)]
