"""The files API end to end: the real client over HTTP, the service, a real agent over its
WebSocket, and the environment's own exec server doing each operation, in a Docker
container and in the process runtime's directory."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import hashlib
import io
import logging
import os
import random
import socket
import stat
import subprocess
import tarfile
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import pytest

from tangram.api.wire import AgentReply, FilesOutcome
from tangram.client import Client, TangramError
from tangram.client.sync import Trajectory
from tangram.node_agent import env_files
from tangram.node_agent.env_files import EnvFiles, FileError, one_shot
from tangram.node_agent.exec_server import Built

from .host_env import file_answer
from .service_harness import RUNTIMES, KeptRecords, box_pool, tar_of, until

T = TypeVar("T")

CORES = sorted(os.sched_getaffinity(0))
LIMIT = 64 << 20  # the pool's admission.maxFileBytes here


def _run(work: Awaitable[T]) -> T:
    """``asyncio.run`` of ``work``, then until the one-shot files servers it started have
    ended: its loop closes only then (asyncio's child watcher logs one it outlived)."""

    async def then_reaped() -> T:
        try:
            return await work
        finally:
            await env_files.one_shots_ended()

    return asyncio.run(then_reaped())


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
    with pytest.raises(TangramError) as e:  # a directory's spelling: it replaced "f"
        t.files.write("f/", b"gone?")
    assert (e.value.status, e.value.field) == (400, "path") and "end in '/'" in str(e.value)
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
    # A rename blames the path at fault: its target, leading out, or a directory in the way.
    t.files.write("mine", b"x")
    t.files.make_dir("full")
    t.files.write("full/f", b"x")
    t.files.make_dir("vacant")
    for target, status in (("esc/stolen", 403), ("full", 409)):
        source = "vacant" if target == "full" else "mine"
        refused = _refusal(lambda: t.files.rename(source, target))  # noqa: B023 (called now)
        assert (refused.status, refused.field) == (status, "to"), refused
        assert target in str(refused) and source not in str(refused), refused
    gone = _refusal(lambda: t.files.rename("nope", "there"))
    assert (gone.status, gone.field) == (404, "path") and "nope" in str(gone)
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

    _run(scenario())
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

    _run(scenario())
    assert os.listdir(root) == []
    assert (outside / "precious").read_text() == "keep"


def test_a_tree_deeper_than_the_server_descends_is_refused_saying_so(
    execd: Built, tmp_path: Path
) -> None:
    """Past 256 directory levels a remove and a tar stop with E2BIG (a limit, answered
    413) saying the tree is too deep: it was ELOOP, read as a symlink loop."""
    assert execd.path is not None
    root = tmp_path / "env"
    root.joinpath("t", *["d"] * 300).mkdir(parents=True)
    files = EnvFiles(one_shot(execd.path, root), "/")

    async def refusal(call: Any) -> FileError:
        with pytest.raises(FileError) as refused:
            await call()
        return refused.value

    async def tar_all() -> None:
        _, data = await files.tar("/t")
        async for _ in data:
            pass

    async def scenario() -> list[FileError]:
        return [await refusal(lambda: files.remove("/t")), await refusal(tar_all)]

    for refused in _run(scenario()):
        assert refused.errno == errno.E2BIG, refused
        assert "deeper than 256 directory levels" in str(refused), refused
    assert (root / "t").is_dir()  # (a remove unlinks bottom up: it failed before any)


@pytest.mark.parametrize("kind", ["symlink", "hard link to a symlink"])
def test_a_symlink_deeper_than_the_server_judges_is_refused_as_too_deep(
    execd: Built, tmp_path: Path, kind: str
) -> None:
    """Where a symlink member's target leads is judged by its directory's depth, which
    the server counts to 256 levels: deeper, the member is refused saying so (it was
    called a symlink leading out of the destination; a hard link to a symlink, landing
    that deep, was too). A file that deep is extracted."""
    assert execd.path is not None
    deep = "/".join(["d"] * 300)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        member = tarfile.TarInfo(f"{deep}/f")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"x"))
        link = tarfile.TarInfo(f"{deep}/link")
        link.type, link.linkname = tarfile.SYMTYPE, "f"
        if kind != "symlink":  # a shallow symlink, then a hard link to it that deep
            shallow = tarfile.TarInfo("s")
            shallow.type, shallow.linkname = tarfile.SYMTYPE, "f"
            tar.addfile(shallow)
            link.type, link.linkname = tarfile.LNKTYPE, "s"
        tar.addfile(link)
    (tmp_path / "env" / "dst").mkdir(parents=True)
    files = EnvFiles(one_shot(execd.path, tmp_path / "env"), "/")

    async def body() -> AsyncIterator[bytes]:
        yield buffer.getvalue()

    with pytest.raises(FileError) as refused:
        _run(files.untar("/dst", body()))
    assert refused.value.errno == errno.E2BIG, refused.value
    assert f"member {deep}/link: the tree is deeper than 256" in str(refused.value)
    assert (tmp_path / "env" / "dst" / deep / "f").read_bytes() == b"x"


def test_a_rename_across_file_systems_says_so_naming_both_paths(
    execd: Built, tmp_path: Path
) -> None:
    """renameat's EXDEV (a volume mounted inside) is not a symlink leading out."""
    assert execd.path is not None
    if os.geteuid() != 0:
        pytest.skip("mounting a file system inside the environment needs root")
    root = tmp_path / "env"
    (root / "vol").mkdir(parents=True)
    (root / "f").write_text("x")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / "vol")], check=True)
    try:
        files = EnvFiles(one_shot(execd.path, root), "/")
        with pytest.raises(FileError) as refused:
            _run(files.rename("/f", "/vol/f"))
    finally:
        subprocess.run(["umount", str(root / "vol")], check=True)
    assert refused.value.errno == errno.EXDEV
    assert str(refused.value) == (
        "rename /f to /vol/f: they are on different file systems (a volume): copy, then remove"
    )


