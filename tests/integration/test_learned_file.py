"""What the scheduler learned survives its restart: saved to a file while it runs and when
it stops, read back by the next one; a file that cannot be read is moved aside."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tangram.api.learned import LearnedState
from tangram.cli.files import InputError
from tangram.cli.serve import _learned_configmap
from tangram.cli.up import learned_file
from tangram.client import ActionStatus, Client
from tangram.node_agent.agent import NodeAgent
from tangram.scheduler import SchedulerConfig
from tangram.service.auth import TokenStore
from tangram.service.config import PoolConfig
from tangram.service.engine import Engine
from tangram.service.learned_file import LearnedFile, read_state

from .service_harness import service
from .test_service import CONFIG

pytestmark = [pytest.mark.xdist_group("service")]


def _agent(state: Path) -> NodeAgent:
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    return NodeAgent.create(state, runtime="process", idle_cores=1)


def test_a_restarted_scheduler_resumes_what_the_last_one_learned(tmp_path: Path) -> None:
    saved, tokens = tmp_path / "learned" / "pool.json", TokenStore.create(tmp_path / "tokens")
    first = LearnedFile(saved)
    with (
        service(CONFIG, _agent(tmp_path / "a"), tmp_path, tokens=tokens, learned=first) as (
            running,
            token,
        ),
        Client(running.url, token) as c,
        c.trajectory("shell") as t,
    ):
        for _ in range(3):
            assert t.exec(["true"], action_type="probe").status is ActionStatus.OK
    learned = LearnedState.model_validate_json(saved.read_bytes())  # saved at its stop
    assert learned.profiles["probe"].n == 3 and learned.profiles["probe"].counts == [1]
    assert learned.lengths == [3]  # the trajectory closed after three steps
    assert learned.think_s.seen == 2 and learned.exec_run_s.seen == 3
    with service(
        CONFIG, _agent(tmp_path / "b"), tmp_path, tokens=tokens, learned=LearnedFile(saved)
    ) as (
        again,
        _,
    ):
        assert again.engine.core.learned() == learned
        assert again.engine.learned_note() == (
            f"learned state: {saved}, resumed (action types: 1, trajectory lengths: 1)"
        )


def test_it_saves_while_it_runs_so_a_killed_scheduler_loses_little(tmp_path: Path) -> None:
    store = LearnedFile(tmp_path / "learned.json")

    async def go() -> LearnedState:
        engine = Engine(PoolConfig())
        assert not engine.keep_learned(store, every_s=0.01)  # nothing saved yet
        await engine.start()
        engine.core.book.observe("probe", 2, 3.0)
        async with asyncio.timeout(30):  # the periodic save, not a stop, writes it
            while not store.path.exists() or "probe" not in store.path.read_text():
                await asyncio.sleep(0.01)
        on_disk = read_state(store)
        assert on_disk is not None
        written = store.path.stat().st_ino  # each save is a new file renamed over the last
        for _ in range(3):  # saves with nothing new learned write nothing
            await engine.save_learned()
        assert store.path.stat().st_ino == written
        for t in engine._tasks:  # killed: no stop, no last save
            t.cancel()
        return on_disk

    on_disk = asyncio.run(go())
    assert on_disk.profiles["probe"].n == 1 and on_disk.profiles["probe"].counts == [2]
    # No temporary left; the lock file stays (removed, a waiting store could lock the old).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learned.json", "learned.json.lock"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "(document): Invalid JSON"),
        (json.dumps({"version": 9}), "version: Input should be 1"),
        (json.dumps({"lengths": [1, -2]}), "lengths.1: Input should be greater than or equal"),
    ],
)
def test_a_file_that_cannot_be_read_is_moved_aside_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, why: str
) -> None:
    path = tmp_path / "learned.json"
    path.write_text(text)
    caplog.set_level(logging.ERROR, "tangram.service")
    engine = Engine(PoolConfig())
    assert not engine.keep_learned(LearnedFile(path))
    assert not path.exists() and (tmp_path / "learned.json.bad").read_text() == text
    assert str(path) in caplog.text and why in caplog.text
    asyncio.run(engine.save_learned())  # the next save starts a new file beside it
    assert LearnedState.model_validate_json(path.read_bytes()) == LearnedState()


def test_a_number_the_core_cannot_use_is_set_aside_and_actions_then_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A trajectory length of 10**400 steps is an int, but ``shortest-remaining`` divides
    it into a float at each submission: resumed, it failed every exec (500) at every
    restart, and each stop saved it again. Out of range: set aside, the field named."""
    path, text = tmp_path / "learned.json", json.dumps({"version": 1, "lengths": [10**400, 3]})
    path.write_text(text)
    caplog.set_level(logging.ERROR, "tangram.service")
    config = replace(CONFIG, scheduling=SchedulerConfig(ordering="shortest-remaining"))
    with (
        service(config, _agent(tmp_path / "a"), tmp_path, learned=LearnedFile(path)) as (
            running,
            token,
        ),
        Client(running.url, token) as c,
        c.trajectory("shell") as t,
    ):
        assert running.engine.learned_note() == f"learned state: {path} (nothing to resume)"
        assert (tmp_path / "learned.json.bad").read_text() == text
        assert str(path) in caplog.text and "lengths.0: Input should be less than" in caplog.text
        for _ in range(2):
            assert t.exec(["true"]).status is ActionStatus.OK
    assert LearnedState.model_validate_json(path.read_bytes()).lengths == [2]  # saved anew


