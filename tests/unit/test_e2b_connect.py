"""The Connect framing and envd's message shapes the E2B endpoint answers with."""

from __future__ import annotations

import json
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram.api.wire import ActionResult, ActionStatus, ErrorInfo, FileEntry
from tangram.service.e2b.connect import (
    END_STREAM,
    ConnectError,
    end_of_stream,
    envelope,
    first_message,
    timeout_s,
    uint32,
)
from tangram.service.e2b.envd import _keepalive, entry_info
from tangram.service.e2b.process import _end

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)


@given(st.dictionaries(st.text(), json_values))
def test_an_envelope_is_read_back_as_the_message(message: dict[str, object]) -> None:
    framed = envelope(message)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == len(framed) - 5
    assert first_message(framed) == message


def test_the_end_of_a_stream_carries_its_error() -> None:
    ok, failed = end_of_stream(), end_of_stream(ConnectError("not_found", "process 3"))
    assert ok[0] == END_STREAM and json.loads(ok[5:]) == {}
    assert json.loads(failed[5:]) == {"error": {"code": "not_found", "message": "process 3"}}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "no enveloped message"),
        (b"\x00\x00\x00\x00\x09{}", "cut short"),
        (b"\x01\x00\x00\x00\x02{}", "compressed"),
        (b"\x00\x00\x00\x00\x02[]", "not a JSON object"),
        (b"\x00\x00\x00\x00\x02{x", "not JSON"),
    ],
)
def test_a_bad_request_message_is_refused_saying_why(body: bytes, why: str) -> None:
    with pytest.raises(ConnectError, match=why):
        first_message(body)


@pytest.mark.parametrize(
    ("value", "read"),
    [(0, 0), (123, 123), ("123", 123), (1.0, 1), (1e2, 100), ("1e2", 100), ("12.50e1", 125),
     ("-0", 0), (2**32 - 1, 2**32 - 1), (str(2**32 - 1), 2**32 - 1)],
)  # fmt: skip
def test_a_uint32_is_a_json_number_or_a_decimal_string_as_proto_json_reads_one(
    value: object, read: int
) -> None:
    assert uint32({"pid": value}, "pid", "process.pid") == read
    assert uint32({}, "pid", "process.pid") is None


@pytest.mark.parametrize(
    "value",
    [True, False, 1.5, "1.5", -1, "-1", 2**32, str(2**32), "4294967296.0", "4294967295.5",
     "1e999999999", "1e-999999999", float("inf"), float("nan"), "Infinity", "NaN", "one", "",
     " 1", "1 ", "+1", "01", "0x1", "1_0", "\u0661", [1], {"pid": 1}],
)  # fmt: skip
def test_anything_else_is_no_uint32_and_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ConnectError, match=r"^invalid_argument: process\.pid: ") as refused:
        uint32({"pid": value}, "pid", "process.pid")
    assert refused.value.message.endswith(f"not {json.dumps(value)}")


def test_the_callers_deadline() -> None:
    assert timeout_s(None) is None and timeout_s("0") is None
    assert timeout_s("60000") == 60.0
    for bad in ("-5", "\u00b2", "\u0661\u0662"):  # superscript two and Arabic-Indic digits:
        with pytest.raises(ConnectError, match="Connect-Timeout-Ms"):  # str.isdigit() says yes
            timeout_s(bad)


def test_a_keepalive_interval_that_is_no_number_of_seconds_is_ignored() -> None:
    assert _keepalive("30") == 30 and _keepalive(" 0 ") == 1
    for ignored in (None, "", "soon", "-5", "\u00b2", "\u0661", "9" * 5000):
        assert _keepalive(ignored) is None


def test_the_end_event_says_how_the_command_ended() -> None:
    exited = ActionResult(id="a", kind="exec", status=ActionStatus.OK, exit_code=3)
    assert _end(exited) == {  # (Go's exec.ExitError says the status too)
        "exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"
    }  # fmt: skip
    timed_out = ActionResult(
        id="a", kind="exec", status=ActionStatus.TIMEOUT,
        error=ErrorInfo(code="timeout", message="killed at its 2 s timeout"),
    )  # fmt: skip
    assert _end(timed_out) == {
        "exitCode": -1, "exited": False, "status": "timeout", "error": "killed at its 2 s timeout"
    }  # fmt: skip


def test_a_command_killed_by_the_signal_it_was_sent_ends_as_gos_process_state_says() -> None:
    """From an agent whose result names no signal: 128 + the signal this endpoint sent is
    envd's -1, not exited, "signal: killed"; the same code with no such signal sent is
    an exit (such a result cannot tell)."""
    killed = ActionResult(id="a", kind="exec", status=ActionStatus.OK, exit_code=137)
    assert _end(killed, signal.SIGKILL) == {
        "exitCode": -1, "exited": False, "status": "signal: killed", "error": "signal: killed"
    }  # fmt: skip
    terminated = killed.model_copy(update={"exit_code": 143})
    assert _end(terminated, signal.SIGTERM)["status"] == "signal: terminated"
    assert _end(terminated, signal.SIGKILL)["status"] == "exit status 143"  # not that one's
    assert _end(killed) == {
        "exitCode": 137, "exited": True, "status": "exit status 137", "error": "exit status 137"
    }  # fmt: skip
    ok = killed.model_copy(update={"exit_code": 0})
    assert _end(ok, signal.SIGKILL) == {"exitCode": 0, "exited": True, "status": "exit status 0"}


def test_a_command_killed_by_any_signal_its_result_names_ends_as_gos_process_state_says() -> None:
    """A signal this endpoint did not send (the command's own, another process's, the
    kernel's): the agent's result names it."""
    killed = ActionResult(id="a", kind="exec", status=ActionStatus.OK, exit_code=137, signal=9)
    assert _end(killed)["status"] == "signal: killed" and _end(killed)["exitCode"] == -1
    segv = killed.model_copy(update={"exit_code": 139, "signal": 11})
    assert _end(segv) == {
        "exitCode": -1, "exited": False, "status": "signal: segmentation fault",
        "error": "signal: segmentation fault",
    }  # fmt: skip
    rare = killed.model_copy(update={"exit_code": 128 + 40, "signal": 40})
    assert _end(rare)["status"] == "signal: signal 40"  # as Go names a signal it has no name for


def test_an_entry_is_envds_entry_info() -> None:
    link = FileEntry(name="l", path="/work/l", type="symlink", size=4, mode=0o777,
                     mtime=0.5, uid=1000, gid=1000, target="/etc")  # fmt: skip
    assert entry_info(link) == {
        "name": "l", "type": "FILE_TYPE_SYMLINK", "path": "/work/l", "size": "4", "mode": 0o777,
        "permissions": "lrwxrwxrwx", "owner": "1000", "group": "1000",
        "modifiedTime": "1970-01-01T00:00:00.500000Z", "isSymlink": True, "symlinkTarget": "/etc",
    }  # fmt: skip
    directory = FileEntry(name="d", path="/work/d", type="dir", size=0, mode=0o755,
                          mtime=0, uid=0, gid=0)  # fmt: skip
    assert entry_info(directory)["permissions"] == "drwxr-xr-x"
