"""The files API end to end: the real client over HTTP, the service, a real agent over its
WebSocket, and the environment's own exec server doing each operation, in a Docker
container and in the process runtime's directory."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tangram.client import Client, TangramError
from tangram.client.sync import Trajectory
from tangram.node_agent import env_files
from tangram.node_agent.env_files import EnvFiles, FileError, one_shot
from tangram.node_agent.exec_server import Built

from .service_harness import RUNTIMES, box_pool, until

CORES = sorted(os.sched_getaffinity(0))
LIMIT = 64 << 20  # the pool's admission.maxFileBytes here


@pytest.fixture(params=RUNTIMES)
def box(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Trajectory]]:
    """An open trajectory of the ``box`` environment, on the runtime of the parameter."""
    kind: str = request.param
    with (
        box_pool(request, kind, tmp_path, max_file_bytes=LIMIT) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        yield kind, t


def _workdir(kind: str) -> str:
    """Where relative paths start: the container's workdir, or the root of the process
    runtime's environment, which is its directory."""
    return "/work" if kind == "docker" else ""


def test_fifty_megabytes_round_trip_byte_exact(box: tuple[str, Trajectory]) -> None:
    kind, t = box
    data = random.Random(7).randbytes(50 << 20)
    written = t.files.write("big.bin", data)
    assert written.size == len(data)
    back = t.files.read(f"{_workdir(kind)}/big.bin")
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    # The command sees the same bytes at the same place.
    seen = t.exec(["sh", "-c", "wc -c < big.bin"])
    assert seen.stdout.strip() == str(len(data))


def test_list_stat_mkdir_rename_remove(box: tuple[str, Trajectory]) -> None:
    kind, t = box
    work = _workdir(kind)
    assert t.files.make_dir("repo/src") is True
    assert t.files.make_dir(f"{work}/repo/src") is False  # a directory already
    t.files.write("repo/src/a.py", "print('a')\n", mode=0o755)
    entry = t.files.stat("repo/src/a.py")
    assert (entry.path, entry.type, entry.size) == (f"{work}/repo/src/a.py", "file", 11)
    assert entry.mode == 0o755
    uid = t.exec(["id", "-u"]).stdout.strip()
    assert str(entry.uid) == uid  # the environment's own user wrote it
    t.files.rename("repo/src/a.py", "repo/b.py")
    assert {(e.name, e.type) for e in t.files.list("repo")} == {("src", "dir"), ("b.py", "file")}
    assert t.files.read_text("repo/b.py") == "print('a')\n"
    assert t.files.exists("repo/b.py") and not t.files.exists("repo/src/a.py")
    t.exec(["ln", "-s", "b.py", "repo/link"])
    link = t.files.stat("repo/link")
    assert (link.type, link.target) == ("symlink", "b.py")
    assert t.files.read_text("repo/link") == "print('a')\n"  # followed inside
    t.files.remove("repo")
    assert not t.files.exists("repo")
    assert t.exec(["ls", "-A", "."]).stdout == ""  # no temporary file was left


def test_overwriting_is_atomic_and_keeps_the_new_mode(box: tuple[str, Trajectory]) -> None:
    _, t = box
    t.files.write("f", b"old", mode=0o600)
    t.files.write("f", b"new content", mode=0o640)
    entry = t.files.stat("f")
    assert (entry.size, entry.mode) == (11, 0o640)
    assert t.files.read("f") == b"new content"


def _refusal(call: Any) -> TangramError:
    with pytest.raises(TangramError) as refused:
        call()
    return refused.value


def test_paths_that_leave_the_environment_are_refused_naming_the_path(
    box: tuple[str, Trajectory],
) -> None:
    kind, t = box
    dotdot = _refusal(lambda: t.files.read("a/../../etc/passwd"))
    assert dotdot.status == 403 and dotdot.field == "path" and "a/../../etc/passwd" in str(dotdot)
    assert _refusal(lambda: t.files.write("../x", b"x")).status == 403
    if kind == "process":  # the directory is the environment: a symlink out of it is refused
        t.exec(["ln", "-s", "/etc", "esc"])
        escape = "esc/passwd"
    else:  # the container is: /proc's magic links are the way out, and refused
        t.exec(["ln", "-s", "/proc/1/root/etc", "esc"])
        escape = "esc/hostname"
    for call in (
        lambda: t.files.read(escape),
        lambda: t.files.write(escape, b"owned"),
        lambda: t.files.list("esc"),
    ):
        refused = _refusal(call)
        assert refused.status == 403 and refused.field == "path", refused
        assert escape.split("/")[0] in str(refused)
    missing = _refusal(lambda: t.files.read("nope"))
    assert (missing.status, missing.field) == (404, "path")
    is_dir = _refusal(lambda: t.files.read(f"{_workdir(kind)}/"))
    assert is_dir.status == 400