def test_the_flag_defaults_to_the_state_dir_and_an_empty_one_keeps_nothing() -> None:
    def given(value: str | None) -> Path | None:
        store = learned_file(argparse.Namespace(learned_file=value), "pool-a", "/var/state")
        return None if store is None else store.path

    assert given(None) == Path("/var/state/learned/pool-a.json")
    assert given("/x/l.json") == Path("/x/l.json")
    assert given("") is None


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ({"learned_configmap": "no-slash"}, "'no-slash' is not NAMESPACE/NAME"),
        ({"learned_configmap": "Bad_NS/x"}, "is not NAMESPACE/NAME"),
        ({"learned_configmap": "rl/x"}, "--learned-configmap needs --kubernetes"),
        ({"learned_configmap": "rl/x", "kubernetes": True, "learned_file": "/f"}, "not both"),
    ],
)
def test_the_configmap_flag_names_what_is_wrong(flags: dict[str, object], why: str) -> None:
    args = argparse.Namespace(**{"kubernetes": False, "learned_file": None, **flags})
    with pytest.raises(InputError, match=re.escape(why)):
        _learned_configmap(args)
    ok = argparse.Namespace(kubernetes=True, learned_file=None, learned_configmap="rl/p-learned")
    assert _learned_configmap(ok) == ("rl", "p-learned")


def test_a_store_that_cannot_be_read_is_not_saved_over_until_it_can(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store unreachable at start (an API server away, say) may hold a good state: the
    scheduler saves nothing over it, reads it again at each save, and resumes it then."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    store = LearnedFile(blocker / "learned.json")
    kept = LearnedState(lengths=[4, 9])
    caplog.set_level(logging.ERROR, "tangram.service")

    async def go() -> Engine:
        engine = Engine(PoolConfig())
        assert not engine.keep_learned(store)
        assert "(cannot be read: " in engine.learned_note()
        engine.core.book.observe("probe", 1, 2.0)
        await engine.save_learned()  # still unreadable: nothing written
        blocker.unlink()
        other = LearnedFile(store.path)  # a scheduler that could, saved, and stopped
        other.write(kept.model_dump_json().encode())
        other.close()
        assert store.path.read_bytes() == kept.model_dump_json().encode()
        await engine.save_learned()  # read at last: resumed, then saved with what it learned
        return engine

    engine = asyncio.run(go())
    assert "saving nothing over it until it can be read" in caplog.text
    assert engine.resumed == kept and engine.core.lengths.lengths == [4, 9]
    saved = read_state(store)
    assert saved is not None and saved.lengths == [4, 9] and saved.profiles["probe"].n == 1