def test_a_fifo_is_refused_not_read_forever(execd: Built, tmp_path: Path) -> None:
    """Saying why: it was a bare "Invalid argument"."""
    assert execd.path is not None
    os.mkfifo(tmp_path / "pipe")
    files = EnvFiles(one_shot(execd.path, tmp_path), "/")
    with pytest.raises(FileError) as refused:
        _run(files.read("/pipe"))
    assert refused.value.errno == errno.EINVAL
    assert str(refused.value) == (
        "read /pipe: not a regular file: it is a FIFO, whose read may block or never end: "
        "read it with a command"
    )


def _specials(root: Path) -> list[str]:
    """A FIFO, a socket and (where the test may make one) a character device, /dev/null's
    numbers, in ``root``: their names."""
    os.mkfifo(root / "fifo")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(root / "sock"))
    listening.close()  # (the socket file stays)
    names = ["fifo", "sock"]
    with contextlib.suppress(PermissionError):  # mknod needs CAP_MKNOD
        os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        names.append("null")
    return names


def _kinds(root: Path) -> dict[str, int]:
    return {name: stat.S_IFMT(os.lstat(root / name).st_mode) for name in os.listdir(root)}


def test_a_device_fifo_or_socket_is_never_replaced_by_a_write_a_tar_or_a_rename(
    execd: Built, tmp_path: Path
) -> None:
    """A write's temporary file renamed over a device made it a regular file (/dev/null,
    and every "> /dev/null" of the sandbox after it, wrote into it): a device, FIFO or
    socket at the path, or where a symlink at it leads (E2B's writes go through one), is
    refused before anything is made, as is a tar member or a rename that would replace
    one."""
    assert execd.path is not None
    root = tmp_path / "env"
    root.mkdir()
    names = _specials(root)
    (root / "to-fifo").symlink_to("fifo")
    (root / "f").write_text("f")
    before = _kinds(root)
    files = EnvFiles(one_shot(execd.path, root), "/")
    what = {"fifo": "a FIFO", "sock": "a socket", "null": "a character device"}

    async def data() -> AsyncIterator[bytes]:
        yield b"hello"

    async def refusal(call: Awaitable[object]) -> str:
        with pytest.raises(FileError) as refused:
            await call
        assert refused.value.errno == errno.EINVAL, refused.value
        return str(refused.value)

    async def body(tar: bytes) -> AsyncIterator[bytes]:
        yield tar

    async def scenario() -> list[tuple[str, str]]:
        said = []
        keep = 0o644 | env_files.KEEP_MODE  # (E2B's write: through a symlink at the path)
        for name in names:
            it = f"not a regular file: it is {what[name]}"
            for mode in (0o644, keep):
                wrote = await refusal(files.write(f"/{name}", data(), mode))
                said.append((f"write /{name}: {it}", wrote))
            said.append((f"rename to /{name}: {it}", await refusal(files.rename("/f", f"/{name}"))))
            for kind, content in ((tarfile.REGTYPE, b"x"), (tarfile.SYMTYPE, "f"),
                                  (tarfile.LNKTYPE, "f")):  # fmt: skip
                untarred = await refusal(files.untar("/", body(tar_of((name, kind, content)))))
                said.append((f"untar /: member {name}: {it}", untarred))
        through = await refusal(files.write("/to-fifo", data(), keep))
        said.append(("write /to-fifo: not a regular file: it leads to a FIFO", through))
        return said

    for want, got in _run(scenario()):
        assert got.startswith(want), (want, got)
    assert _kinds(root) == before  # each still what it was, and no temporary left
    assert (root / "f").read_text() == "f"


def test_dotdot_is_refused_by_the_server_itself_for_every_path(
    execd: Built, tmp_path: Path
) -> None:
    """The exec server refuses a '..' component before any lookup (the agent does too,
    but the server is the boundary), in a rename's target as well."""
    assert execd.path is not None
    (tmp_path / "a").mkdir()
    connect = one_shot(execd.path, tmp_path)

    async def ask(op: str, path: str, arg: str = "") -> bytes:
        return await file_answer(await connect(), op, path, arg)

    async def scenario() -> list[bytes]:
        return [await ask("stat", "/a/.."), await ask("rename", "/a", "/a/../b")]

    for answer in _run(scenario()):
        assert answer.startswith(b"Z %d " % errno.EPERM), answer


# --- a directory as one tar stream -----------------------------------------------------


def _tree(root: Path) -> int:
    """A source tree with what a repository holds: nested directories, an executable, an
    empty file, a file of several link chunks, a name longer than ustar's 100 bytes, a
    non-ASCII name, a relative symlink and a hard link; its bytes of file content."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("print('mod')\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").write_bytes(b"")
    (root / "pkg" / "sub" / "big.bin").write_bytes(random.Random(3).randbytes(3 << 20))
    deep = root / ("d" * 90) / ("n" * 80 + ".txt")
    deep.parent.mkdir()
    deep.write_text("long\n")
    (root / "données.txt").write_text("é\n")
    (root / "latest").symlink_to("pkg/mod.py")
    os.link(root / "pkg" / "mod.py", root / "hard.py")
    files = [p.stat() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum({f.st_ino: f.st_size for f in files}.values())  # a hard link's bytes once


def _snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Each member under ``root``: its kind, permission bits and content (a symlink's
    target)."""
    seen: dict[str, tuple[str, int, bytes]] = {}
    for path in sorted(root.rglob("*")):
        rel, mode = str(path.relative_to(root)), path.lstat().st_mode & 0o777
        if path.is_symlink():
            seen[rel] = ("symlink", 0, os.readlink(path).encode())
        elif path.is_dir():
            seen[rel] = ("dir", mode, b"")
        else:
            seen[rel] = ("file", mode, path.read_bytes())
    return seen


