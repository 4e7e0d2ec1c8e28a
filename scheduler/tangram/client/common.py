"""What the sync and async clients share: building requests, reading answers, retrying."""

from __future__ import annotations

import errno
import json
import os
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tangram.api.tokens import token_lines
from tangram.api.wire import ActionResult, StreamAnswer, TrajectoryInfo

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TOKEN_FILE = Path.home() / ".config" / "tangram" / "tokens"
RETRY_STATUS = (429, 503)
# What a 429 names as full (its details' field) when waiting does not make room: the
# tenant's maxTrajectories, which only a close of one of its own trajectories clears
# ("close one first"). The service's other 429s — a queue full (``queue``), no node
# with the memory (``env``), a tenant's maxStreams (``stream``) — clear as others' work
# ends, and are retried.
LASTING_REFUSALS = ("trajectory",)
SYSTEM = "system:"  # the tenants of the service's own parts (auth.py), not of clients


class TangramError(Exception):
    """An error answer of the service; ``field`` names the offending input when known."""

    def __init__(self, status: int, code: str, message: str, details: list[dict[str, str]]) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.field = details[0]["field"] if details else None

    @property
    def retryable(self) -> bool:
        """Whether trying again later may succeed (the client has already retried it)."""
        return retried(self.status, self.field)


class ServiceUnreachableError(ConnectionError):
    """No answer from the service at all, after every retry: nothing listens at its URL,
    or the connection keeps dropping, before the answer or in the middle of it
    (``cut_off``: a download cut off each time). The message says where, in one line.

    Raised for a submission (an exec, a lease, a call, a score, a batch), the action may
    have reached the service before its answer was lost, and may have run, or still run
    (``maybe_sent``): ``idempotency_keys`` names its key (the caller's or the one the
    client made; empty for other requests), and the message says so. Submitted again
    under that key once the service is back (``exec(..., idempotency_key=key)``), it is
    never run a second time: the answer is its result, or the service's word that it
    never got it (then it runs, once). ``cancel(f"key:{key}")`` cancels it instead. When
    no try may have reached it (each of the ``tries`` failed to connect, or was refused
    for now with a 429 or 503: ``refused``), ``maybe_sent`` is false and the message says
    that it was not submitted."""

    def __init__(
        self,
        url: str,
        cause: Exception,
        keys: Sequence[str] = (),
        *,
        cut_off: bool = False,
        maybe_sent: bool = True,
        tries: int = 0,
        refused: int = 0,
    ) -> None:
        if cut_off:
            said = (
                f"the ARL-Tangram service at {url} answered, and every answer was cut off: "
                f"{cause} (the connection dropped in the middle of each)"
            )
        else:
            said = (
                f"cannot reach the ARL-Tangram service at {url}: {cause} (is it running? "
                "`make run` or `tangram up` starts one; TANGRAM_URL or url= names another)"
            )
        if keys and not maybe_sent:
            said += "; " + _not_submitted(keys, tries, refused)
        elif len(keys) == 1:
            said += (
                f"; the action with idempotency key {keys[0]!r} may have been submitted and "
                "may have run (or still run): submit it again under that key for its result "
                f"(it never runs twice), or cancel it with cancel('key:{keys[0]}')"
            )
        elif keys:
            said += (
                f"; the actions with idempotency keys {named_keys(keys)} may have been submitted "
                "and may have run (or still run): submit them again under those keys for "
                "their results (none runs twice), or cancel them by key"
            )
        super().__init__(said)
        self.url = url
        self.cause = cause
        self.idempotency_keys = list(keys)
        self.cut_off = cut_off
        self.maybe_sent = maybe_sent
        self.tries = tries
        self.refused = refused

    def replaced(
        self, *, keys: Sequence[str] | None = None, maybe_sent: bool | None = None
    ) -> ServiceUnreachableError:
        """This error naming ``keys``, or saying ``maybe_sent``, instead."""
        return ServiceUnreachableError(
            self.url,
            self.cause,
            self.idempotency_keys if keys is None else keys,
            cut_off=self.cut_off,
            maybe_sent=self.maybe_sent if maybe_sent is None else maybe_sent,
            tries=self.tries,
            refused=self.refused,
        )


