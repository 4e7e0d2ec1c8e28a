"""Structured logs: one JSON object a line, with the ids a record carries (action,
trajectory, node...), for log pipelines; plain text stays the default for terminals."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


# Loggers whose INFO records show at the default level (WARNING): what an SRE follows
# without -v, a few lines a start, a reload or a node: the CLI's own start, reload and
# stop (``tangram.cli``), nodes joining and leaving the scheduler, its reloads, an agent's
# link to it. -v adds the other INFO records, one or more an action.
LIFECYCLE = ("tangram.cli", "tangram.service.nodes", "tangram.service.reload", "tangram.agent.link")


def as_json() -> bool:
    """Whether :func:`setup` made the lines JSON: what the CLI says then goes out as log
    records, not as text among them."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def utc_time(record: logging.LogRecord) -> str:
    """The record's time in UTC, to the millisecond, with its zone (Z): text and JSON
    lines alike, so that the two (and hosts in other zones) line up."""
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def _rounded(value: object) -> object:
    """A float field to the microsecond: ``open_s=0.0019999999999527063`` reads as noise."""
    return round(value, 6) if isinstance(value, float) else value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": utc_time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields of plain data only: a library's objects (kopf attaches its whole settings,
        # executor and all, to every record) would print as their repr on every line.
        out.update(
            {k: _rounded(v) for k, v in vars(record).items() if k not in _STANDARD and _plain(v)}
        )
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _plain(value: object, depth: int = 0) -> bool:
    """Whether ``value`` is JSON's own data (a few levels deep)."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if depth > 3:
        return False
    if isinstance(value, list | tuple):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


# The ids a text line shows after its message, in this order, as ``key=value``: the
# fields the service's own records carry (a library's, kopf's, are left to the JSON form).
TEXT_FIELDS = (
    "action", "trajectory", "tenant", "env", "node", "kind", "status", "act_s", "error",
    "reason", "actions", "open_s", "warm", "ran_s", "detail",
)  # fmt: skip


class TextFormatter(logging.Formatter):
    """A line for a terminal, with the record's ids after its message: ``-v`` printed
    "action ended" and no more, its ids only in ``--log-json``'s fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return utc_time(record)  # (local time without its zone could not be compared)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [
            f"{k}={_value(_rounded(v))}"
            for k in TEXT_FIELDS
            if (v := getattr(record, k, None)) is not None
        ]
        if not ids:
            return line
        head, sep, tail = line.partition("\n")  # (after the message, before a traceback)
        return f"{head} {' '.join(ids)}{sep}{tail}"


def _value(v: object) -> str:
    """A field's value on a text line: quoted when it holds a space (an error's message),
    which would read as the start of the next field."""
    text = str(v)
    return json.dumps(text) if any(c.isspace() for c in text) or not text else text


def setup(verbose: bool, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    for name in LIFECYCLE:
        logging.getLogger(name).setLevel(logging.INFO)