def test_a_directory_round_trips_as_one_tar(box: tuple[str, Trajectory], tmp_path: Path) -> None:
    kind, t = box
    src = tmp_path / "src"
    size = _tree(src)
    done = t.files.upload_dir(src, "repo/checkout")  # gzipped; made with its parent
    assert (done.members, done.size) == (len(_snapshot(src)), size)
    assert t.exec(["sh", "-c", "./repo/checkout/run.sh"]).stdout == "run\n"
    linked = t.exec(["cat", "repo/checkout/latest", "repo/checkout/hard.py"]).stdout
    assert linked == "print('mod')\n" * 2
    back = t.files.download_dir("repo/checkout", tmp_path / "back")
    assert _snapshot(back) == _snapshot(src)
    # A plain tar merges into what is there; the tar of a subdirectory names its members
    # relative to it.
    extra = io.BytesIO()
    with tarfile.open(fileobj=extra, mode="w") as tar:
        member = tarfile.TarInfo("pkg/new.py")
        member.size = 4
        tar.addfile(member, io.BytesIO(b"new\n"))
    assert t.files.write_tar(f"{_workdir(kind)}/repo/checkout", extra.getvalue()).members == 1
    with tarfile.open(fileobj=io.BytesIO(t.files.read_tar("repo/checkout/pkg"))) as tar:
        assert sorted(tar.getnames()) == ["mod.py", "new.py", "sub", "sub/big.bin"]
    assert t.files.read_text("repo/checkout/run.sh").startswith("#!/bin/sh")


