"""A learned-state file is one scheduler's at a time: two `tangram serve` pointed at one
file would each overwrite what the other learned. The second is refused, the file named,
and saves nothing over it until the first has let go."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tangram.api.learned import LearnedState
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedFile, read_state, write_state

ROOT = Path(__file__).resolve().parents[2]


def _refused(path: Path, pid: int) -> str:
    """What a store refused says (an OSError: to the engine, a store it cannot read)."""
    return re.escape(f"{path} is in use by another scheduler (pid {pid})")


def test_a_second_store_on_a_file_in_use_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "learned.json"
    first, second = LearnedFile(path), LearnedFile(path)
    write_state(first, LearnedState(lengths=[3]))
    for use in (second.read, lambda: second.write(b"{}"), lambda: second.set_aside(b"")):
        with pytest.raises(OSError, match=_refused(path, os.getpid())):
            use()
    assert read_state(first) == LearnedState(lengths=[3])  # nothing written over it
    first.close()
    assert read_state(second) == LearnedState(lengths=[3])
    with pytest.raises(OSError, match=_refused(path, os.getpid())):  # the second's now
        first.read()


def test_a_scheduler_in_another_process_is_named(tmp_path: Path) -> None:
    path = tmp_path / "learned" / "pool.json"
    holder = (
        "import sys; from pathlib import Path; from tangram.service.learned_file import "
        f"LearnedFile; store = LearnedFile(Path({str(path)!r})); store.read(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    paths = os.pathsep.join(str(ROOT / d) for d in ("scheduler", "operator", "node-agent"))
    with subprocess.Popen(
        [sys.executable, "-c", holder],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": paths},
    ) as other:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "held\n"
        with pytest.raises(OSError, match=_refused(path, other.pid)):
            LearnedFile(path).read()
        other.stdin.close()  # it ends: the kernel lets go of its lock
        assert other.wait() == 0
    store = LearnedFile(path)
    assert store.read() is None
    store.close()


def test_a_scheduler_refused_the_file_saves_nothing_over_it_and_resumes_it_when_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As `tangram serve` takes it: the start says why it has no learned state; each save
    tries again, and once the other scheduler stopped, resumes what it left."""
    path = tmp_path / "learned.json"
    other = LearnedFile(path)
    write_state(other, LearnedState(lengths=[4, 9]))
    caplog.set_level(logging.ERROR, "tangram.service")

    async def go() -> Engine:
        engine = Engine(PoolConfig())
        assert not engine.keep_learned(LearnedFile(path))
        note = engine.learned_note()
        assert note.startswith(f"learned state: {path} (cannot be read: ")
        assert "in use by another scheduler" in note
        engine.core.book.observe("probe", 1, 2.0)
        await engine.save_learned()  # still in use: nothing written
        assert read_state(other) == LearnedState(lengths=[4, 9])
        other.close()  # the other scheduler stopped
        await engine.save_learned()  # resumed, then saved with what it learned
        return engine

    engine = asyncio.run(go())
    assert "saving nothing over it until it can be read" in caplog.text
    assert engine.resumed == LearnedState(lengths=[4, 9])
    saved = LearnedState.model_validate_json(path.read_bytes())
    assert saved.lengths == [4, 9] and saved.profiles["probe"].n == 1


def test_naming_a_store_takes_nothing(tmp_path: Path) -> None:
    """The lock is taken on the first use: a store only named (the CLI's flag parsing)
    touches no file."""
    LearnedFile(tmp_path / "learned" / "pool.json")
    assert not (tmp_path / "learned").exists()