def _not_submitted(keys: Sequence[str], tries: int, refused: int) -> str:
    """Said of the actions of ``keys`` when none of the ``tries`` may have reached the
    service (``refused`` of them it answered with a 429 or 503)."""
    if refused:
        how = (
            f"none of the {tries} tries was taken by the service ({refused} refused with a "
            "429 or 503, the rest sent nothing)"
        )
    else:
        how = f"none of the {tries} tries reached the service"
    if len(keys) == 1:
        return f"{how}: the action with idempotency key {keys[0]!r} was not submitted"
    return f"{how}: the actions with idempotency keys {named_keys(keys)} were not submitted"


def named_keys(keys: Sequence[str]) -> str:
    """Up to three keys, quoted, and how many more."""
    named = ", ".join(repr(k) for k in keys[:3])
    if len(keys) > 3:
        named += f" and {len(keys) - 3} more"
    return named


class StreamClosedError(ConnectionError):
    """The action stream (``/v1/stream``) ended before an answer came: its connection
    dropped (the scheduler restarted or went silent, the network). An exec is retried
    under its key on a new stream and never raises it; a live exec is not retried, and
    its ``output()`` and ``result()`` raise it: without an ``idempotency_key`` the
    service cancelled it (its output had nowhere to go); with one it runs on, and
    ``exec`` under that key gets its result. A ``ConnectionError``, as
    ``ServiceUnreachableError`` is."""


class TooManyOpenFilesError(OSError):
    """This process ran out of file descriptors (EMFILE, or the system's: ENFILE) making a
    connection to the service: a limit of this machine, not the service being away, so it
    is raised at once, not retried. Its message names the limit on open files and the
    client's ``max_connections``."""

    def __init__(self, url: str, code: int, max_connections: int) -> None:
        limit = _open_files()
        whose = "this process's" if code == errno.EMFILE else "the system's"
        bound = "none" if not max_connections else f"{max_connections}"
        super().__init__(
            code,
            f"{whose} file descriptors ran out connecting to the ARL-Tangram service at "
            f"{url}: this process may have {limit} files open at once (its soft "
            f"RLIMIT_NOFILE, `ulimit -n`), and this client up to {bound} connections "
            "(max_connections). Raise the limit (`ulimit -n`, resource.setrlimit) or lower "
            "max_connections (each client in the process has its own)",
        )


def open_files_limit() -> int | None:
    """The soft limit on this process's open files, None when there is none (or no way
    to ask: not Unix)."""
    soft = _open_files()
    return soft if isinstance(soft, int) else None


def _open_files() -> int | str:
    """The soft limit on this process's open files, else ``"unlimited"`` (RLIM_INFINITY)
    or ``"unknown"`` (no way to ask: not Unix), as ``TooManyOpenFilesError`` says it."""
    try:
        import resource
    except ImportError:
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return soft if soft >= 0 else "unknown"


# A client's connections at once, by default: half the process's limit on open files, so
# the rest is left for the worker's own (and its other clients), within these bounds.
MIN_CONNECTIONS, MAX_CONNECTIONS = 16, 4096


def default_max_connections() -> int:
    """``max_connections`` unless given: half the soft RLIMIT_NOFILE, from 16 to 4096."""
    soft = open_files_limit()
    if soft is None:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft // 2))


OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


class ActionTimeoutError(TimeoutError):
    """The client's own ``timeout_s`` passed before the answer came. The action may still
    have been queued or running: the client asked the service to cancel it by its
    idempotency key (``cancelled``: how many it cancelled, None when asking failed). A
    ``TimeoutError``, which is what a client timeout raised before."""

    def __init__(self, keys: Sequence[str], timeout_s: float, cancelled: int | None) -> None:
        if len(keys) == 1:
            what = f"the action with idempotency key {keys[0]!r}"
            if cancelled is None:
                then = f"cancelling it failed; cancel it with cancel('key:{keys[0]}')"
            else:
                then = "cancelled it" if cancelled else "it was no longer queued or running"
        else:  # (a batch's: as ServiceUnreachableError names them)
            what = f"the actions with idempotency keys {named_keys(keys)}"
            if cancelled is None:
                then = "cancelling them failed; cancel them by key"
            elif cancelled:
                then = f"cancelled {cancelled} of the {len(keys)}"
            else:
                then = "none was still queued or running"
        super().__init__(
            f"no answer within the client's timeout_s={timeout_s:g} s to {what}: {then}"
        )
        self.idempotency_keys = list(keys)
        self.timeout_s = timeout_s
        self.cancelled = cancelled


