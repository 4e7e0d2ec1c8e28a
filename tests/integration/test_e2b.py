"""E2B's own SDK (the ``e2b`` package from PyPI, unchanged) against the service's
E2B-compatible endpoint on 127.0.0.1: sandboxes are trajectories, commands exec actions
run by a real agent, files go through the environment's exec server. Pointed at the
service only by E2B's environment variables, as a user would."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    CommandHandle,
    FileType,
    Sandbox,
    SandboxQuery,
    SandboxState,
)
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotEnoughSpaceException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize

from tangram.node_agent import env_files

from .service_harness import RUNTIMES, KeptRecords, box_pool, until

pytestmark = pytest.mark.slow
LIMIT = 8 << 20  # the pool's admission.maxFileBytes here


@pytest.fixture(params=RUNTIMES)
def e2b(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str, str]]:
    """The service serving the env ``box`` (with bash), E2B's SDK pointed at it: the
    runtime, the service's URL and the tenant token."""
    kind: str = request.param
    image = request.getfixturevalue("coding_image") if kind == "docker" else None
    with box_pool(request, kind, tmp_path, image=image, max_file_bytes=LIMIT) as (running, token):
        monkeypatch.setenv("E2B_API_URL", running.url)
        monkeypatch.setenv("E2B_SANDBOX_URL", running.url)
        monkeypatch.setenv("E2B_API_KEY", token)
        yield kind, running.url, token


@pytest.fixture
def sandbox(e2b: tuple[str, str, str]) -> Iterator[Sandbox]:
    sb = Sandbox.create("box")
    try:
        yield sb
    finally:
        sb.kill()


def test_a_command_runs_with_its_output_exit_code_env_and_cwd(sandbox: Sandbox) -> None:
    done = sandbox.commands.run("echo out; echo err >&2; echo $GREETING", envs={"GREETING": "hi"})
    assert (done.stdout, done.stderr, done.exit_code) == ("out\nhi\n", "err\n", 0)
    sandbox.files.make_dir("sub/dir")
    assert sandbox.commands.run("pwd", cwd="sub/dir").stdout.strip().endswith("/sub/dir")
    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo no >&2; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "no\n"


def test_sandbox_env_vars_reach_every_command(e2b: tuple[str, str, str]) -> None:
    sb = Sandbox.create("box", envs={"FROM_SANDBOX": "yes"})
    try:
        assert sb.commands.run("echo $FROM_SANDBOX").stdout == "yes\n"
    finally:
        sb.kill()


def test_output_streams_before_the_command_ends(sandbox: Sandbox) -> None:
    # The command cannot end before it is sent a line: its first line must arrive first.
    handle = sandbox.commands.run("echo first; read x; echo second", background=True, stdin=True)
    lines: list[str] = []
    waiter = threading.Thread(target=lambda: handle.wait(on_stdout=lines.append))
    waiter.start()
    until(lambda: lines == ["first\n"], "the first line, while the command waits")
    sandbox.commands.send_stdin(handle.pid, "go\n")
    waiter.join(30)
    assert lines == ["first\n", "second\n"]


def test_stdin_is_sent_and_closed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat; echo end", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "typed\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "typed\nend\n"


def test_a_terminal_runs_an_interactive_shell_or_is_refused_saying_why(
    e2b: tuple[str, str, str], sandbox: Sandbox
) -> None:
    """``pty.create``: a login shell on a terminal where the runtime makes terminals; the
    process runtime has none, and says so at once (the SDK gave an empty error after the
    command had been queued and run)."""
    if e2b[0] == "process":
        with pytest.raises(InvalidArgumentException, match=r"^pty: the process runtime has no"):
            sandbox.pty.create(PtySize(rows=24, cols=80))
        return
    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(terminal.pid, b"echo $((6 * 7)); exit\n")
    seen: list[bytes] = []
    assert terminal.wait(on_pty=seen.append).exit_code == 0
    assert b"42\n" in b"".join(seen)  # (what was typed is not echoed: only its output)


def test_input_over_the_request_limit_is_an_invalid_argument_not_a_rate_limit(
    sandbox: Sandbox,
) -> None:
    """Over the pool's maxRequestBytes, the SDK is told to send it in parts: a 413 it would
    take for rate limiting ("try again later"), which no retry mends."""
    handle = sandbox.commands.run("wc -c", background=True, stdin=True)
    with pytest.raises(InvalidArgumentException, match=r"maxRequestBytes.*in parts"):
        sandbox.commands.send_stdin(handle.pid, "x" * (2 << 20))
    sandbox.commands.send_stdin(handle.pid, "x" * 1000)  # the command goes on
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout.strip() == "1000"


