"""What the agent and the scheduler keep on disk is their user's alone: files 0600, written
whole (a temporary file renamed over), in directories made 0700; the agent's state
directory is narrowed to 0700 when an earlier release left it 0755 (``mkdir(mode=0o700)``
leaves an existing one as it is), a directory a file is merely named in is not."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tangram.api.wire import AgentOpen, EnvSpec, TrajectoryMeta
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.key_journal import KeyJournal
from tangram.private_files import private_dir, write_private
from tangram.service.auth import TokenStore
from tangram.service.learned_file import LearnedFile


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _open_meta(state: Path) -> None:
    agent = NodeAgent.create(state, runtime="noop", cores_for_actions=1)
    meta = TrajectoryMeta(id="t1", tenant="alice", env="e")
    open_ = AgentOpen(rid=1, trajectory="t1", env=EnvSpec(name="e", image="i"), meta=meta)

    async def scenario() -> None:
        await agent.handle(open_)
        await agent.shutdown()

    asyncio.run(scenario())


# (the directory it writes in, relative to the test's, and what writes there)
WRITERS: dict[str, tuple[str, Callable[[Path], object]]] = {
    "learned store": ("learned", lambda d: LearnedFile(d / "pool.json").write(b"{}")),
    "journal append": ("state", lambda d: KeyJournal(d / "keys.journal").started("k")),
    "journal rewrite": ("state", lambda d: KeyJournal(d / "keys.journal").rewrite({}, {"k"})),
    "agent state dir": ("state", lambda d: NodeAgent.create(d, runtime="noop")),
    "agent meta": ("state/meta", lambda d: _open_meta(d.parent)),
    "token file": ("config", lambda d: TokenStore.create(d / "tokens")),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_directory_made_is_0700(tmp_path: Path, loose_umask: None, writer: str) -> None:
    where, write = WRITERS[writer]
    write(tmp_path / where)
    assert _mode(tmp_path / where) == 0o700


def test_the_agents_state_directory_an_earlier_release_left_0755_is_narrowed(
    tmp_path: Path, loose_umask: None
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "meta").mkdir(mode=0o755)  # (inside it: reached through it alone)
    _open_meta(state)
    assert _mode(state) == 0o700


@pytest.mark.parametrize("writer", ["learned store", "token file"])
def test_a_directory_a_file_is_named_in_is_left_as_it_is(
    tmp_path: Path, loose_umask: None, writer: str
) -> None:
    """``--learned-file /var/lib/pool.json``: /var/lib is not the scheduler's to narrow;
    the file itself is 0600."""
    where, write = WRITERS[writer]
    directory = tmp_path / where
    directory.mkdir(mode=0o755)
    write(directory)
    assert _mode(directory) == 0o755
    assert [_mode(f) for f in directory.iterdir() if not f.name.endswith(".lock")] == [0o600]


def test_only_the_directory_asked_for_is_narrowed(tmp_path: Path, loose_umask: None) -> None:
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o755)
    private_dir(parent / "a" / "b", narrow=True)
    assert _mode(parent) == 0o755 and _mode(parent / "a") == 0o755
    assert _mode(parent / "a" / "b") == 0o700


def test_a_mode_already_narrower_is_kept(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o500)
    private_dir(directory, narrow=True)
    assert _mode(directory) == 0o500  # narrowed, never widened


def test_a_shared_directory_is_left_as_it_is(tmp_path: Path) -> None:
    """A file named in /tmp (world-writable, sticky) or in another user's directory:
    the directory is not this program's to narrow."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    private_dir(sticky, narrow=True)
    write_private(sticky / "tokens", b"x")
    assert _mode(sticky) == 0o1777 and _mode(sticky / "tokens") == 0o600
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, os.geteuid() + 1, -1)
    private_dir(theirs, narrow=True)
    assert _mode(theirs) == 0o755


def test_a_file_is_written_whole_and_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_private(tmp_path / "d" / "f", [b"a", b"b"])
        write_private(tmp_path / "d" / "f", b"new")  # replaced
    finally:
        os.umask(old)
    assert (tmp_path / "d" / "f").read_bytes() == b"new"
    assert _mode(tmp_path / "d" / "f") == 0o600 and _mode(tmp_path / "d") == 0o700
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["f"]  # no temporary left


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_private(path, b"old")

    def chunks() -> Iterator[bytes]:
        yield b"half"
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space"):
        write_private(path, chunks())
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_the_token_file_is_never_written_over(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    TokenStore.create(path)
    text = path.read_text()
    with pytest.raises(FileExistsError):
        TokenStore.create(path)
    assert path.read_text() == text and [p.name for p in tmp_path.iterdir()] == ["tokens"]
    assert _mode(path) == 0o600


def test_only_the_learned_state_is_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each keeps the durability it had: the learned state (written every 30 s) reaches
    the disk before its rename; the journal and the agent's metadata (written at each
    keyed run, each environment) stay in the page cache, which outlives the agent."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    KeyJournal(tmp_path / "state" / "keys.journal").rewrite({}, {"k"})
    _open_meta(tmp_path / "state")
    TokenStore.create(tmp_path / "tokens")
    assert synced == []
    LearnedFile(tmp_path / "learned.json").write(b"{}")
    assert len(synced) == 1