class CallTimeoutError(TimeoutError):
    """The client's own ``timeout_s`` passed before the answer to a call that is not an
    action (an open, a get, a close, a cancel, a release, a file's read or write): it
    names the call (``call``) and the timeout (``timeout_s``). ``timeout_s`` bounds each
    request the client sends, a file's whole upload or download included. A
    ``TimeoutError``, which is what such a timeout raised before."""

    def __init__(self, call: str, timeout_s: float, then: str = "") -> None:
        said = f"no answer within the client's timeout_s={timeout_s:g} s to {call}"
        if call.startswith("files."):
            said += (
                ": timeout_s bounds each request, a file's whole transfer included (a "
                "client with a larger timeout_s, or none, for large files)"
            )
        super().__init__(said + then)
        self.call = call
        self.timeout_s = timeout_s


class ClientClosedError(RuntimeError):
    """The client was closed (``Client.shutdown``, ``AsyncClient.aclose``) before or while
    the call waited, or this process is a fork of the one that made a ``Client``: its
    event-loop thread did not come along."""


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP answer, whatever library carried it."""

    status: int
    body: bytes
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    body: dict[str, Any] | None = None  # sent as JSON
    headers: Mapping[str, str] | None = None
    params: Mapping[str, str] | None = None  # the query
    content: bytes | None = None  # sent as it is (a file's bytes), instead of a JSON body
    what: str | None = None  # the call as errors name it ("files.write('a.py')")

    @property
    def name(self) -> str:
        return self.what or f"{self.method} {self.path}"

    def __post_init__(self) -> None:
        # A lone surrogate (``os.fsdecode`` of a name that is not UTF-8) is dropped from a
        # query without a word, naming another file: named here, before anything is sent
        # (in a JSON body, ``encode_json`` names it).
        for name, value in (self.params or {}).items():
            _utf8(value, name)


def encode_json(value: object) -> bytes:
    """``value`` as compact JSON in UTF-8. Not ASCII-escaped: a non-ASCII character as
    ``\\uXXXX`` is 6 to 12 bytes, so text well under a request's byte bound went over it."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: found again, to name where it is
        _utf8(value, "body")
        raise


