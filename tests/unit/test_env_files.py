"""The agent's side of the files API, without an environment: paths, and the refusals it
reads from the exec server."""

from __future__ import annotations

import errno

import pytest

from tangram.node_agent import env_files
from tangram.node_agent.env_files import FileError, _refusal, inside
from tangram.service import files
from tangram.service.records import EngineError


def test_an_exec_server_older_than_the_files_api_is_named_with_what_to_do() -> None:
    """Its answer to a files frame is the protocol error of a release without one."""
    old = _refusal("protocol: the first frame must be a request")
    assert old.errno == errno.ENOSYS and "reopen the trajectory" in str(old)
    refused = _refusal("13 write /etc/x: Permission denied")
    assert (refused.errno, str(refused)) == (13, "write /etc/x: Permission denied")


def test_a_path_with_dotdot_is_refused_and_relative_ones_start_at_the_workdir() -> None:
    assert inside("/work", "a/b") == "/work/a/b"
    assert inside("/work", "/etc/x") == "/etc/x"
    assert inside("/work", "./a//b/") == "/work/a/b"
    assert inside("/", "//x") == "/x"
    for bad in ("../x", "a/../../b", "", "a\0b"):
        with pytest.raises(FileError):
            inside("/work", bad)


def test_both_sides_read_a_writes_keep_flag_the_same_above_the_permission_bits() -> None:
    """The scheduler sets it in ``AgentFiles.mode`` (an int) for E2B's writes; the agent
    reads it: one number on both sides, clear of every mode bit a /v1 write may ask."""
    assert files.KEEP_MODE == env_files.KEEP_MODE
    assert files.KEEP_MODE & 0o7777 == 0 and files.KEEP_MODE & 0o170000 == 0


def test_a_change_in_the_reserved_tangram_directory_is_refused_by_the_service() -> None:
    """At or under /.tangram, however spelled, for an operation that changes it; a read,
    and a name that only begins so, pass."""
    for path in ("/.tangram", "/.tangram/run", "//./.tangram/run/exec.sock", "/.tangram/"):
        with pytest.raises(EngineError) as refused:
            files.check_path(path, "to", changes=True)
        assert (refused.value.kind, refused.value.field) == ("forbidden", "to")
        assert refused.value.message == f"{path}: {files.RESERVED}"
        assert files.check_path(path) == path  # a read
    for path in ("/.tangram2/x", "/work/.tangram", ".tangram/x"):  # (relative: the server's)
        assert files.check_path(path, changes=True) == path
    assert {"write", "mkdir", "remove", "rename", "untar"} == files.CHANGES
