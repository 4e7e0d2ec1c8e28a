"""Structured logs: one JSON object a line, with the ids a record carries (action,
trajectory, node...), for log pipelines; plain text stays the default for terminals."""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        # Fields of plain data only: a library's objects (kopf attaches its whole settings,
        # executor and all, to every record) would print as their repr on every line.
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and _plain(v)})
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
    "action", "trajectory", "tenant", "env", "node", "kind", "status", "act_s", "actions",
    "open_s", "warm",
)  # fmt: skip


class TextFormatter(logging.Formatter):
    """A line for a terminal, with the record's ids after its message: ``-v`` printed
    "action ended" and no more, its ids only in ``--log-json``'s fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={v}" for k in TEXT_FIELDS if (v := getattr(record, k, None)) is not None]
        if not ids:
            return line
        head, sep, tail = line.partition("\n")  # (after the message, before a traceback)
        return f"{head} {' '.join(ids)}{sep}{tail}"


def setup(verbose: bool, as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