def _utf8(value: object, where: str) -> None:
    """ValueError naming ``where`` when a text in ``value`` is not Unicode that UTF-8 can
    carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: {value[max(0, e.start - 20) : e.end + 20]!r} is not valid Unicode "
                f"(a lone surrogate at {e.start}: a name that is not UTF-8, as os.fsdecode "
                "gives it, cannot be sent)"
            ) from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _utf8(key, where)
            _utf8(item, f"{where}.{key}" if where != "body" else str(key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _utf8(item, f"{where}.{i}")


def settings(url: str | None, token: str | None) -> tuple[str, str | None]:
    """URL and token from the arguments, else TANGRAM_URL / TANGRAM_TOKEN, else the token
    file that embedded mode writes (its first token of a tenant not ``system:*``)."""
    url = url or os.environ.get("TANGRAM_URL") or DEFAULT_URL
    token = token or os.environ.get("TANGRAM_TOKEN") or None  # (empty: as unset)
    if token is None:
        path = Path(os.environ.get("TANGRAM_TOKEN_FILE", DEFAULT_TOKEN_FILE))
        if path.exists():
            lines = token_lines(path.read_text(encoding="utf-8"))
            # system:* tenants (the agents', the operator's) cannot submit work
            token = next(
                (f[0] for _, f in lines if len(f) == 2 and not f[1].startswith(SYSTEM)), None
            )
    return url.rstrip("/"), token


def no_token_found(token_given: str | None = None) -> str:
    """Where ``settings`` looked for a token and found none: said with the 401 that
    follows, which alone did not tell a missing token file from a wrong token."""
    variable = os.environ.get("TANGRAM_TOKEN")
    named = os.environ.get("TANGRAM_TOKEN_FILE")
    path = Path(named or DEFAULT_TOKEN_FILE)
    where = f"{path} (TANGRAM_TOKEN_FILE)" if named else f"the default token file {path}"
    if not path.exists():
        found = f"{where} does not exist"
        if not named:  # (`make run` as another user: in that user's home)
            found += " (`tangram up` writes it in the home of the user it runs as)"
    else:
        found = f"{where} has no client token (a 'TOKEN TENANT' line of a tenant not system:*)"
    unset = "empty" if variable == "" else "unset"
    given = "an empty token= was given" if token_given == "" else "no token= was given"
    return f"the client sent no token: {given}, TANGRAM_TOKEN is {unset}, and {found}"


def exec_body(
    argv: Sequence[str] | None,
    *,
    profile: str | None = None,
    args: Sequence[str] = (),
    session: dict[str, str] | None = None,
    code: str | None = None,
    cores: int | None = None,
    elastic: tuple[int, int] | None = None,
    choices: Sequence[int] | None = None,
    t1_s: float | None = None,
    amdahl: float | None = None,
    timeout_s: float | None = None,
    queue_timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    output_cap: int | None = None,
    stdin: str | bytes | None = None,
    pty: bool = False,
    idempotency_key: str | None = None,
    action_type: str | None = None,
) -> dict[str, Any]:
    """An exec's request body. ``idempotency_key``: the key it is submitted under, a fresh
    one unless given. Its result names it (``ActionResult.idempotency_key``), and so does
    a ``ServiceUnreachableError`` raised once it may have been submitted: submitted again
    under it, the command is never run a second time."""
    body: dict[str, Any] = {"idempotency_key": idempotency_key or uuid.uuid4().hex}
    if argv is not None:
        body["argv"] = _texts(argv, "argv")
    if profile is not None:
        body["profile"] = profile
    if args:
        body["args"] = _texts(args, "args")
    if session is not None:
        body["session"], body["code"] = session, code
    if sum(x is not None for x in (cores, elastic, choices)) > 1:
        raise ValueError("give at most one of cores, elastic and choices")
    if cores is not None:
        body["cpu"] = cores
    if elastic is not None:
        if len(elastic) != 2:
            raise ValueError(f"elastic: give (min, max) cores, not {elastic!r}")
        body["cpu"] = {"min": elastic[0], "max": elastic[1]}
    if choices is not None:
        body["cpu"] = {"choices": list(choices)}
    if amdahl is not None:
        body["efficiency"] = {"amdahl": amdahl}
    for name, value in (
        ("t1_s", t1_s),
        ("timeout_s", timeout_s),
        ("queue_timeout_s", queue_timeout_s),
        ("output_cap", output_cap),
        ("stdin", as_text(stdin, "stdin") if stdin is not None else None),
        ("type", action_type),
    ):
        if value is not None:
            body[name] = value
    if env:
        body["env"] = dict(env)
    if pty:
        body["pty"] = True
    return body


def as_text(data: str | bytes, name: str) -> str:
    """Text as the service takes it: bytes are taken as UTF-8; others are refused here,
    naming ``name``, not by the JSON encoder deep in a send."""
    if isinstance(data, str):
        return data
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            return bytes(data).decode()
        except UnicodeDecodeError as e:
            why = f"{name}: bytes that are not UTF-8 (at {e.start}); the service takes text"
            raise ValueError(f"{why}: put binary data in a file (files.write)") from None
    raise TypeError(f"{name}: text or bytes, not {type(data).__name__}")


def _texts(texts: Sequence[str], name: str) -> list[str]:
    """``texts`` as a list; a string is refused (``list("echo hi")`` would run ``e``)."""
    if isinstance(texts, str | bytes):
        raise TypeError(f"{name}: a list of arguments, not a string: {texts!r}")
    return list(texts)


def check(reply: Reply) -> Reply:
    """The reply, or the service's error as a ``TangramError``."""
    if reply.status >= 400:
        try:
            err = json.loads(reply.body)["error"]
            raise TangramError(reply.status, err["code"], err["message"], err.get("details", []))
        except (ValueError, KeyError, TypeError):
            text = reply.body[:500].decode(errors="replace")
            raise TangramError(reply.status, "http", text, []) from None
    return reply


