"""The agent's side of the link to the scheduler: one WebSocket, reconnected when lost.

Register with a hello, answer each request on its own task (replies carry the request's
``rid``), send a heartbeat every second, and ping: the heartbeats tell the scheduler that
the agent lives, the pongs tell the agent that the scheduler does (a silent one is
reconnected to). One writer sends what a loop tick queued, in one
frame when the scheduler took the packing subprotocol (``AGENT_SUBPROTOCOL``). When the
connection drops, every request in flight is cancelled — a command nobody waits for holds
cores nobody accounts for — and the agent reconnects with backoff; its environments stay,
and the hello of the next connection lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import Callable

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.uri import parse_uri

from tangram.api.wire import (
    AGENT_BACKOFF_MAX_S,
    AGENT_LEAVING,
    AGENT_SUBPROTOCOL,
    AgentInput,
    AgentReply,
    AgentRequest,
    pack,
    parse_agent_request,
    unpack,
)
from tangram.node_agent.agent import NodeAgent

log = logging.getLogger("tangram.agent")
# The link's connects and failures: shown at the default level (the CLI's logs.LIFECYCLE
# names it), so that a log that says the scheduler was unreachable also says when it was
# reached again.
link_log = logging.getLogger("tangram.agent.link")
HEARTBEAT_S = 1.0
# A scheduler whose host died or that a partition cut off sends nothing, not even a close:
# without an answer to a ping in PING_TIMEOUT_S the agent drops the link and reconnects.
# Every WebSocket server answers pings (uvicorn's too, whatever its release).
# A busy scheduler answers late, and a reconnect cancels everything the agent runs: the
# deadline is three times the scheduler's default heartbeat_timeout_s the other way.
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 15.0
CLOSE_TIMEOUT_S = 2.0  # the closing handshake, which a silent scheduler never answers
GONE_CHECK_S = 2.0  # how often environments that ended by themselves are looked for
# A link that lasted this long resets the backoff; one the scheduler closed sooner (it
# refused the node) does not, or a refused agent would knock ten times a second.
STABLE_S = 10.0
# A handshake the scheduler refused (401, 403, 404): a configuration error no retry soon
# mends, but an operator may (a Secret fixed, the scheduler's tokens reloaded), so the
# agent goes on knocking, this much more slowly than for a scheduler not there yet.
REFUSED_BACKOFF_S = 30.0
# What each refusal means for an agent's configuration, said beside the scheduler's word.
_REFUSED_WHY = {
    401: "wrong token: the --token-file's system:agent token is not one the scheduler knows "
    "(the pool's agent token Secret)",
    403: "wrong role: the token is not the agents' (a system:agent line of the token file)",
    404: "wrong path: the scheduler serves agents at ws://HOST:PORT/v1/agents",
}


class SchedulerUrlError(ValueError):
    """A scheduler URL no retry can reach: the agent ends, saying why."""


def check_url(url: str, given: str | None = None) -> None:
    """Raise :class:`SchedulerUrlError` unless ``url`` is a WebSocket URL. ``given``: what
    the user wrote, which ``url`` was made from (a scheme or a path added), named in the
    error instead: a path the user never wrote reads as theirs."""
    try:
        parse_uri(url)
    except InvalidURI as e:
        raise SchedulerUrlError(_invalid(url, e, given)) from None


def _invalid(url: str, e: InvalidURI, given: str | None = None) -> str:
    why = e.msg if url == e.uri else f"it leads to {e.uri}: {e.msg}"
    return not_a_url(given if given is not None else url, why)


def not_a_url(url: str, why: str) -> str:
    return (
        f"{url} is not a scheduler URL ({why}): give ws://HOST:PORT/v1/agents "
        "(wss:// with TLS; an IPv6 address in brackets)"
    )


async def serve(
    agent: NodeAgent,
    url: str,
    token: str,
    stop: asyncio.Event,
    *,
    grace_s: float | None = None,
    hurry: asyncio.Event | None = None,
) -> None:
    """Serve the scheduler at ``url`` (ws://host:port/v1/agents) until ``stop`` is set.
    A URL that no retry can reach (not ws:// or wss://, no host) ends it at once with
    :class:`SchedulerUrlError`; every other failure is retried with backoff. With
    ``grace_s`` (``tangram agent``), a stop is a leaving: the scheduler is told
    (``AGENT_LEAVING``), what runs gets up to ``grace_s`` (or until ``hurry``) and its
    results go out on the link, before it closes (``NodeAgent.wind_down``)."""
    check_url(url)
    backoff = 0.1
    down = Outage()
    while not stop.is_set():
        connected: float | None = None  # when this try's connection was made
        failure: BaseException | None = None
        refusal: str | None = None  # why the scheduler refused the handshake
        logged = False  # the failure was logged above debug already (a bug's traceback)
        try:
            connection = await _connect(url, token, stop)
            if connection is None:  # stopped while connecting
                break
            async with connection as ws:
                connected = time.monotonic()
                gc.collect()
                gc.freeze()  # start-up objects are forever: keep collections short
                await ws.send(agent.hello().model_dump_json())
                level, said = down.ended()
                link_log.log(level, "connected to %s as %s%s", url, agent.node, said,
                             extra={"url": url, "node": agent.node})  # fmt: skip
                await _session(agent, ws, stop, grace_s, hurry)
        except InvalidURI as e:  # (a redirect to one): a permanent error, not retried
            raise SchedulerUrlError(_invalid(url, e)) from None
        except InvalidStatus as e:
            if stop.is_set():
                break
            refusal = refused(e)
            if refusal is None:  # (a proxy's 502, a scheduler starting): as any failure
                failure = e
        except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError) as e:
            if stop.is_set():
                break
            failure = e
        except Exception as e:  # a bug in one session must not end the agent: reconnect
            failure, logged = e, True
            log.exception("scheduler link failed")
        lasted = None if connected is None else time.monotonic() - connected
        wait, backoff = next_wait(backoff, lasted)
        if lasted is not None and lasted >= STABLE_S:
            down.settled()
        if refusal is not None:  # (logged as an error: an operator has to act)
            wait = REFUSED_BACKOFF_S
            link_log.error(
                "the scheduler refused this agent: %s (%s); retrying in %.0fs%s", refusal, url,
                wait, down.failed(said=True), extra={"url": url, "node": agent.node},
            )  # fmt: skip
        elif failure is not None:
            count = down.failed(said=logged)
            link_log.log(
                logging.WARNING if down.loud() else logging.DEBUG,
                "scheduler link to %s: %s; retrying in %.1fs%s", url, failure, wait,
                count, extra={"url": url, "node": agent.node},
            )  # fmt: skip
        if not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)


async def _connect(url: str, token: str, stop: asyncio.Event) -> websockets.ClientConnection | None:
    """A connection to the scheduler, or None if ``stop`` is set first: a stop signal
    does not wait for a connect that may take its ``open_timeout`` to fail, out of the
    pod's termination grace."""
    connecting = asyncio.ensure_future(
        websockets.connect(
            url,
            additional_headers={"Authorization": f"Bearer {token}"},
            max_size=64 << 20,
            ping_interval=None,  # ``keepalive`` pings: its deadline covers the send too
            close_timeout=CLOSE_TIMEOUT_S,
            compression=None,  # small JSON messages: deflate costs more than it saves
            open_timeout=10,
            subprotocols=[websockets.Subprotocol(AGENT_SUBPROTOCOL)],
        )
    )
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not connecting.done():
            connecting.cancel()  # (its socket closes as the task ends; its end retrieved)
            connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
    if not connecting.done():
        return None
    return connecting.result()  # (connected as the stop came: its session leaves at once)


class Outage:
    """The failed attempts since the link last connected (the first connect too), said
    with each failure and with the connect that ends them; and which failures are worth a
    warning: the first ``LOUD_FIRST``, then one a ``LOUD_EVERY_S`` (a scheduler down for
    an hour is not 700 warnings; the rest are logged at debug, and the count says them).
    A link that connects and soon fails again (a node refused after its hello, a scheduler
    crash-looping) goes on with the same quota: only a session that lasted (``settled``)
    starts it again.

    A connect is said at info when it is the first, or when it ends failures one of which
    was said (a warning, a refusal's error): a log that says the scheduler could not be
    reached also says when it was reached again, and a link that lasted then failed warns
    (its quota started again), so the reconnect after that outage is always said. Any
    other connect (a flapping link's, its failures at debug) is at debug too: the connect
    of each connect-fail cycle follows its failure's quota, not one info line a cycle."""

    LOUD_FIRST = 3
    LOUD_EVERY_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.failures = 0
        self.since = 0.0  # (clock) the first failure's
        self.said = -math.inf  # (clock) when a failure was last worth a warning
        self.warned = 0  # failures worth a warning since the link last settled
        self.connected = False  # ever: a first connect is not "again"
        self.owed = False  # a failure since the last connect was said: so is the connect
        self.quiet = 0  # connects said at debug since one was said at info

    def failed(self, *, said: bool = False) -> str:
        """Count a failure; ``said``: it is logged above debug whatever the quota (a
        refusal, an error), so the connect that ends it will be too."""
        if not self.failures:
            self.since = self.clock()
        self.failures += 1
        self.owed = self.owed or said
        return "" if self.failures == 1 else f" ({self._count()} so far)"

    def loud(self) -> bool:
        """Whether the failure just counted is worth a warning (the others: debug)."""
        now = self.clock()
        if self.warned < self.LOUD_FIRST or now - self.said >= self.LOUD_EVERY_S:
            self.said, self.warned = now, self.warned + 1
            self.owed = True
            return True
        return False

    def settled(self) -> None:
        """The link served long enough: the next outage warns from its first again."""
        self.said, self.warned = -math.inf, 0

    def ended(self) -> tuple[int, str]:
        """The level the connect just made is logged at (see the class), and '' when
        nothing failed, else how long and how many tries it took (and how many connects
        were said only at debug since the last said above it); reset."""
        again = " again" if self.connected else ""
        said = f"{again} after {self._count()}" if self.failures else ""
        loud = not self.connected or self.owed
        if loud and self.quiet:
            n = self.quiet
            said += f" ({n} connect{'s' if n != 1 else ''} logged at debug since the last said)"
        self.quiet = 0 if loud else self.quiet + 1
        self.failures, self.connected, self.owed = 0, True, False
        return (logging.INFO if loud else logging.DEBUG), said

    def _count(self) -> str:
        n, lasted = self.failures, self.clock() - self.since
        return f"{n} failed attempt{'s' if n != 1 else ''} over {lasted:.0f} s"


async def run(
    agent: NodeAgent,
    url: str,
    token: str,
    stop: asyncio.Event,
    *,
    grace_s: float,
    hurry: asyncio.Event | None = None,
) -> None:
    """``tangram agent``: serve until ``stop``, then leave as :func:`serve` says, finish
    the wind-down the link could not wait for (it was down), and shut the agent down."""
    await serve(agent, url, token, stop, grace_s=grace_s, hurry=hurry)
    await agent.wind_down(grace_s, hurry)
    await agent.shutdown()  # (the CLI says "agent NODE stopped", as a record with --log-json)


def next_wait(backoff: float, lasted_s: float | None) -> tuple[float, float]:
    """How long to wait before connecting again, and the backoff after: a link that
    served ``STABLE_S`` or longer starts the series again; one refused sooner, or no
    connection at all (``lasted_s`` None), goes on doubling it."""
    if lasted_s is not None and lasted_s >= STABLE_S:
        backoff = 0.1
    return backoff, min(backoff * 2, AGENT_BACKOFF_MAX_S)


def refused(e: InvalidStatus) -> str | None:
    """What the scheduler said refusing the handshake, with what it means for this
    agent's configuration; None for a status that is no refusal of the agent."""
    status = e.response.status_code
    meaning = _REFUSED_WHY.get(status)
    if meaning is None:
        return None
    try:
        said = json.loads(e.response.body or b"")["error"]["message"]
    except (ValueError, TypeError, KeyError):  # (an older scheduler's bare 403)
        said = e.response.reason_phrase or "no reason given"
        if status == 403:
            meaning = "wrong token, role or path: a scheduler of an earlier release says no more"
    return f"HTTP {status}: {said} (a configuration error: {meaning})"


async def _session(
    agent: NodeAgent,
    ws: websockets.ClientConnection,
    stop: asyncio.Event,
    grace_s: float | None = None,
    hurry: asyncio.Event | None = None,
) -> None:
    packed = ws.subprotocol == AGENT_SUBPROTOCOL  # the scheduler reads packed frames
    tasks: set[asyncio.Task[None]] = set()
    outbox: list[str] = []
    sending: list[str] = []  # the batch being written
    orphans: list[tuple[str, AgentReply]] = []  # unasked results this link took
    queued = asyncio.Event()

    def post(text: str) -> None:
        outbox.append(text)
        queued.set()

    async def write_forever() -> None:
        """One writer, so replies finished in the same tick leave in one frame."""
        nonlocal sending
        while True:
            await queued.wait()
            queued.clear()
            sending = outbox[:]
            outbox.clear()
            for frame in pack(sending) if packed else sending:
                await ws.send(frame)
            if orphans:  # those sent need no giving back
                sent = set(sending)
                orphans[:] = [o for o in orphans if o[0] not in sent]
            sending = []

    async def answer(req: AgentRequest) -> None:
        post((await agent.handle(req)).model_dump_json())

    async def heartbeat() -> None:
        while True:
            post('{"heartbeat":true}')
            await asyncio.sleep(HEARTBEAT_S)

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            try:
                # The deadline covers sending the ping as well: with a full send buffer
                # (a partition while a big reply went out) the send itself never ends.
                async with asyncio.timeout(PING_TIMEOUT_S):
                    await (await ws.ping())
            except TimeoutError:
                ws.transport.abort()  # a close would wait on the silent peer (or its buffer)
                raise ConnectionError(
                    f"the scheduler answered no ping in {PING_TIMEOUT_S:g}s"
                ) from None

    async def watch_environments() -> None:
        while True:
            await asyncio.sleep(GONE_CHECK_S)
            try:
                await agent.report_gone()
            except Exception:  # a failed look (the API server down) is tried again
                log.exception("looking for ended environments failed")

    def unreadable(text: str, e: ValueError) -> None:
        """A request this agent cannot read is refused (its requester gets why), not the
        end of the link: every request in flight would be cancelled with it."""
        try:
            rid = json.loads(text).get("rid")
        except (ValueError, AttributeError):
            rid = None
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.warning("a request from the scheduler this agent cannot read: %s", why)
        if isinstance(rid, int) and not isinstance(rid, bool) and rid > 0:
            error = f"the agent cannot read the request (its release may predate it): {why}"
            post(AgentReply(rid=rid, ok=False, error=error).model_dump_json())

    def orphan(reply: AgentReply) -> None:  # a run that finished after its link dropped
        text = reply.model_dump_json()
        orphans.append((text, reply))
        post(text)

    async def read_forever() -> None:
        while True:
            for text in unpack(await ws.recv(decode=True)):
                try:
                    req = parse_agent_request(text)
                except ValueError as e:  # (a newer scheduler's request, say)
                    unreadable(text, e)
                    continue
                if isinstance(req, AgentInput):  # in order, now: a stream's data
                    agent.input(req)
                    continue
                agent.received(req)
                task = asyncio.create_task(answer(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    async def leave(grace_s: float) -> set[asyncio.Task[None]]:
        """A stop with the link up: say so to the scheduler, wind the agent down while the
        link carries the results of what ends within the grace, send them, close the link
        as going away (1001). What the stop killed goes unanswered: the scheduler ends it
        (``outcome_unknown``) as the link closes; what came after it began is answered
        ``not_taken`` (``NodeAgent.handle``). Returns the
        parts that ended meanwhile (the link failed: the caller then finishes the
        wind-down without it)."""
        post(AGENT_LEAVING)
        winding = asyncio.create_task(agent.wind_down(grace_s, hurry))
        done, _ = await asyncio.wait({*parts, winding}, return_when=asyncio.FIRST_COMPLETED)
        if winding not in done:
            winding.cancel()  # (the wind-down goes on: the caller's wind_down waits for it)
            return {p for p in parts if p in done}
        winding.result()
        if tasks:  # the replies of what ended in the grace, still being made (the rest,
            # killed or not taken, end at once, unanswered)
            await asyncio.wait(set(tasks), timeout=CLOSE_TIMEOUT_S)
        for _ in range(int(CLOSE_TIMEOUT_S / 0.01)):  # until the writer has sent them
            if not (outbox or sending) or any(p.done() for p in parts):
                break
            await asyncio.sleep(0.01)
        with contextlib.suppress(Exception):
            await ws.close(1001, "the node agent is stopping")
        log.info("left the scheduler: the agent stops")
        return set()

    parts = [
        asyncio.create_task(keepalive()),  # first: its error says why the reader's ended
        asyncio.create_task(read_forever()),
        asyncio.create_task(write_forever()),
        asyncio.create_task(heartbeat()),
        asyncio.create_task(watch_environments()),
    ]
    stopping = asyncio.create_task(stop.wait())
    agent.attach(orphan, post)
    try:
        done, _ = await asyncio.wait({*parts, stopping}, return_when=asyncio.FIRST_COMPLETED)
        ended: set[asyncio.Task[None]] = {p for p in parts if p in done}
        if grace_s is not None and stopping in done and not ended:
            ended = await leave(grace_s)
        for part in parts:
            if part in ended:
                part.result()  # re-raises why the link ended (ConnectionClosed: reconnect)
    finally:
        agent.detach()
        stopping.cancel()
        for task in (*parts, *tasks):
            task.cancel()
        await asyncio.gather(*parts, *tasks, return_exceptions=True)
        # Unasked results this link took but did not get out go to the next link: nobody
        # would ask for them again (a scheduler that adopted the run waits for this one).
        unsent = {*sending, *outbox}
        for text, reply in orphans:
            if text in unsent:
                agent.keep_unsent(reply)