@pytest.mark.parametrize("kind", RUNTIMES)
def test_a_directory_of_any_name_downloads_as_a_tar_leaving_no_stream_open(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    with (
        box_pool(request, kind, tmp_path) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        tars = f"{running.url}/v1/trajectories/{t.id}/files/tar"
        names = {"数据": "__", "a\nb": "a_b", 'say "hi"\\': "say _hi__"}  # and the fallback
        for name, plain in names.items():
            t.files.make_dir(name)
            t.files.write(f"{name}/x.txt", b"x")
            got = httpx.get(tars, params={"path": name}, timeout=30,
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert got.status_code == 200, got.text
            with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
                assert tar.getnames() == ["x.txt"]
            assert got.headers["content-disposition"] == (
                f"attachment; filename=\"{plain}.tar\"; filename*=UTF-8''{quote(name, safe='')}.tar"
            )
        links = running.engine.state.hub.links.values()
        until(lambda: not any(link._streams for link in links), "the agent streams closed")


def test_tar_members_that_would_leave_the_directory_are_refused_naming_them(
    box: tuple[str, Trajectory],
) -> None:
    _, t = box
    t.files.make_dir("dst")
    t.exec(["ln", "-s", "..", "dst/up"])  # already there: a way out of the destination
    refused = {
        "a/../../evil": tar_of(("a/../../evil", tarfile.REGTYPE, b"x")),
        "esc": tar_of(("esc", tarfile.SYMTYPE, "/etc")),
        "d/climb": tar_of(("d/climb", tarfile.SYMTYPE, "../../x")),
        "up/evil": tar_of(("up/evil", tarfile.REGTYPE, b"x")),
        "hard": tar_of(("hard", tarfile.LNKTYPE, "up/dst")),
    }
    for name, data in refused.items():
        refusal = _refusal(lambda data=data: t.files.write_tar("dst", data))
        assert (refusal.status, refusal.field) == (403, "path"), refusal
        assert f"member {name}:" in str(refusal)
    assert not t.files.exists("evil") and not t.files.exists("dst/esc")
    device = _refusal(lambda: t.files.write_tar("dst", tar_of(("tty", tarfile.CHRTYPE, b""))))
    assert device.status == 400 and "devices" in str(device)
    # The members before a refused one are in, whole; a symlink that stays inside is kept.
    kept = tar_of(("ok.txt", tarfile.REGTYPE, b"ok"), ("d/in", tarfile.SYMTYPE, "../ok.txt"))
    assert t.files.write_tar("dst", kept).members == 2
    assert t.files.read_text("dst/d/in") == "ok"


def test_a_body_that_is_no_tar_and_a_tar_of_no_directory_are_refused(
    box: tuple[str, Trajectory],
) -> None:
    """A body that is no tar is the body's fault (400 naming ``body``, as one that is no
    gzip is; they named ``path``) and changes nothing: the destination is made only once
    the body's first header is read whole and valid (it was made, with its parents,
    before the body was read). An empty tar, its end blocks alone, makes it."""
    _, t = box
    for body, why in (
        (b"", "the body is empty, not a tar"),
        (b"not a tar", "the tar ends inside a header"),
        (b"x" * 1024, "not a tar: a header's checksum is wrong"),
        (b"this is not a tar" * 64, "checksum"),
        (_pax(b"\n" * 10 + b"3 " + b"a" * 20, tar_of()), "an extended header is malformed"),
    ):
        refusal = _refusal(lambda body=body: t.files.write_tar("d_empty/sub", body))
        assert (refusal.status, refusal.field) == (400, "body"), refusal
        assert why in str(refusal), refusal
        assert not t.files.exists("d_empty"), why
    for body, why in (
        (tar_of(("t", tarfile.REGTYPE, bytes(5000)))[:2048], "ends inside"),
        (gzip.compress(tar_of(("t", tarfile.REGTYPE, b"t")))[:-12], "gzip"),
    ):
        refusal = _refusal(lambda body=body: t.files.write_tar("dst", body))
        assert (refusal.status, refusal.field) == (400, "body"), refusal
        assert why in str(refusal), refusal
    assert t.files.write_tar("d_empty/sub", tar_of()).members == 0
    assert t.files.stat("d_empty/sub").type == "dir"
    too_large = _refusal(lambda: t.files.write_tar("dst", bytes(LIMIT + 1)))
    assert too_large.status == 413
    t.files.write("file", b"x")
    assert _refusal(lambda: t.files.read_tar("file")).status == 400  # not a directory
    assert _refusal(lambda: t.files.read_tar("nowhere")).status == 404


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_exec_server_reads_every_common_tar_format(
    execd: Built, tmp_path: Path, fmt: int
) -> None:
    """ustar (its name prefix), GNU (long names in 'L' members) and pax (path records):
    what tarfile, GNU tar and bsdtar write. Modes as the tar says, but set-id bits
    dropped, and a read-only directory made read-only only once its members are in."""
    assert execd.path is not None
    src, root = tmp_path / "src", tmp_path / "env"
    root.mkdir()
    _tree(src)
    if fmt == tarfile.USTAR_FORMAT:  # ustar holds no non-ASCII name
        (src / "données.txt").unlink()
    (src / "ro").mkdir()
    (src / "ro" / "f").write_text("in a read-only directory")
    (src / "ro").chmod(0o555)
    (src / "setuid").write_text("x")
    (src / "setuid").chmod(0o4755)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        tar.add(src, arcname=".")
    data = out.getvalue()
    files = EnvFiles(one_shot(execd.path, root), "/")

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 6000):  # members cut across pieces
            yield data[start : start + 6000]

    _run(files.untar("/dst", pieces()))
    assert _snapshot(root / "dst") == _snapshot(src)  # "ro" is read-only, "ro/f" in it
    assert (root / "dst" / "setuid").stat().st_mode & 0o7777 == 0o755


def test_a_directory_tar_keeps_symlinks_and_leaves_out_what_has_no_content(
    execd: Built, tmp_path: Path
) -> None:
    """Symlinks are members, never followed (one leading out of the environment is
    carried as it is written); a FIFO is left out, not read forever."""
    assert execd.path is not None
    (tmp_path / "env" / "d").mkdir(parents=True)
    (tmp_path / "env" / "d" / "out").symlink_to("/etc")
    os.mkfifo(tmp_path / "env" / "d" / "pipe")
    (tmp_path / "env" / "d" / "f").write_bytes(b"")
    files = EnvFiles(one_shot(execd.path, tmp_path / "env"), "/")

    async def scenario() -> bytes:
        entry, data = await files.tar("/d")
        assert (entry.name, entry.type) == ("d", "dir")
        return b"".join([piece async for piece in data])

    with tarfile.open(fileobj=io.BytesIO(_run(scenario()))) as tar:
        found = {m.name: (m.type, m.linkname, m.size) for m in tar.getmembers()}
    assert found == {"f": (tarfile.REGTYPE, "", 0), "out": (tarfile.SYMTYPE, "/etc", 0)}


def test_a_symlink_through_dotdot_resolves_while_the_system_renames(
    execd: Built, tmp_path: Path
) -> None:
    """openat2 refuses a '..' with EAGAIN when any rename on the system races it (it
    cannot vouch the '..' stayed inside); the server tries again, so a busy machine does
    not fail reads through such symlinks."""
    assert execd.path is not None
    root = tmp_path / "env"
    (root / "d").mkdir(parents=True)
    (root / "ok.txt").write_text("ok")
    (root / "d" / "in").symlink_to("../ok.txt")
    files = EnvFiles(one_shot(execd.path, root), "/")
    stop = threading.Event()

    def rename_all_the_time() -> None:
        a, b = tmp_path / "a", tmp_path / "b"
        a.touch()
        while not stop.is_set():
            a.rename(b)
            b.rename(a)

    async def reads() -> list[bytes]:
        got = []
        for _ in range(200):
            _, data = await files.read("/d/in")
            got.append(b"".join([piece async for piece in data]))
        return got

    renamer = threading.Thread(target=rename_all_the_time)
    renamer.start()
    try:
        assert _run(reads()) == [b"ok"] * 200
    finally:
        stop.set()
        renamer.join()


def _pax(records: bytes, then: bytes) -> bytes:
    """A tar whose first member is a pax header of ``records`` as they are, then ``then``."""
    head = tarfile.TarInfo("././@PaxHeader")
    head.type, head.size = tarfile.XHDTYPE, len(records)
    block = head.tobuf(tarfile.USTAR_FORMAT)
    return block + records + bytes(-len(records) % 512) + then


def test_crafted_tars_are_refused_and_leave_nothing_astray(execd: Built, tmp_path: Path) -> None:
    """What a review found: a symlink climbing out through another symlink, a hard link
    to itself, a malformed pax record and a size past any real one."""
    assert execd.path is not None
    (tmp_path / "env").mkdir()
    files = EnvFiles(one_shot(execd.path, tmp_path / "env"), "/")
    huge = b"%d size=%d\n" % (len(b" size=18446744073709551615\n") + 2, 2**64 - 1)
    cases = {
        "l": tar_of(("s", tarfile.SYMTYPE, "."), ("l", tarfile.SYMTYPE, "s/..")),
        "s/in": tar_of(("s", tarfile.SYMTYPE, "."), ("s/in", tarfile.SYMTYPE, "../x")),
        "pax": _pax(b"\n" * 10 + b"3 " + b"a" * 20, tar_of()),
        "size": _pax(huge, tar_of(("dd", tarfile.DIRTYPE, b""))),
    }

    async def untar(data: bytes) -> int | str:
        async def body() -> AsyncIterator[bytes]:
            yield data

        try:
            return (await files.untar("/dst", body()))[0]
        except FileError as e:
            return f"{e.errno} {e}"

    for name, data in cases.items():
        answer = str(_run(untar(data)))
        if name in ("pax", "size"):  # the body's fault: no tar
            assert answer.startswith(f"{errno.EBADMSG} "), answer
        else:
            assert answer.startswith(f"{errno.EXDEV} ") and f"member {name}:" in answer, answer
    itself = tar_of(("a", tarfile.REGTYPE, b"hi"), ("a", tarfile.LNKTYPE, "a"))
    assert _run(untar(itself)) == 2
    assert sorted(os.listdir(tmp_path / "env" / "dst")) == ["a", "s"]  # no temporary left


# --- bounds and refusals the probes found ----------------------------------------------


def test_a_directory_too_large_for_one_listing_is_a_413_naming_it(
    box: tuple[str, Trajectory], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stops listing at its bounds (entries, and their bytes in the reply) and
    says which directory and which bound, rather than send a reply its link cannot carry
    (which would drop the link, and every command of the node with it). Small bounds here:
    the real ones are checked below on the exec server alone."""
    _, t = box
    t.exec(["sh", "-c", "mkdir many && cd many && touch $(seq 21)"])
    monkeypatch.setattr(env_files, "MAX_LIST", 20)
    by_count = _refusal(lambda: t.files.list("many"))
    assert (by_count.status, by_count.code, by_count.field) == (413, "too_large", "path")
    assert "many: the directory holds over 20 entries" in str(by_count)
    monkeypatch.setattr(env_files, "MAX_LIST", 100)
    monkeypatch.setattr(env_files, "MAX_LIST_BYTES", 2000)  # a few entries' worth
    by_bytes = _refusal(lambda: t.files.list("many"))
    assert by_bytes.status == 413 and "many: the directory holds over" in str(by_bytes)
    monkeypatch.setattr(env_files, "MAX_LIST_BYTES", 1 << 20)
    assert len(t.files.list("many")) == 21
    assert t.exec(["echo", "the node is still there"]).stdout == "the node is still there\n"


def test_a_listing_is_held_to_what_one_reply_carries_at_the_real_bounds(
    execd: Built, tmp_path: Path
) -> None:
    """Names of 255 bytes that JSON escapes six-fold make each entry about 3 KiB in the
    reply: the listing is refused by its bytes (16 MiB), long before its count (100,000),
    and what it would answer at the bound fits one frame of the agent's link (64 MiB)."""
    assert execd.path is not None
    many = tmp_path / "many"
    many.mkdir()
    for i in range(6000):
        name = f"{i:05d}".encode() + b"\x01" * 250
        os.close(os.open(os.fsencode(many) + b"/" + name, os.O_CREAT | os.O_WRONLY, 0o644))
    files = EnvFiles(one_shot(execd.path, tmp_path), "/")
    with pytest.raises(FileError) as refused:
        _run(files.list("/many"))
    assert refused.value.errno == errno.E2BIG and "/many: " in str(refused.value)
    for extra in os.listdir(many)[5000:]:
        os.unlink(many / extra)
    kept = _run(files.list("/many"))
    reply = AgentReply(rid=1, ok=True, files=FilesOutcome(entries=kept)).model_dump_json()
    assert 0.9 * env_files.MAX_LIST_BYTES < len(reply) < 64 << 20  # (near the bound)


def test_a_gzipped_tar_is_held_to_the_file_limit_once_inflated(
    box: tuple[str, Trajectory],
) -> None:
    """A few hundred KiB of gzip may inflate to any size: the tar as inflated counts
    against admission.maxFileBytes, as a plain one does as sent."""
    _, t = box
    bomb = io.BytesIO()
    with gzip.GzipFile(fileobj=bomb, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        member = tarfile.TarInfo("zeros.bin")
        member.size = LIMIT + 1
        tar.addfile(member, io.BytesIO(bytes(member.size)))
    assert len(bomb.getvalue()) < LIMIT // 100
    refused = _refusal(lambda: t.files.write_tar("bomb", bomb.getvalue()))
    assert (refused.status, refused.field) == (413, "body"), refused
    assert "once inflated" in str(refused)
    assert not t.files.exists("bomb/zeros.bin")
    fine = gzip.compress(tar_of(("ok.txt", tarfile.REGTYPE, b"ok")))
    assert t.files.write_tar("bomb", fine).members == 1


def test_a_hard_link_to_a_symlink_is_judged_where_it_lands(execd: Built, tmp_path: Path) -> None:
    """A hard link to a symlink is the symlink again, elsewhere: one that stayed inside at
    its depth but would climb out from the link's is refused, naming the link."""
    assert execd.path is not None
    (tmp_path / "env").mkdir()
    files = EnvFiles(one_shot(execd.path, tmp_path / "env"), "/")

    async def untar(data: bytes) -> int | str:
        async def body() -> AsyncIterator[bytes]:
            yield data

        try:
            return (await files.untar("/", body()))[0]
        except FileError as e:
            return f"{e.errno} {e}"

    escape = tar_of(
        ("a/b/c", tarfile.DIRTYPE, b""),
        ("a/b/c/up", tarfile.SYMTYPE, "../../.."),  # the root, from a/b/c: inside
        ("up", tarfile.LNKTYPE, "a/b/c/up"),  # "../../.." from the root: out
    )
    answer = str(_run(untar(escape)))
    assert answer.startswith(f"{errno.EXDEV} ") and "member up: " in answer, answer
    assert not os.path.lexists(tmp_path / "env" / "up")
    assert sorted(os.listdir(tmp_path / "env")) == ["a"]  # no temporary left either
    same_depth = tar_of(("a/b/c/again", tarfile.LNKTYPE, "a/b/c/up"))
    assert _run(untar(same_depth)) == 1
    assert os.readlink(tmp_path / "env" / "a" / "b" / "c" / "again") == "../../.."


@pytest.mark.xdist_group("service")
def test_a_full_disk_is_a_507_not_a_413(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """No space left (a full disk, a quota) is no fault of the body's size: 507, code
    no_space, whatever the operation (here a write and a mkdir), naming the path."""
    with (
        box_pool(request, "process", tmp_path, max_file_bytes=LIMIT) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        small = tmp_path / "agent" / "trajectories" / t.id / "small"
        small.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=8", "tmpfs", str(small)]
        subprocess.run(mount, check=True, capture_output=True)
        try:
            full = _refusal(lambda: t.files.write("small/big.bin", bytes(200_000)))
            assert (full.status, full.code, full.field) == (507, "no_space", "path"), full
            assert "small/big.bin: the environment's disk is full" in str(full)
            with pytest.raises(TangramError) as no_inode:
                for i in range(100):
                    t.files.make_dir(f"small/d{i}")
            assert (no_inode.value.status, no_inode.value.code) == (507, "no_space")
        finally:
            subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize("kind", RUNTIMES)
def test_an_upload_cut_off_by_its_trajectorys_close_says_it_was_closed(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """It was a 502 ``failed`` with the agent's words, as if the node had broken; it is a
    409 naming the close, as a request sent after it is."""
    with (
        box_pool(request, kind, tmp_path) as (running, token),
        Client(running.url, token) as client,
    ):
        t = client.open("box")
        sent, go_on = threading.Event(), threading.Event()

        def body() -> Iterator[bytes]:
            yield b"x" * (1 << 20)
            sent.set()
            go_on.wait(30)
            yield b"y" * (1 << 20)

        def upload() -> httpx.Response:
            return httpx.put(
                f"{running.url}/v1/trajectories/{t.id}/files", params={"path": "f.bin"},
                content=body(), headers={"Authorization": f"Bearer {token}"}, timeout=60,
            )  # fmt: skip

        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(upload)
            assert sent.wait(30)
            until(lambda: running.engine.trajectories[t.id].transfers > 0, "under way")
            client.close(t.id)
            go_on.set()
            got = answer.result(60)
        assert got.status_code == 409, got.text
        assert f"{t.id} was closed during the request" in got.json()["error"]["message"]


# --- what an outside probe found: cut-off uploads, /proc and /sys, files that shrink ------


@contextlib.contextmanager
def _service_log() -> Iterator[list[logging.LogRecord]]:
    """What the running service logs at WARNING and above: uvicorn's records (its logger
    does not reach the root's) and the rest. (Made after the service started: uvicorn
    sets its loggers' handlers as it starts.)"""
    kept = KeptRecords()
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger()]
    for logger in loggers:
        logger.addHandler(kept)
    try:
        yield kept.records
    finally:
        for logger in loggers:
            logger.removeHandler(kept)


def _no_traceback(records: list[logging.LogRecord]) -> None:
    """At most one line, and no traceback (an unhandled exception's)."""
    lines = [r.getMessage() for r in records]
    assert len(records) <= 1, lines
    assert not any(r.exc_info for r in records), lines
    assert not any("Exception in ASGI application" in line for line in lines), lines


def _temporaries(t: Trajectory, name: str) -> list[str]:
    return [e.name for e in t.files.list(".") if e.name.startswith(f".{name}.tangram-")]


@pytest.mark.parametrize("kind", RUNTIMES)
def test_an_upload_the_client_cuts_off_keeps_the_old_file_and_logs_no_traceback(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """The client says 10 MB, sends 3 and closes: the old file stays, no temporary one is
    left, and the service handles it as a refusal of the body. It logged "Exception in
    ASGI application" with a traceback ending in starlette's ClientDisconnect."""
    with (
        box_pool(request, kind, tmp_path, max_file_bytes=LIMIT) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
        _service_log() as logged,
    ):
        t.files.write("f.bin", b"old")
        host, port = running.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(f"PUT /v1/trajectories/{t.id}/files?path=f.bin HTTP/1.1\r\nHost: {host}"
                      f"\r\nAuthorization: Bearer {token}\r\nContent-Length: 10000000\r\n\r\n"
                      .encode() + b"n" * 3_000_000)  # fmt: skip
            until(lambda: _temporaries(t, "f.bin") != [], "the write under way")
        until(lambda: _temporaries(t, "f.bin") == [], "the cut-off write dropped")
        assert t.files.read("f.bin") == b"old"
        _no_traceback(logged)


def _mounted(source: str, target: Path, *options: str) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def mount() -> Iterator[None]:
        target.mkdir()
        subprocess.run(["mount", *options, source, str(target)], check=True, capture_output=True)
        try:
            yield
        finally:
            subprocess.run(["umount", "-l", str(target)], check=False)

    return mount()


THP = "/sys/kernel/mm/transparent_hugepage/enabled"  # sysfs: 4096 bytes said, ~23 held


@pytest.mark.parametrize("kind", RUNTIMES)
def test_a_file_of_proc_or_sys_downloads_whole_with_its_real_size(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """/proc's files say they are empty and sysfs's that they hold 4096 bytes, whatever
    they hold: /proc/version was a 200 with an empty body, and the sysfs file promised
    4096 bytes and sent 23 (the client's read broke, the log got a traceback). Each is
    read whole, and its Content-Length is what it holds. (The process runtime's
    environment is its directory: /proc and /sys are mounted in it.)"""
    if not os.path.exists(THP):
        pytest.skip(f"no {THP} on this kernel")
    with (
        box_pool(request, kind, tmp_path) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
        contextlib.ExitStack() as mounts,
    ):
        if kind == "process":
            root = tmp_path / "agent" / "trajectories" / t.id
            mounts.enter_context(_mounted("proc", root / "proc", "-t", "proc"))
            mounts.enter_context(_mounted("/sys", root / "sys", "--bind"))
        seen = {}
        url, auth = (
            f"{running.url}/v1/trajectories/{t.id}/files",
            {"Authorization": f"Bearer {token}"},
        )
        with _service_log() as logged:
            for path in ("/proc/version", "/proc/self/status", "/proc/cpuinfo", THP):
                got = httpx.get(url, params={"path": path}, headers=auth, timeout=30)
                assert got.status_code == 200, got.text
                assert got.content and int(got.headers["content-length"]) == len(got.content)
                seen[path] = got.content
            _no_traceback(logged)
        assert seen["/proc/version"] == Path("/proc/version").read_bytes()  # the same kernel
        assert seen[THP] == Path(THP).read_bytes()
        assert seen["/proc/self/status"].startswith(b"Name:\t")


def test_the_exec_server_reads_a_file_whose_size_stat_cannot_tell_within_a_bound(
    execd: Built,
) -> None:
    """The server alone, on the host's root: a file of /proc (size 0) or sysfs (4096) is
    read whole, its entry saying the size read; one that holds more than 16 MiB (a
    process's pagemap holds gigabytes) is refused saying so, not read on and on."""
    assert execd.path is not None
    files = EnvFiles(one_shot(execd.path, Path("/")), "/")

    async def read(path: str) -> tuple[int, bytes]:
        entry, data = await files.read(path)
        return entry.size, b"".join([piece async for piece in data])

    for path in ("/proc/version", "/proc/self/status", *([THP] if os.path.exists(THP) else [])):
        size, got = _run(read(path))
        assert got and size == len(got), path
        if path != "/proc/self/status":  # (the server's own)
            assert got == Path(path).read_bytes()
    with pytest.raises(FileError) as refused:
        _run(read("/proc/self/pagemap"))
    assert refused.value.errno == errno.EFBIG
    assert "/proc/self/pagemap: its size is not known ahead" in str(refused.value)
    assert "over 16 MiB" in str(refused.value)


def test_a_file_that_shrinks_while_it_is_read_fails_never_ends_short(
    execd: Built, tmp_path: Path
) -> None:
    """Its entry said 16 MiB; truncated once its first chunk came (the server cannot have
    read more than two: it waits on a reader that has stopped), it ended short without a
    word (and the service's Content-Length was a lie). It fails, saying why."""
    assert execd.path is not None
    (tmp_path / "f").write_bytes(bytes(16 << 20))
    files = EnvFiles(one_shot(execd.path, tmp_path), "/")

    async def scenario() -> tuple[int, int, FileError]:
        entry, data = await files.read("/f")
        got = len(await anext(data))
        os.truncate(tmp_path / "f", 0)
        with pytest.raises(FileError) as refused:
            async for piece in data:
                got += len(piece)
        return entry.size, got, refused.value

    size, got, refused = _run(scenario())
    assert size == 16 << 20 and got < size
    assert refused.errno == errno.ESTALE and "/f: it shrank while it was read" in str(refused)


@pytest.mark.parametrize("kind", RUNTIMES)
def test_a_download_cut_short_breaks_the_response_and_logs_one_line(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """A file truncated during its download: the client was promised its size and gets
    less, so the connection is closed there (a broken download, never a short one taken
    for whole), and the log says so in one line; it got a RuntimeError's traceback
    ("Response content shorter than Content-Length"). The link's flow control keeps the
    server within a few tens of MiB of a reader that stopped: 256 MiB is never all read."""
    with (
        box_pool(request, kind, tmp_path) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        t.exec(["dd", "if=/dev/zero", "of=big", "bs=1M", "count=0", "seek=256"])
        url = f"{running.url}/v1/trajectories/{t.id}/files"
        with (
            _service_log() as logged,
            httpx.stream(
                "GET",
                url,
                params={"path": "big"},
                timeout=60,
                headers={"Authorization": f"Bearer {token}"},
            ) as got,  # fmt: skip
        ):
            assert got.headers["content-length"] == str(256 << 20)
            pieces = got.iter_raw()
            received = len(next(pieces))
            t.exec(["sh", "-c", ": > big"])
            with pytest.raises(httpx.RemoteProtocolError):
                for piece in pieces:
                    received += len(piece)
        assert received < 256 << 20
        _no_traceback(logged)
        (line,) = [r.getMessage() for r in logged]
        assert line.startswith(f"the download of big (trajectory {t.id}): cut short after"), line
        assert "it shrank while it was read" in line


@pytest.mark.xdist_group("service")
def test_a_download_that_ends_short_or_fails_at_once_is_answered_as_such(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an exec server that predates the fix answers: data that ends short of the size
    without a word is cut short by the service itself (one log line); and a read that
    fails before its first byte is an error answer of its own, not a 200 cut short."""
    real_read = EnvFiles.read
    ending = "short"

    async def read(self: EnvFiles, path: str) -> tuple[Any, AsyncGenerator[bytes, None]]:
        entry, data = await real_read(self, path)

        async def first_only() -> AsyncGenerator[bytes, None]:
            async with contextlib.aclosing(data):
                if ending == "at once":
                    raise FileError(errno.ESTALE, f"read {path}: it shrank while it was read")
                yield await anext(data)

        return entry, first_only()

    with (
        box_pool(request, "process", tmp_path) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        t.files.write("f", bytes(3 << 20))
        monkeypatch.setattr(EnvFiles, "read", read)
        url = f"{running.url}/v1/trajectories/{t.id}/files"
        auth = {"Authorization": f"Bearer {token}"}
        with _service_log() as logged:
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.get(url, params={"path": "f"}, headers=auth, timeout=30)
            _no_traceback(logged)
            (line,) = [r.getMessage() for r in logged]
            assert f"cut short: {1 << 20} of its {3 << 20} bytes came" in line, line
            ending = "at once"
            got = httpx.get(url, params={"path": "f"}, headers=auth, timeout=30)
            assert got.status_code == 409, got.text
            assert "it shrank while it was read" in got.json()["error"]["message"]
            assert len(logged) == 1  # (nothing more)


# Docker only: the process runtime's files server runs as the agent's user, root.
@pytest.mark.parametrize("kind", RUNTIMES[1:])
def test_a_tar_that_fails_at_once_is_an_error_answer_and_one_midway_is_cut_off(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """A member the environment's user cannot read: met before the tar's first piece
    went, the answer is the refusal itself (a 403), not a 200 cut short; met later, the
    download is cut off there, with one log line, not a traceback (it was one)."""
    with (
        box_pool(request, kind, tmp_path) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        make = ("mkdir a b && dd if=/dev/zero of=b/0big bs=1M count=3 && "
                "echo x | tee a/locked > b/locked && chmod 000 a/locked b/locked")  # fmt: skip
        made = t.exec(["sh", "-c", make])
        assert made.exit_code == 0, made
        url = f"{running.url}/v1/trajectories/{t.id}/files/tar"
        auth = {"Authorization": f"Bearer {token}"}
        with _service_log() as logged:
            at_once = httpx.get(url, params={"path": "a"}, headers=auth, timeout=30)
            assert at_once.status_code == 403, at_once.text
            assert "locked" in at_once.json()["error"]["message"]
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.get(url, params={"path": "b"}, headers=auth, timeout=30)
            _no_traceback(logged)
        (line,) = [r.getMessage() for r in logged]
        assert line.startswith(f"the tar of b (trajectory {t.id}): cut short after"), line


def _said(call: Any) -> tuple[int, str, str]:
    refused = _refusal(call)
    return refused.status, refused.field or "", str(refused)


# Docker only: /dev and /.tangram are a container's.
@pytest.mark.parametrize("kind", RUNTIMES[1:])
@pytest.mark.parametrize("user", ["0", None])
def test_dev_null_is_never_replaced_whatever_the_user(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path, user: str | None
) -> None:
    """A write to /dev/null replaced it with a regular file as root (and every "> /dev/null"
    of the sandbox wrote into it), and was a 403 for another user (its temporary could not
    be made in /dev): a 400 saying why for both, before anything is made; a tar member
    there likewise."""
    with (
        box_pool(request, kind, tmp_path, user=user) as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        assert t.exec(["mkfifo", "/tmp/ff"]).exit_code == 0
        for path, what in (("/dev/null", "a character device"), ("/tmp/ff", "a FIFO")):
            status, field, said = _said(lambda path=path: t.files.write(path, "hello"))
            assert (status, field) == (400, "path"), said
            assert f"{path}: not a regular file: it is {what}" in said
        tar = tar_of(("null", tarfile.REGTYPE, b"hello"))
        status, _, said = _said(lambda: t.files.write_tar("/dev", tar))
        assert status == 400 and "member null: not a regular file" in said, said
        kept = t.exec(["sh", "-c", "test -c /dev/null && test -p /tmp/ff && ls -A /dev /tmp"])
        assert kept.exit_code == 0 and ".tangram-" not in kept.stdout, kept  # no temporary


@pytest.mark.parametrize("kind", RUNTIMES[1:])
def test_the_reserved_tangram_directory_is_changed_by_no_file_operation(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """/.tangram holds the exec server's binary and socket: a remove of /.tangram/run took
    the socket first and was refused only at the mount after it (every command then failed
    with the sandbox running on). Every change there is refused up front, also reached
    through a symlink (by the exec server: the service sees only the link's path), as
    root; reads are served."""
    reserved = "/.tangram is reserved for the exec server (its binary and socket)"
    with (
        box_pool(request, kind, tmp_path, user="0") as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        t.files.write("f", "f")
        made = t.exec(["sh", "-c", "ln -s /.tangram/run r && ln -s / top"])
        assert made.exit_code == 0, made
        tar = tar_of(("x", tarfile.REGTYPE, b"x"))
        to = "to"  # (the field a rename's target is refused as)
        calls = [
            ("/.tangram/run", "path", lambda: t.files.remove("/.tangram/run")),
            ("/.tangram", "path", lambda: t.files.remove("/.tangram")),
            ("/./.tangram/run/exec.sock", "path",
             lambda: t.files.remove("/./.tangram/run/exec.sock")),
            ("/.tangram/run/x", "path", lambda: t.files.write("/.tangram/run/x", "x")),
            ("/.tangram/new", "path", lambda: t.files.make_dir("/.tangram/new")),
            ("/.tangram/run/exec.sock", "path",
             lambda: t.files.rename("/.tangram/run/exec.sock", "s")),
            ("/.tangram/run/f", to, lambda: t.files.rename("f", "/.tangram/run/f")),
            ("/.tangram/run/", "path", lambda: t.files.write_tar("/.tangram/run/", tar)),
            # Through symlinks: the exec server knows the directories themselves.
            ("remove /work/r/exec.sock", "path", lambda: t.files.remove("r/exec.sock")),
            ("rename /work/r/exec.sock", "path", lambda: t.files.rename("r/exec.sock", "s")),
            ("rename to /work/r/exec.sock", to, lambda: t.files.rename("f", "r/exec.sock")),
            ("write /work/r/y", "path", lambda: t.files.write("r/y", "y")),
            ("remove /work/top/.tangram", "path", lambda: t.files.remove("top/.tangram")),
        ]  # fmt: skip
        for path, field, call in calls:
            said = _said(call)
            assert said[:2] == (403, field) and f"{path}: {reserved}" in said[2], (path, said)
        assert t.exec(["true"]).exit_code == 0  # the socket is there: commands run
        assert {e.name for e in t.files.list("/.tangram")} >= {"run"}
        assert t.files.stat("/.tangram/run/exec.sock").type == "other"


@contextlib.contextmanager
def _as_uid_1000(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path, setup: str
) -> Iterator[Trajectory]:
    """A trajectory of a pool whose commands run as uid 1000, after ``setup`` (sh) ran."""
    with (
        box_pool(request, kind, tmp_path, user="1000") as (running, token),
        Client(running.url, token) as client,
        client.trajectory("box") as t,
    ):
        made = t.exec(["sh", "-c", setup])
        assert made.exit_code == 0, made
        yield t


@pytest.mark.parametrize("kind", RUNTIMES[1:])
def test_a_symlink_member_in_a_directory_that_cannot_be_entered_is_a_403(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """As uid 1000 (root enters any). It was a 413 "deeper than 256 directory levels": the
    step up that measures its depth failed, and was taken for depth. A file there is a
    403 too."""
    with _as_uid_1000(request, kind, tmp_path, "mkdir -p r2/locked && chmod 644 r2/locked") as t:
        for member in (("locked/l", tarfile.SYMTYPE, "x"), ("locked/f", tarfile.REGTYPE, b"x")):
            status, _, said = _said(lambda member=member: t.files.write_tar("r2", tar_of(member)))
            assert status == 403 and said.endswith(f"member {member[0]}: Permission denied"), said


@pytest.mark.parametrize("kind", RUNTIMES[1:])
def test_a_directory_that_cannot_be_read_is_there_to_make_and_write_in(
    request: pytest.FixtureRequest, kind: str, tmp_path: Path
) -> None:
    """As uid 1000 (root reads any). A directory that exists but may not be read was
    refused to a mkdir ("mkdir: Permission denied"; E2B's write to /root/x, which makes its
    parent first, said so), and one that may be written and searched could not be made
    in: a command can, so the files API does."""
    with _as_uid_1000(
        request, kind, tmp_path, "mkdir noread wo && chmod 000 noread && chmod 300 wo"
    ) as t:
        assert t.files.make_dir("noread") is False  # there already
        status, _, said = _said(lambda: t.files.write("noread/x", "x"))
        assert status == 403 and "write /work/noread/x: Permission denied" in said, said
        assert t.files.make_dir("wo/sub") is True
        assert t.files.write_tar("wo/t", tar_of(("a/l", tarfile.SYMTYPE, "b"))).members == 1
        seen = t.exec(["sh", "-c", "chmod 700 wo && ls wo wo/t/a"])
        assert seen.stdout == "wo:\nsub\nt\n\nwo/t/a:\nl\n", seen