def test_an_upload_over_the_pools_limit_is_a_413_and_leaves_nothing(
    box: tuple[str, Trajectory],
) -> None:
    _, t = box
    too_large = _refusal(lambda: t.files.write("huge", bytes(LIMIT + 1)))
    assert too_large.status == 413
    assert not t.files.exists("huge")


def test_file_operations_take_no_core(box: tuple[str, Trajectory]) -> None:
    """While an action holds every core, the files API still answers: it runs no command
    and waits in no queue."""
    _, t = box
    client = t.client
    hold = ["sh", "-c", "touch started; sleep 60"]

    pool = ThreadPoolExecutor(1)
    holder = pool.submit(client.exec, t.id, hold, cores=len(CORES), idempotency_key="hold")
    try:
        until(lambda: t.files.exists("started"), "the holding action started")
        t.files.write("during.txt", "written while every core is held")
        assert t.files.read_text("during.txt") == "written while every core is held"
        assert not holder.done()
    finally:
        client.cancel("key:hold")
        holder.result(30)
        pool.shutdown()


def test_a_write_cut_off_midway_leaves_neither_the_file_nor_a_temporary(
    execd: Built, tmp_path: Path
) -> None:
    """The environment side alone: the data stops before its end (the client went away),
    and the server removes what it had written; the old file stays whole."""
    assert execd.path is not None
    root = tmp_path / "env"
    root.mkdir()
    (root / "f").write_bytes(b"old")
    files = EnvFiles(one_shot(execd.path, root), "/")

    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 100_000
        raise ConnectionResetError("the client went away")

    async def scenario() -> None:
        with pytest.raises(ConnectionResetError):
            await files.write("/f", broken())
        await asyncio.gather(*env_files._servers)  # the one-shot server saw the end: gone

    asyncio.run(scenario())
    assert sorted(os.listdir(root)) == ["f"]
    assert (root / "f").read_bytes() == b"old"


def test_remove_takes_symlinks_away_never_what_they_point_to(execd: Built, tmp_path: Path) -> None:
    assert execd.path is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    root = tmp_path / "env"
    (root / "tree" / "deep").mkdir(parents=True)
    (root / "tree" / "deep" / "f").write_text("x")
    (root / "tree" / "out").symlink_to(outside)  # a link inside the tree to outside it
    (root / "link").symlink_to(outside)
    files = EnvFiles(one_shot(execd.path, root), "/")

    async def scenario() -> None:
        await files.remove("/tree")
        await files.remove("/link")

    asyncio.run(scenario())
    assert os.listdir(root) == []
    assert (outside / "precious").read_text() == "keep"


def test_a_fifo_is_refused_not_read_forever(execd: Built, tmp_path: Path) -> None:
    assert execd.path is not None
    os.mkfifo(tmp_path / "pipe")
    files = EnvFiles(one_shot(execd.path, tmp_path), "/")
    with pytest.raises(FileError) as refused:
        asyncio.run(files.read("/pipe"))
    assert refused.value.errno == errno.EINVAL


def test_dotdot_is_refused_by_the_server_itself_for_every_path(
    execd: Built, tmp_path: Path
) -> None:
    """The exec server refuses a '..' component before any lookup (the agent does too,
    but the server is the boundary), in a rename's target as well."""
    assert execd.path is not None
    (tmp_path / "a").mkdir()
    connect = one_shot(execd.path, tmp_path)

    async def ask(op: str, path: str, arg: str = "") -> bytes:
        chan = await connect()
        try:
            await chan.ask_files(op, path, arg)
            kind, data = await chan.frame()
            return kind + b" " + data
        finally:
            chan.close()

    async def scenario() -> list[bytes]:
        return [await ask("stat", "/a/.."), await ask("rename", "/a", "/a/../b")]

    for answer in asyncio.run(scenario()):
        assert answer.startswith(b"Z %d " % errno.EPERM), answer