def test_kill_stops_a_running_command_and_frees_its_cores(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    handle = sandbox.commands.run("echo started; sleep 60", background=True)
    listed = sandbox.commands.list()
    assert [p.pid for p in listed] == [handle.pid] and listed[0].args[-1].endswith("sleep 60")
    seen: list[str] = []
    waiter = threading.Thread(target=lambda: _wait_quietly(handle, seen))
    waiter.start()
    until(lambda: seen == ["started\n"], "the command's first line")
    assert sandbox.commands.kill(handle.pid)
    waiter.join(30)
    assert not waiter.is_alive()
    assert sandbox.commands.list() == []
    assert not sandbox.commands.kill(handle.pid)  # gone: E2B's "not found" is False
    # Its cores came back: the next command runs at once.
    assert sandbox.commands.run("echo again").stdout == "again\n"


def test_a_command_still_queued_at_its_timeout_never_runs(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """The SDK's timeout (envd's Connect-Timeout-Ms) is a deadline from the request: a
    command still queued when it passes is never run later (the caller was told it timed
    out, and may well run it again)."""
    holders = _hold_every_core(sandbox, 60)
    with pytest.raises(TimeoutException):
        sandbox.commands.run("echo ran > ghost", timeout=1)
    # The service's deadline counts from the request's arrival, a little after the SDK's
    # from its sending: a core freed in between (a loaded machine) would start it.
    _, url, _ = e2b
    until(lambda: _queued(url) == 0, "the queued command's own deadline")
    for h in holders:
        sandbox.commands.kill(h.pid)
    assert sandbox.commands.run("test -e ghost && echo ran || echo never").stdout == "never\n"


def test_a_queued_command_killed_never_runs_and_ends_at_once(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """envd's process dies at the kill; here one still queued is taken out of the queue
    (it ends as killed) rather than run when a core frees."""
    holders = _hold_every_core(sandbox, 600)
    queued = sandbox.commands.run("touch ghost", background=True)
    assert sandbox.commands.kill(queued.pid)
    # (the others run 600 s: it ends now, or waits for one of their cores)
    until(lambda: queued.pid not in [p.pid for p in sandbox.commands.list()],
          "the killed command waited for a core")  # fmt: skip
    with pytest.raises(CommandExitException) as ended:
        queued.wait()
    assert ended.value.exit_code == -1 and ended.value.error == "signal: killed"
    for h in holders:
        sandbox.commands.kill(h.pid)
    assert sandbox.commands.run("test -e ghost && echo ran || echo never").stdout == "never\n"


def _queued(url: str) -> float:
    """The pool's queue depth, as its metrics say."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tangram_queue_depth{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tangram_queue_depth in the metrics")


def _hold_every_core(sandbox: Sandbox, seconds: int) -> list[CommandHandle]:
    """Commands running for ``seconds`` on each of the pool's action cores (one a core)."""
    cores = len(os.sched_getaffinity(0))
    holders = [sandbox.commands.run(f"touch held.$$; sleep {seconds}", background=True)
               for _ in range(cores)]  # fmt: skip
    files = sandbox.files
    until(lambda: sum(e.name.startswith("held.") for e in files.list(".")) == cores,
          "the commands did not take every core")  # fmt: skip
    return holders


def _wait_quietly(handle: object, seen: list[str]) -> None:
    with pytest.raises(CommandExitException) as killed:
        handle.wait(on_stdout=seen.append)  # type: ignore[attr-defined]
    seen.append(f"exit {killed.value.exit_code}")


def test_files_round_trip_and_are_the_commands_files(sandbox: Sandbox) -> None:
    data = os.urandom(3 << 20)
    info = sandbox.files.write("deep/er/blob.bin", data)  # parents are made, as in E2B
    assert info.name == "blob.bin" and info.path.endswith("/deep/er/blob.bin")
    assert bytes(sandbox.files.read("deep/er/blob.bin", format="bytes")) == data
    assert sandbox.commands.run("wc -c < deep/er/blob.bin").stdout.strip() == str(len(data))
    many = sandbox.files.write_files(
        [{"path": "m/a.txt", "data": "A"}, {"path": "m/b.txt", "data": b"B"}]
    )
    assert sorted(w.name for w in many) == ["a.txt", "b.txt"]
    assert sandbox.files.read("m/b.txt") == "B"
    entries = {e.name: e for e in sandbox.files.list("m")}
    assert set(entries) == {"a.txt", "b.txt"} and entries["a.txt"].size == 1
    assert {e.name for e in sandbox.files.list("deep", depth=2)} == {"er", "blob.bin"}
    assert sandbox.files.exists("m/a.txt") and not sandbox.files.exists("m/none")
    assert sandbox.files.get_info("m").type == FileType.DIR
    moved = sandbox.files.rename("m/a.txt", "m/c.txt")
    assert moved.name == "c.txt" and sandbox.files.read("m/c.txt") == "A"
    assert sandbox.files.make_dir("newdir") and not sandbox.files.make_dir("newdir")
    sandbox.files.remove("m")
    assert not sandbox.files.exists("m")
    with pytest.raises(NotFoundException):
        sandbox.files.read("m/c.txt")


def test_list_dir_ends_with_the_tree_whatever_depth_is_asked(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    _, url, token = e2b
    sandbox.files.make_dir("tree/a/b")
    sandbox.files.make_dir("empty")

    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token}

    def list_dir(path: str, depth: int) -> httpx.Response:
        body = {"path": path, "depth": depth}
        return httpx.post(f"{url}/filesystem.Filesystem/ListDir", json=body, headers=envd,
                          timeout=30)  # fmt: skip

    deepest = 2**32 - 1  # envd's proto allows it: the walk ends where the tree does
    assert list_dir("empty", deepest).json() == {"entries": []}
    walked = list_dir("tree", deepest).json()["entries"]
    assert sorted(e["name"] for e in walked) == ["a", "b"]
    refused = list_dir("tree", deepest + 1)
    assert refused.status_code == 400 and refused.json()["message"].startswith("depth: ")


def test_gzip_uploads_are_whole_gzip_held_to_the_file_limit_once_inflated(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    _, url, token = e2b
    sandbox.files.write("kept.txt", "kept")

    def upload(path: str, body: bytes) -> httpx.Response:
        return httpx.post(f"{url}/files", params={"path": path}, content=body, timeout=30,
                          headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token,
                                   "Content-Type": "application/octet-stream",
                                   "Content-Encoding": "gzip"})  # fmt: skip

    # Members one after another are one file, as gzip.decompress and gunzip read them.
    assert upload("two.txt", gzip.compress(b"first\n") + gzip.compress(b"second\n")).is_success
    assert sandbox.files.read("two.txt") == "first\nsecond\n"
    # A few KiB that inflate past the limit are refused as a plain body that size is.
    bomb = gzip.compress(bytes(LIMIT + 1))
    assert len(bomb) < LIMIT // 100
    too_large = upload("kept.txt", bomb)
    assert too_large.status_code == 413 and too_large.json()["message"].startswith("body: ")
    whole = gzip.compress(b"0123456789abcdef" * 4096)
    for body, why in (
        (whole[: len(whole) // 2], "cut short"),
        (gzip.compress(b"ok") + b"GARBAGE", "not valid gzip"),
        (b"", "empty"),
    ):
        refused = upload("kept.txt", body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["message"].startswith("body: ") and why in refused.text
    assert sandbox.files.read("kept.txt") == "kept"  # none of them replaced it


BOUNDARY = "XyZbOuNdArY"


def _form_part(name: str, data: bytes = b"", filename: str | None = None) -> bytes:
    named = f'; filename="{filename}"' if filename is not None else ""
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"{named}\r\n\r\n'
    return head.encode() + data + b"\r\n"


@contextlib.contextmanager
def _posting(url: str, sandbox: Sandbox, token: str, length: int) -> Iterator[socket.socket]:
    """A socket with ``POST /files`` begun, its body (``length`` bytes, multipart) to be
    sent a piece at a time."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /files HTTP/1.1\r\nHost: {host}\r\n"
                  f"X-Access-Token: {token}\r\nE2b-Sandbox-Id: {sandbox.sandbox_id}\r\n"
                  f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
        yield s


def _answer(s: socket.socket) -> tuple[int, str]:
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith((b"}", b"]")):
        piece = s.recv(65536)
        if not piece:
            break
        got += piece
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_a_multipart_upload_is_written_part_by_part_as_it_streams(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """Each file part is written as it comes (whole, as any write), not once the whole
    body is in the scheduler: a body as large as maxFileBytes is never held there."""
    _, url, token = e2b
    data = os.urandom(300_000)
    first = _form_part("file", data, "s/one.bin")
    second = _form_part("file", b"two", "s/two.txt")
    end = f"--{BOUNDARY}--\r\n".encode()
    with _posting(url, sandbox, token, len(first + second + end)) as s:
        s.sendall(first + second[:-1])  # the second part's headers and all but its last byte
        until(lambda: sandbox.files.exists("s/one.bin"), "the first part written mid-body")
        assert not sandbox.files.exists("s/two.txt")  # (a write lands whole)
        s.sendall(second[-1:] + end)
        status, body = _answer(s)
    assert status == 200, body
    assert sandbox.files.read("s/one.bin", format="bytes") == data
    assert sandbox.files.read("s/two.txt") == "two"


def test_a_multipart_upload_refuses_large_other_parts_at_once_naming_them(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """Parts other than ``file`` (E2B's SDK sends none) are read past but held to a few
    KiB: a body of large ones is refused while it is still coming, not kept to its end."""
    _, url, token = e2b
    field = _form_part("f0", b"a" * 1_000_000)
    with _posting(url, sandbox, token, 7 * len(field)) as s:  # (under the limit, 8 MiB)
        s.sendall(field[:65536])
        status, body = _answer(s)
    assert status == 400 and json.loads(body)["message"].startswith("f0: over 4096 bytes")

    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token,
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}  # fmt: skip
    end = f"--{BOUNDARY}--\r\n".encode()

    def upload(body: bytes, **params: str) -> httpx.Response:
        return httpx.post(f"{url}/files", params=params, content=body + end, headers=envd,
                          timeout=30)  # fmt: skip

    # Small ones are read past, as envd does; an upload of no file part says so.
    r = upload(_form_part("note", b"n" * 4096) + _form_part("file", b"f", "f.txt"))
    assert r.status_code == 200 and sandbox.files.read("f.txt") == "f"
    r = upload(_form_part("note", b"n"))
    assert r.status_code == 400 and r.json()["message"].startswith("file: ")
    # The body is held to maxFileBytes as it comes, of no declared length too (chunked).
    over = iter([_form_part("file", b"x" * LIMIT, "over.bin"), end])
    r = httpx.post(f"{url}/files", content=over, headers=envd, timeout=30)
    assert r.status_code == 413, r.text
    assert not sandbox.files.exists("over.bin")
    # One ?path= names one file: a second file part is refused (the first is written, as
    # in envd).
    r = upload(_form_part("file", b"1", "a") + _form_part("file", b"2", "b"), path="only.txt")
    assert r.status_code == 400 and r.json()["message"].startswith("path: names one file")
    assert sandbox.files.read("only.txt") == "1"
    assert not sandbox.files.exists("b")


def test_a_path_out_of_the_sandbox_is_refused_naming_it(sandbox: Sandbox) -> None:
    with pytest.raises(SandboxException, match=r"\.\./\.\./etc/passwd"):
        sandbox.files.read("../../etc/passwd")
    with pytest.raises(SandboxException, match=r"'\.\.'"):
        sandbox.files.list("a/../..")


def test_a_refused_write_names_the_path_asked_for(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """A write judged the parent it makes first: "path: a/..", "path: ../../etc"; and, for
    /.tangram, its mkdir of /.tangram/run."""
    _, url, token = e2b
    with pytest.raises(SandboxException) as dotdot:
        sandbox.files.write("a/../z.txt", "z")
    assert "path: a/../z.txt: a '..' component is refused" in str(dotdot.value)
    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token,
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}  # fmt: skip
    body = _form_part("file", b"x", "../../etc/x") + f"--{BOUNDARY}--\r\n".encode()
    r = httpx.post(f"{url}/files", content=body, headers=envd, timeout=30)
    assert r.status_code == 403 and "path: ../../etc/x: a '..'" in r.json()["message"], r.text
    with pytest.raises(SandboxException) as reserved:
        sandbox.files.write("/.tangram/run/x", "x")
    assert "path: /.tangram/run/x: /.tangram is reserved" in str(reserved.value)
    assert not sandbox.files.exists("a") and not sandbox.files.exists("/.tangram/run/x")


def test_a_cwd_that_cannot_be_entered_is_said_naming_it(sandbox: Sandbox) -> None:
    """It was the shell's "sub: 1: cd: can't cd to sub" (the directory taken for the
    script's name)."""
    with pytest.raises(CommandExitException) as cwd:
        sandbox.commands.run("pwd", cwd="sub")
    assert (cwd.value.exit_code, cwd.value.stderr) == (1, "cwd: sub: No such file or directory\n")
    sandbox.files.write("file", "")
    with pytest.raises(CommandExitException) as not_dir:
        sandbox.commands.run("pwd", cwd="file")
    assert not_dir.value.stderr == "cwd: file: Not a directory\n"


@pytest.mark.parametrize("e2b", ["docker"], indirect=True)  # (the process runtime's are root's)
def test_a_write_into_a_directory_the_user_cannot_read_names_the_file(sandbox: Sandbox) -> None:
    """As the image's user (uid 1000), into /root (0700): it was "mkdir /root: Permission
    denied" (the parent made first could not be opened, though it is there)."""
    with pytest.raises(SandboxException) as refused:
        sandbox.files.write("/root/x", "x")
    assert "write /root/x: Permission denied" in str(refused.value), refused.value


def test_timeout_kills_the_sandbox_and_can_be_extended(
    e2b: tuple[str, str, str],
) -> None:
    _, url, token = e2b
    sb = Sandbox.create("box", timeout=600)
    assert sb.is_running()
    sb.set_timeout(2)
    until(lambda: not sb.is_running(), "the sandbox's end at its timeout", timeout_s=20)
    trajectory = f"{url}/v1/trajectories/{sb.sandbox_id}"
    bearer = {"Authorization": f"Bearer {token}"}
    until(lambda: httpx.get(trajectory, headers=bearer).status_code == 404,
          "its trajectory closed with it")  # fmt: skip
    longer = Sandbox.create("box", timeout=2)
    again = Sandbox.connect(longer.sandbox_id, timeout=600)  # extends it
    # The end the reaper kills at (above) moved: ~600 s out, not the 2 s it was made with.
    left = again.get_info().end_at.timestamp() - time.time()
    assert 500 < left <= 600, left
    assert again.commands.run("echo alive").stdout == "alive\n"
    again.kill()
    assert not again.is_running()


def test_a_sandbox_the_service_did_not_make_is_reaped_by_its_label(
    e2b: tuple[str, str, str],
) -> None:
    """As after a scheduler restart: a trajectory labelled with an E2B timeout that this
    service never created as a sandbox is killed when that timeout passes, unasked."""
    _, url, token = e2b
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
        opened = http.post("/v1/trajectories", json={
            "env": "box", "labels": {"e2b.tangram.dev/timeout-s": "1"}})  # fmt: skip
        assert opened.status_code == 201, opened.text
        trajectory = f"/v1/trajectories/{opened.json()['id']}"
        until(lambda: http.get(trajectory).status_code == 404, "its end at its timeout")


def test_labels_that_are_no_timeout_stop_no_reaping(e2b: tuple[str, str, str]) -> None:
    """Anyone may label a trajectory through /v1: a superscript digit, a 400-digit or a
    years-long timeout neither ends the reaper nor breaks the listing (a 1 s sandbox made
    after them is still killed on time)."""
    _, url, token = e2b
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
        odd_ones = []
        for odd in ("\u00b2", "9" * 400, "999999999999"):
            opened = http.post("/v1/trajectories", json={
                "env": "box", "labels": {"e2b.tangram.dev/timeout-s": odd}})  # fmt: skip
            assert opened.status_code == 201, opened.text
            odd_ones.append(opened.json()["id"])
        victim = Sandbox.create("box", timeout=1)
        until(lambda: not victim.is_running(), "the 1 s sandbox killed at its timeout")
        listed = http.get("/v2/sandboxes", headers={"X-API-KEY": token})
        assert listed.status_code == 200, listed.text
        ends = [box["endAt"] for box in listed.json()]
        assert len(ends) == 3  # the labelled ones, each ending within the 24 h bound
        for tid in odd_ones:
            assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def test_a_killed_sandbox_is_not_running_to_the_sdk(e2b: tuple[str, str, str]) -> None:
    """As behind E2B's proxy: its commands and files say it was killed or timed out, not
    that it could not be reached (its state unknown)."""
    sb = Sandbox.create("box")
    sb.kill()
    for call in (lambda: sb.commands.run("true"), lambda: sb.files.read("a"),
                 lambda: sb.files.list(".")):  # fmt: skip
        with pytest.raises(SandboxNotRunningException, match=f"{sb.sandbox_id} was not found"):
            call()

    async def go() -> None:
        asb = await AsyncSandbox.create("box")
        await asb.kill()
        with pytest.raises(SandboxNotRunningException, match="was not found"):
            await asb.commands.run("true")
        with pytest.raises(SandboxNotRunningException, match="was not found"):
            await asb.files.write("a", "x")

    asyncio.run(go())


def test_list_info_and_kill(e2b: tuple[str, str, str]) -> None:
    sb = Sandbox.create("box", metadata={"run": "r1"})
    info = sb.get_info()
    assert (info.template_id, info.metadata) == ("box", {"run": "r1"})
    listed = Sandbox.list().next_items()
    assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
    assert Sandbox.kill(sb.sandbox_id)
    assert not Sandbox.kill(sb.sandbox_id)  # already gone: False, as in E2B
    assert Sandbox.list().next_items() == []
    # A trajectory opened through /v1 is a sandbox by its id, as connect takes it, but is
    # not listed: a cleanup that kills all it lists leaves an RL trainer's alone.
    _, url, token = e2b
    bearer = {"Authorization": f"Bearer {token}"}
    opened = httpx.post(f"{url}/v1/trajectories", headers=bearer,
                        json={"env": "box", "labels": {"run": "v1"}})  # fmt: skip
    assert opened.status_code == 201, opened.text
    tid = opened.json()["id"]
    assert Sandbox.list().next_items() == []
    assert Sandbox.get_info(tid).metadata == {"run": "v1"}
    assert Sandbox.connect(tid).commands.run("echo v1").stdout == "v1\n"
    assert Sandbox.kill(tid)


def test_refusals_name_what_is_wrong(e2b: tuple[str, str, str]) -> None:
    _, url, token = e2b
    with pytest.raises(SandboxException, match=r"unknown TrajectoryEnv 'nope' \(known: box\)"):
        Sandbox.create("nope")
    with pytest.raises(AuthenticationException):
        Sandbox.create("box", api_key="not-a-token-of-this-service")
    with pytest.raises(SandboxException, match=r"400: timeout: .* 86400"):
        Sandbox.create("box", timeout=10**9)
    # Refused at create, not by every command after it.
    with pytest.raises(SandboxException, match=r"400: envVars: 'MY-VAR' is not a variable name"):
        Sandbox.create("box", envs={"MY-VAR": "x"})
    with pytest.raises(SandboxException, match=r"400: envVars: 10010 bytes as JSON, over the"):
        Sandbox.create("box", envs={"BIG": "x" * 10_000})
    with pytest.raises(SandboxException, match=r"400: metadata: \d+ bytes as JSON, over the"):
        Sandbox.create("box", metadata={"big": "x" * 8_170})  # (8,180 bytes, and its timeout)
    sb = Sandbox.create("box")
    try:
        with pytest.raises(SandboxException, match="501: sandboxes cannot be paused"):
            sb.pause()
        # envd's routes need the tenant's token (the API key), not only the sandbox's id.
        r = httpx.get(f"{url}/health", headers={"E2b-Sandbox-Id": sb.sandbox_id})
        assert r.status_code == 401 and "API key" in r.json()["message"]
        envd = {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": token}
        r = httpx.get(f"{url}/health", headers=envd)
        assert r.status_code == 204
        # Connect messages of the wrong shape are invalid_argument naming the field.
        cat = sb.commands.run("cat", background=True, stdin=True)
        wrong: list[tuple[str, dict[str, object], str]] = [
            ("SendSignal", {"signal": ["SIGNAL_SIGTERM"]}, "signal"),
            ("SendInput", {"input": "aGk="}, "input"),
        ]
        # A command's own variables are named as the request names them.
        with pytest.raises(InvalidArgumentException, match=r"process\.envs: 'MY-VAR' is not"):
            sb.commands.run("true", envs={"MY-VAR": "x"})
        for method, body, field in wrong:
            r = httpx.post(f"{url}/process.Process/{method}", headers=envd,
                           json={"process": {"pid": cat.pid}, **body})  # fmt: skip
            assert r.status_code == 400, r.text
            assert r.json()["code"] == "invalid_argument" and r.json()["message"].startswith(field)
        # Ended by its input, not killed: a kill while bash -l still reads the host's
        # profile (the process runtime) can leave that profile's locks behind (pyenv's).
        sb.commands.close_stdin(cat.pid)
        assert cat.wait().exit_code == 0
    finally:
        sb.kill()


def test_what_is_not_served_says_so_in_e2bs_shape(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """E2B's SDK reads only ``{"code", "message"}``: metrics crashed it (KeyError 'code')."""
    _, url, token = e2b
    sid = sandbox.sandbox_id
    with pytest.raises(SandboxException, match="501: sandbox metrics are not served"):
        sandbox.get_metrics()
    with pytest.raises(SandboxException, match="501: sandbox metrics are not served"):
        Sandbox.get_metrics(sid)
    api = {"X-API-KEY": token}
    for method, path, status, said in (
        ("GET", "/sandboxes/metrics", 501, "metrics are not served"),
        ("GET", f"/sandboxes/{sid}/logs", 501, "logs are not served"),
        ("GET", f"/v2/sandboxes/{sid}/logs", 501, "logs are not served"),
        ("PUT", f"/sandboxes/{sid}/network", 404, "is not served"),
        ("GET", "/templates", 404, "is not served"),
        ("GET", "/v3/templates/x/builds", 404, "is not served"),
        ("PATCH", "/sandboxes", 405, "endpoint (it serves GET, POST)"),
    ):
        r = httpx.request(method, f"{url}{path}", headers=api)
        assert r.status_code == status, (path, r.text)
        assert r.json()["code"] == status and said in r.json()["message"], (path, r.text)
        assert status != 405 or r.headers["allow"] == "GET, POST"
    # The code interpreter's requests (e2b_code_interpreter's run_code): its port, by header.
    interpreter = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token}
    for path in ("/execute", "/contexts", "/health"):
        r = httpx.post(f"{url}{path}", headers=interpreter, json={"code": "1"})
        assert r.status_code == 501, (path, r.text)
        message = r.json()["message"]
        assert "code interpreter" in message and "commands.run" in message, message
    assert httpx.get(f"{url}/healthz").status_code == 200  # (the service's own paths keep theirs)
    r = httpx.get(f"{url}/v1/nope", headers=api)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_async_sdk(e2b: tuple[str, str, str]) -> None:
    async def go() -> None:
        sb = await AsyncSandbox.create("box")
        try:
            done = await sb.commands.run("echo async")
            assert done.stdout == "async\n"
            await sb.files.write("a.txt", "from async")
            assert await sb.files.read("a.txt") == "from async"
        finally:
            await sb.kill()

    asyncio.run(go())


def test_list_keeps_to_the_query_and_pages(e2b: tuple[str, str, str]) -> None:
    """A query is never ignored: killing what a metadata query lists kills only those."""
    _, url, token = e2b
    odd = {"run": "r 1&x=y", "kind": "a/b"}  # (E2B's SDK encodes them twice)
    r1 = [Sandbox.create("box", metadata=odd) for _ in range(3)]
    r2 = Sandbox.create("box", metadata={"run": "r2"})
    try:
        mine = Sandbox.list(query=SandboxQuery(metadata={"run": "r 1&x=y"}))
        found = mine.next_items()
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in r1)
        assert not mine.has_next
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "r3"})).next_items() == []
        assert Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items() == []
        running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
        assert len(running) == 4
        assert Sandbox.list(query=SandboxQuery(template="other")).next_items() == []
        for order in ("desc", "asc"):  # a page at a time, each sandbox once, in order
            pages = Sandbox.list(limit=1, order=order)
            seen = []
            while pages.has_next:
                page = pages.next_items()
                assert len(page) == 1
                seen += page
            assert len(seen) == 4 and len({s.sandbox_id for s in seen}) == 4
            starts = [s.started_at for s in seen]
            assert starts == sorted(starts, reverse=order == "desc")
        for info in Sandbox.list(query=SandboxQuery(metadata={"run": "r 1&x=y"})).next_items():
            Sandbox.kill(info.sandbox_id)
        assert r2.is_running() and not any(box.is_running() for box in r1)
        key = {"X-API-KEY": token}
        for params, field in (
            ({"state": "sleeping"}, "state"),
            ({"limit": "0"}, "limit"),
            ({"nextToken": "not-a-token"}, "nextToken"),
            ({"metadata": "no-pair"}, "metadata"),
        ):
            refused = httpx.get(f"{url}/v2/sandboxes", params=params, headers=key)
            assert refused.status_code == 400, (params, refused.text)
            assert field in refused.json()["message"], refused.text
    finally:
        for box in (*r1, r2):
            with contextlib.suppress(SandboxException):
                box.kill()


def test_a_write_goes_through_a_symlink_and_keeps_the_files_mode(
    sandbox: Sandbox, e2b: tuple[str, str, str]
) -> None:
    """As envd's: a symlink is written through, not replaced by a file, and a file keeps
    its mode (a script stays executable); a symlink out of the sandbox is still refused."""
    kind = e2b[0]
    sandbox.commands.run(
        "mkdir -p d && echo old > d/target.txt && ln -s d/target.txt link && "
        "ln -s ../d/target.txt d/up && printf '#!/bin/sh\\necho old\\n' > run.sh && "
        "chmod 750 run.sh && ln -s run.sh run"
    )
    sandbox.files.write("link", "through the link\n")
    sandbox.files.write("d/up", "and again\n")
    sandbox.files.write("run", "#!/bin/sh\necho new\n")  # a symlink to an executable
    sandbox.files.write("fresh.txt", "new")
    seen = sandbox.commands.run(
        "test -L link && test -L d/up && test -L run && cat d/target.txt && ./run.sh && "
        "stat -c '%a %n' run.sh fresh.txt d/target.txt"
    )
    assert seen.stdout == "and again\nnew\n750 run.sh\n644 fresh.txt\n644 d/target.txt\n"
    out = "/proc/1/root/etc/x" if kind == "docker" else "/etc/tangram-test-never"
    sandbox.commands.run(f"ln -s {out} out")
    with pytest.raises(SandboxException, match="403"):
        sandbox.files.write("out", "x")
    assert sandbox.commands.run("test -L out && echo still a link").stdout == "still a link\n"


def test_every_reader_of_a_command_gets_its_output_from_when_it_attached(
    sandbox: Sandbox,
) -> None:
    """As envd fans events out: a second reader (connect) takes nothing from the first."""
    first = sandbox.commands.run(
        "echo one; read x; echo two; read y; echo three", background=True, stdin=True
    )
    seen: list[str] = []
    ended: list[int] = []
    reader = threading.Thread(
        target=lambda: ended.append(first.wait(on_stdout=seen.append).exit_code)
    )
    reader.start()
    until(lambda: seen == ["one\n"], "the first line, to the first reader")
    second = sandbox.commands.connect(first.pid)  # attached once it has its start event
    sandbox.commands.send_stdin(first.pid, "go\n")
    until(lambda: seen == ["one\n", "two\n"], "the second line, to the first reader too")
    sandbox.commands.send_stdin(first.pid, "go\n")
    late = second.wait()
    reader.join(30)
    assert (late.stdout, late.exit_code) == ("two\nthree\n", 0)
    assert seen == ["one\n", "two\n", "three\n"] and ended == [0]


def test_a_command_killed_by_its_signal_ends_as_envds_does(sandbox: Sandbox) -> None:
    """Go's ProcessState, as envd says it: exit code -1, "signal: killed"; an exit with
    a non-zero code says its status as the error."""
    handle = sandbox.commands.run("echo up; sleep 60", background=True)
    seen: list[str] = []
    waiter = threading.Thread(target=lambda: _wait_quietly(handle, seen))
    waiter.start()
    until(lambda: seen == ["up\n"], "the command started")
    assert sandbox.commands.kill(handle.pid)
    waiter.join(30)
    assert seen[1:] == ["exit -1"]
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert killed.value.error == "signal: killed"
    with pytest.raises(CommandExitException) as own:  # a signal this endpoint did not send
        sandbox.commands.run("kill -SEGV $$")
    assert (own.value.exit_code, own.value.error) == (-1, "signal: segmentation fault")
    with pytest.raises(CommandExitException) as exited:
        sandbox.commands.run("exit 3")
    assert (exited.value.exit_code, exited.value.error) == (3, "exit status 3")


def test_removing_the_sandboxs_root_is_refused_as_an_invalid_argument(sandbox: Sandbox) -> None:
    """A mount point (EBUSY) is no conflict to retry: 'invalid', saying why."""
    with pytest.raises(InvalidArgumentException, match="mount point"):
        sandbox.files.remove("/")


def test_remove_of_nothing_is_done_and_a_move_makes_its_parents(sandbox: Sandbox) -> None:
    """envd's Remove is os.RemoveAll (nothing there: done), its Move makes the
    destination's directories first."""
    sandbox.files.remove("not/there/at/all")
    sandbox.files.remove("nothing.txt")
    sandbox.files.write("a.txt", "A")
    moved = sandbox.files.rename("a.txt", "new/sub/a.txt")
    assert moved.path.endswith("/new/sub/a.txt") and sandbox.files.read("new/sub/a.txt") == "A"
    with pytest.raises(NotFoundException):  # a missing source is still not found
        sandbox.files.rename("a.txt", "new/b.txt")


def test_a_directory_too_large_for_one_listing_is_refused_naming_it(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent refuses where it lists (here at 20 entries, not 100,000), and not as
    rate limiting: listing it again would not help."""
    monkeypatch.setattr(env_files, "MAX_LIST", 20)
    sandbox.commands.run("mkdir many && cd many && touch $(seq 21)")
    with pytest.raises(SandboxException) as refused:
        sandbox.files.list("many")
    assert not isinstance(refused.value, RateLimitException)
    assert "/many: the directory holds over 20 entries" in str(refused.value)
    assert sandbox.commands.run("ls many | wc -l").stdout.strip() == "21"  # the node is fine


@pytest.fixture
def full_disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Sandbox]:
    """A sandbox of the process runtime whose directory ``small`` is a tmpfs of 64 KiB
    and 8 inodes."""
    with box_pool(request, "process", tmp_path, max_file_bytes=LIMIT) as (running, token):
        for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(name, running.url)
        monkeypatch.setenv("E2B_API_KEY", token)
        sb = Sandbox.create("box")
        small = tmp_path / "agent" / "trajectories" / sb.sandbox_id / "small"
        small.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=8", "tmpfs", str(small)],
                       check=True, capture_output=True)  # fmt: skip
        try:
            yield sb
        finally:
            subprocess.run(["umount", str(small)], check=False)
            sb.kill()


def test_a_full_disk_is_envds_507_not_a_rate_limit(full_disk: Sandbox) -> None:
    with pytest.raises(NotEnoughSpaceException, match="disk is full"):
        full_disk.files.write("small/big.bin", b"x" * 200_000)
    with pytest.raises(SandboxException) as no_dir:
        for i in range(100):  # (until its inodes run out: a Connect call, MakeDir)
            full_disk.files.make_dir(f"small/d{i}")
    assert not isinstance(no_dir.value, RateLimitException)
    assert "disk is full" in str(no_dir.value)


@pytest.mark.parametrize("form", ["octet-stream", "multipart"])
def test_an_upload_the_client_cuts_off_keeps_the_old_file_and_logs_no_traceback(
    sandbox: Sandbox, e2b: tuple[str, str, str], form: str
) -> None:
    """envd's upload, 6 MB said, 3 MB sent, then the client goes: the old file stays, no
    temporary one is left, and the service logs nothing. It logged "Exception in ASGI
    application" with a traceback ending in starlette's ClientDisconnect."""
    _, url, token = e2b
    sandbox.files.write("f.bin", "old")
    head = _form_part("file", b"", "f.bin")[:-2] if form == "multipart" else b""  # (no CRLF)
    kind = (
        f"multipart/form-data; boundary={BOUNDARY}"
        if form == "multipart"
        else "application/octet-stream"
    )
    host, port = url.removeprefix("http://").split(":")

    def temporaries() -> list[str]:
        return [e.name for e in sandbox.files.list(".") if e.name.startswith(".f.bin.tangram-")]

    kept = KeptRecords()
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger()]
    for logger in loggers:
        logger.addHandler(kept)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"POST /files?path=f.bin HTTP/1.1\r\nHost: {host}\r\n"
                      f"X-Access-Token: {token}\r\nE2b-Sandbox-Id: {sandbox.sandbox_id}\r\n"
                      f"Content-Type: {kind}\r\nContent-Length: 6000000\r\n\r\n".encode()
                      + head + b"n" * 3_000_000)  # fmt: skip
            until(lambda: temporaries() != [], "the write under way")
        until(lambda: temporaries() == [], "the cut-off write dropped")
        assert sandbox.files.read("f.bin") == "old"
    finally:
        for logger in loggers:
            logger.removeHandler(kept)
    lines = [r.getMessage() for r in kept.records]
    assert not any(r.exc_info for r in kept.records) and len(lines) <= 1, lines


# (Docker's only: the process runtime's environment is its directory, with no /proc.)
@pytest.mark.parametrize("e2b", [p for p in RUNTIMES if p.values[0] == "docker"], indirect=True)
def test_a_file_of_proc_downloads_whole(sandbox: Sandbox, e2b: tuple[str, str, str]) -> None:
    """envd's download of a file whose size stat cannot tell (/proc's say 0): it was an
    empty file; it is what the file holds, with that Content-Length."""
    _, url, token = e2b
    envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token}
    got = httpx.get(f"{url}/files", params={"path": "/proc/version"}, headers=envd, timeout=30)
    assert got.status_code == 200 and got.content == Path("/proc/version").read_bytes()
    assert int(got.headers["content-length"]) == len(got.content)
    assert sandbox.files.read("/proc/self/status").startswith("Name:")
