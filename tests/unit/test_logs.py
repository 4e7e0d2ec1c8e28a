"""Structured logs carry the record's ids as fields."""

from __future__ import annotations

import json
import logging

from tangram.service.logs import JsonFormatter


def test_json_lines_carry_extra_fields() -> None:
    record = logging.LogRecord(
        "tangram.service", logging.INFO, "f.py", 1, "action ended", None, None
    )
    record.action = "a-1"
    record.trajectory = "t-9"
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "action ended" and line["level"] == "info"
    assert line["action"] == "a-1" and line["trajectory"] == "t-9"
    assert line["ts"].endswith("Z")
