"""Structured logs carry the record's ids as fields."""

from __future__ import annotations

import json
import logging

from tangram.service.logs import JsonFormatter, TextFormatter


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


def test_a_librarys_objects_on_a_record_stay_out_of_the_line() -> None:
    """kopf puts its whole settings object on every record: each line was 2 KB of its
    repr (an executor's address and all); its reference to the object is kept."""

    class Settings:
        def __repr__(self) -> str:
            return "OperatorSettings(executor=<ThreadPoolExecutor at 0x7f>)"

    record = logging.LogRecord("kopf.objects", logging.INFO, "f.py", 1, "handled", None, None)
    record.settings = Settings()
    record.k8s_ref = {"kind": "ActionPool", "name": "coding", "namespace": "rl"}
    line = json.loads(JsonFormatter().format(record))
    assert "settings" not in line and line["k8s_ref"]["name"] == "coding"


def test_text_lines_carry_the_ids_after_the_message() -> None:
    """``-v`` printed "action ended" and nothing to tell one action from another."""
    record = logging.LogRecord(
        "tangram.service", logging.INFO, "f.py", 1, "action ended", None, None
    )
    record.action, record.trajectory, record.node, record.status = "a-1", "t-9", None, "ok"
    line = TextFormatter().format(record)
    assert line.endswith(" INFO tangram.service action ended action=a-1 trajectory=t-9 status=ok")
    plain = logging.LogRecord("tangram.service", logging.INFO, "f.py", 1, "ready", None, None)
    assert TextFormatter().format(plain).endswith(" ready")


def test_text_and_json_lines_say_the_same_utc_time() -> None:
    """Text lines were in local time without a zone, JSON ones in UTC: two hosts' lines,
    or one host's two forms, could not be put in order."""
    record = logging.LogRecord("tangram.service", logging.INFO, "f.py", 1, "ready", None, None)
    record.created, record.msecs = 0.25, 250.0
    assert TextFormatter().format(record).startswith("1970-01-01T00:00:00.250Z INFO ")
    assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-01T00:00:00.250Z"


def test_durations_in_fields_are_rounded_to_the_microsecond() -> None:
    record = logging.LogRecord("tangram.service", logging.INFO, "f.py", 1, "opened", None, None)
    record.open_s = 0.0019999999999527063
    assert TextFormatter().format(record).endswith(" opened open_s=0.002")
    assert json.loads(JsonFormatter().format(record))["open_s"] == 0.002


def test_a_text_lines_error_is_named_and_its_message_quoted() -> None:
    """An action that ended in error said status=error and no more: the code and a short
    message follow, the message quoted (its spaces would read as further fields)."""
    record = logging.LogRecord(
        "tangram.service", logging.INFO, "f.py", 1, "action ended", None, None
    )
    record.action, record.status, record.error = "a-1", "error", "node_lost"
    record.detail = "node vm left the pool"
    line = TextFormatter().format(record)
    assert line.endswith(' action=a-1 status=error error=node_lost detail="node vm left the pool"')
