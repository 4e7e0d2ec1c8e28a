"""What ``up``, ``serve`` and ``agent`` say as they start, reload and stop: text for a
person (stderr, as written), or with ``--log-json`` a log record like every other line,
so that a log pipeline reading the operator's pods parses every line."""

from __future__ import annotations

import logging
from typing import Any

from rich.text import Text

from tangram.cli.progress import note
from tangram.service.logs import as_json

log = logging.getLogger("tangram.cli")  # shown at the default level (logs.LIFECYCLE)


def say(text: str | Text, *, level: int = logging.INFO, msg: str | None = None,
        **fields: Any) -> None:  # fmt: skip
    """``text`` for a person; with --log-json a record of ``msg`` (default: the text's
    first line, the rest being in ``fields``) and ``fields``."""
    if not as_json():
        note(text)
        return
    plain = text.plain if isinstance(text, Text) else text
    log.log(level, msg if msg is not None else plain.partition("\n")[0], extra=fields)


def warn(text: str, **fields: Any) -> None:
    """A warning: ``warning: text`` for a person, a WARNING record of ``text``."""
    say(Text.assemble(("warning", "bold yellow"), ": ", text), level=logging.WARNING,
        msg=text, **fields)  # fmt: skip