def missing(reply: Reply, field: str) -> bool:
    """Whether the reply is a 404 saying ``field`` names nothing (not, say, the trajectory)."""
    return reply.status == 404 and refusal(reply).field == field


def retried(status: int, field: str | None) -> bool:
    """Whether an answer of ``status`` naming ``field`` is tried again: a 429 or a 503,
    unless waiting cannot clear it (``LASTING_REFUSALS``)."""
    if status not in RETRY_STATUS:
        return False
    return not (status == 429 and field in LASTING_REFUSALS)


def refusal(reply: Reply) -> TangramError:
    """The error an error answer carries (as ``check`` raises it)."""
    try:
        check(reply)
    except TangramError as e:
        return e
    raise ValueError(f"not an error answer: {reply.status}")


def retry_after(
    reply: Reply | None, attempt: int, base: float, rng: random.Random | None = None
) -> float:
    """How long to wait before retry ``attempt``: Retry-After when given, else backoff."""
    if reply is not None:
        given = reply.headers.get("retry-after", "")
        if given.replace(".", "", 1).isdigit():
            return backoff(float(given), attempt, base, rng)
    return backoff(None, attempt, base, rng)


JITTER = 0.5  # each wait is stretched by up to this much of itself, at random


def backoff(
    given: float | None, attempt: int, base: float, rng: random.Random | None = None
) -> float:
    """Exponential backoff from ``base`` (at most 10 s a wait), never sooner than the
    service's ``given`` wait (at most 30 s): a 503 saying "1 s" while agents reconnect
    after a scheduler's restart (up to 15 s) is still ridden out by the default retries.
    With ``rng`` (the client's), the wait is stretched by a random 0 to 50 %: clients
    refused at one moment (a scheduler's restart) do not all come back at the same ones.
    A stretch, not full jitter (a wait drawn from 0 to it): that would halve the retries'
    23 s on average, and leave a restart's 20 s not ridden out."""
    exponential = min(base * 2.0**attempt, 10.0)
    wait = exponential
    if given is not None and given >= 0:
        wait = min(max(given, exponential), 30.0)
    if rng is not None:
        wait *= 1.0 + JITTER * rng.random()
    return wait


def stream_error(answer: StreamAnswer) -> TangramError:
    """The error a streamed answer carries, as the HTTP route would have raised it."""
    err = answer.error
    if err is None:
        return TangramError(answer.status, "http", "an answer with neither result nor error", [])
    details = [d.model_dump() for d in err.details]
    return TangramError(answer.status, err.code, err.message, details)


def result(reply: Reply) -> ActionResult:
    return ActionResult.model_validate_json(reply.body)


def with_key(answer: ActionResult, key: str) -> ActionResult:
    """``answer`` naming the idempotency key ``key`` it was submitted under: a scheduler
    of an earlier release leaves ``idempotency_key`` out of its results."""
    if answer.idempotency_key is not None:
        return answer
    return answer.model_copy(update={"idempotency_key": key})


def trajectory_info(reply: Reply) -> TrajectoryInfo:
    return TrajectoryInfo.model_validate_json(reply.body)


def data(reply: Reply) -> Any:
    return json.loads(reply.body)


BATCH_KINDS = ("exec", "lease", "call", "score")


def keyed(item: Mapping[str, Any]) -> dict[str, Any]:
    """A batch item whose action carries an idempotency key (a fresh one unless given), so
    the batch's retry after a lost answer admits nothing twice."""
    out = dict(item)
    for kind in BATCH_KINDS:
        body = out.get(kind)
        if isinstance(body, Mapping) and "idempotency_key" not in body:
            out[kind] = {**body, "idempotency_key": uuid.uuid4().hex}
    return out


def open_body(
    env: str,
    id: str | None,
    labels: Mapping[str, str] | None,
    expected_steps: int | None,
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    # A retry after an answer lost on the way opens nothing more: it gets that trajectory.
    body: dict[str, Any] = {"env": env, "idempotency_key": uuid.uuid4().hex}
    if id is not None:
        body["id"] = id
    if labels:
        body["labels"] = dict(labels)
    if expected_steps is not None:
        body["expected_steps"] = expected_steps
    if env_vars:
        body["env_vars"] = dict(env_vars)
    return body
