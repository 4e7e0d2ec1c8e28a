"""The asyncio client."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import aiohttp

from tangram.api.wire import ActionResult, BatchResponse, TrajectoryInfo
from tangram.client.common import (
    RETRY_STATUS,
    Call,
    Reply,
    ServiceUnreachableError,
    TangramError,
    backoff,
    check,
    data,
    exec_body,
    keyed,
    open_body,
    result,
    retry_after,
    settings,
    stream_error,
    trajectory_info,
)
from tangram.client.files import AsyncFiles
from tangram.client.stream import ExecStream, LiveAction, NoStreamError

# 0.1 s doubling to 10 s: about 23 s of retries, what a scheduler pod's restart takes.
RETRIES = 8
STREAM_RETRY_S = 30.0  # after a refused stream handshake, HTTP alone for this long


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
    ) -> None:
        """``stream``: execs go over one WebSocket (``/v1/stream``) rather than a request
        each, which under load costs the client and the scheduler about half as much
        (docs/benchmarks.md); a service without it is asked over HTTP. ``timeout_s``
        bounds each request, a streamed exec's wait for its answer included."""
        self.url, tok = settings(url, token)
        self._headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made on the loop that uses it
        self.retries, self.backoff_s = retries, backoff_s
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
        self.stream = False  # what is still retrying goes over HTTP, on no new stream
        if self._stream is not None:
            await self._stream.aclose()
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                self.url,
                headers=self._headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0),  # one connection per waiting action
            )
        return self._session

    async def _call(self, call: Call) -> Reply:
        session = self._http()
        for attempt in range(self.retries + 1):
            reply: Reply | None = None
            try:
                async with session.request(
                    call.method,
                    call.path,
                    json=call.body,
                    data=call.content,
                    params=call.params,
                    headers=call.headers,
                ) as response:
                    reply = Reply(response.status, await response.read(), response.headers)
                if reply.status not in RETRY_STATUS or attempt == self.retries:
                    return check(reply)
            except aiohttp.ClientConnectionError as e:
                if attempt == self.retries:
                    raise ServiceUnreachableError(self.url, e) from e
            await asyncio.sleep(retry_after(reply, attempt, self.backoff_s))
        raise AssertionError("unreachable")

    # ---- trajectories --------------------------------------------------------------
    async def open(
        self,
        env: str,
        *,
        id: str | None = None,
        labels: Mapping[str, str] | None = None,
        expected_steps: int | None = None,
    ) -> TrajectoryInfo:
        body = open_body(env, id, labels, expected_steps)
        if not self._open_keys:
            body.pop("idempotency_key")
        try:
            return trajectory_info(await self._call(Call("POST", "/v1/trajectories", body)))
        except TangramError as e:
            # A scheduler of a release before opens took a key refuses the field: opened
            # unkeyed from now on (a retry after a lost answer may then open twice).
            if e.field != "idempotency_key" or e.status != 400 or "idempotency_key" not in body:
                raise
            self._open_keys = False
            del body["idempotency_key"]
            return trajectory_info(await self._call(Call("POST", "/v1/trajectories", body)))

    async def get(self, trajectory: str) -> TrajectoryInfo:
        return trajectory_info(await self._call(Call("GET", f"/v1/trajectories/{trajectory}")))

    async def close(self, trajectory: str) -> TrajectoryInfo:
        return trajectory_info(await self._call(Call("DELETE", f"/v1/trajectories/{trajectory}")))

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
        """Run a command; see ``tangram.client.common.exec_body`` for the options."""
        body = exec_body(argv, **kw)
        if self.stream:
            streamed = await self._stream_exec(trajectory, body)
            if streamed is not None:
                return streamed
        return result(await self._call(Call("POST", f"/v1/trajectories/{trajectory}/exec", body)))

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
        needs the action stream, and is not retried: a dropped stream fails it."""
        body = exec_body(argv, **kw)
        stream = await self._open_stream() if self.stream else None
        if stream is None:
            raise TangramError(
                0, "no_stream", "a live exec needs the action stream (/v1/stream)", []
            )
        return stream.live(trajectory, body, interactive=interactive)

    async def _stream_exec(self, trajectory: str, body: dict[str, Any]) -> ActionResult | None:
        """The exec's result over the stream; None when the service refuses the stream
        (HTTP then answers, canonically: a bad token's 401, an earlier release's route)."""
        for attempt in range(self.retries + 1):
            answer = None
            try:
                stream = await self._open_stream()
                if stream is None:
                    return None
                try:
                    answer = await asyncio.wait_for(
                        stream.exec(trajectory, body), self._timeout.total
                    )
                except NoStreamError:  # too large for a frame: HTTP says 413 or runs it
                    return None
                if answer.status == 200 and answer.result is not None:
                    return answer.result
                if answer.status not in RETRY_STATUS or attempt == self.retries:
                    raise stream_error(answer)
            except aiohttp.ClientConnectionError as e:  # the stream dropped: again, same key
                if attempt == self.retries:
                    raise ServiceUnreachableError(self.url, e) from e
            given = answer.retry_after if answer is not None else None
            await asyncio.sleep(backoff(given, attempt, self.backoff_s))
        raise AssertionError("unreachable")

    async def _open_stream(self) -> ExecStream | None:
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
        body = {"actions": [keyed(item) for item in items]}
        reply = await self._call(Call("POST", "/v1/batch", body))
        return BatchResponse.model_validate_json(reply.body).results

    async def cancel(self, action: str) -> bool:
        """Cancel by action id, or by idempotency key as ``key:<key>``."""
        return bool(data(await self._call(Call("DELETE", f"/v1/actions/{action}")))["cancelled"])

    async def cancel_all(self, trajectory: str) -> int:
        """Cancel every queued and running action of a trajectory (it stays open)."""
        reply = await self._call(Call("POST", f"/v1/trajectories/{trajectory}/cancel"))
        return int(data(reply)["cancelled"])

    async def lease(self, api: str, units: int = 1, hold_s: float = 300.0) -> ActionResult:
        # Keyed like every submission: a retry after a lost answer takes no second lease.
        body = {"units": units, "hold_s": hold_s, "idempotency_key": uuid.uuid4().hex}
        return result(await self._call(Call("POST", f"/v1/apis/{api}/lease", body)))

    async def call(
        self,
        api: str,
        path: str = "/",
        *,
        method: str = "GET",
        query: dict[str, str] | None = None,
        body: Any = None,
        timeout_s: float = 60.0,
    ) -> ActionResult:
        """Have the service make the request, with the quota's credential, when the quota
        admits it; ``result.output`` is ``{"status", "body"}``."""
        req: dict[str, Any] = {"method": method, "path": path, "timeout_s": timeout_s}
        if query:
            req["query"] = query
        if body is not None:
            req["body"] = body
        req["idempotency_key"] = uuid.uuid4().hex
        return result(await self._call(Call("POST", f"/v1/apis/{api}/call", req)))

    async def release(self, lease: str) -> ActionResult:
        return result(await self._call(Call("DELETE", f"/v1/leases/{lease}")))

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
        return result(await self._call(Call("POST", f"/v1/services/{service}/call", req)))


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
        if self.info is not None:
            await self.client.close(self.info.id)

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
