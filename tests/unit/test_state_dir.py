"""An agent's state directory: one agent at a time (the CLI's agents), and what it keeps
there (commands' output, tenants) is its own to read."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from tangram.api.wire import AgentClose, AgentExec, AgentOpen, EnvSpec, TrajectoryMeta
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.execution import ExecError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_second_agent_on_a_state_directory_in_use_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = NodeAgent.create(state, runtime="noop", cores_for_actions=1, exclusive=True)
    with pytest.raises(ExecError, match=rf"--state-dir {state} is in use by another agent "
                       rf"\(pid {os.getpid()}\)"):  # fmt: skip
        NodeAgent.create(state, runtime="noop", cores_for_actions=1, exclusive=True)
    asyncio.run(first.shutdown())
    again = NodeAgent.create(state, runtime="noop", cores_for_actions=1, exclusive=True)
    asyncio.run(again.shutdown())


def test_what_an_agent_keeps_is_readable_by_it_alone(tmp_path: Path) -> None:
    state = tmp_path / "state"
    agent = NodeAgent.create(state, runtime="noop", cores_for_actions=1)
    meta = TrajectoryMeta(id="t1", tenant="alice", env="e")
    spec = EnvSpec(name="e", image="i")

    async def scenario() -> None:
        await agent.handle(AgentOpen(rid=1, trajectory="t1", env=spec, meta=meta))
        await agent.handle(AgentExec(rid=2, trajectory="t1", argv=["true"], cores=[0], key="k"))
        await agent.shutdown()

    asyncio.run(scenario())
    assert _mode(state) == 0o700 and _mode(state / "meta" / "t1.json") == 0o600
    assert _mode(state / "meta") == 0o700  # (its file names are the trajectories')
    NodeAgent.create(state, runtime="noop", cores_for_actions=1)  # rewrites its journal
    assert _mode(state / "keys.journal") == 0o600


def test_an_open_whose_metadata_cannot_be_kept_fails_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """The metadata not written (a full disk, here a directory where its file goes), the
    open failed after the environment was made, and each retry left one more behind."""
    agent = NodeAgent.create(tmp_path / "state", runtime="noop", cores_for_actions=1)
    assert agent.meta_dir is not None
    (agent.meta_dir / "t1.json").mkdir(parents=True)
    meta = TrajectoryMeta(id="t1", tenant="alice", env="e")
    open_ = AgentOpen(rid=1, trajectory="t1", env=EnvSpec(name="e", image="i"), meta=meta)
    reply = asyncio.run(agent.handle(open_))
    assert not reply.ok and reply.error is not None and "t1.json" in reply.error
    assert agent.runtime.held() == [] and "t1" not in agent.meta


def test_a_restarted_agent_still_forgets_the_keys_of_a_trajectory_closed_before(
    tmp_path: Path,
) -> None:
    """A key reused in a trajectory opened again under the same name must run there, not
    replay what ran in the one closed, after the agent restarted too (its journal)."""
    state = tmp_path / "state"
    spec = EnvSpec(name="e", image="i")
    run = AgentExec(rid=2, trajectory="t1", argv=["true"], cores=[0], key="alice\x1fk")
    kept = AgentExec(rid=3, trajectory="t2", argv=["true"], cores=[0], key="alice\x1fk2")

    async def first() -> None:
        agent = NodeAgent.create(state, runtime="noop", cores_for_actions=1)
        for trajectory in ("t1", "t2"):
            await agent.handle(AgentOpen(rid=1, trajectory=trajectory, env=spec))
        assert (await agent.handle(run)).ok and (await agent.handle(kept)).ok
        assert (await agent.handle(run)).replayed  # (a retry, while it is open)
        await agent.handle(AgentClose(rid=4, trajectory="t1"))
        await agent.shutdown()

    async def second() -> None:
        agent = NodeAgent.create(state, runtime="noop", cores_for_actions=1)
        for trajectory in ("t1", "t2"):
            await agent.handle(AgentOpen(rid=1, trajectory=trajectory, env=spec))
        again = await agent.handle(run)
        assert again.ok and not again.replayed
        assert (await agent.handle(kept)).replayed  # (the open one's keys are kept)
        await agent.shutdown()

    asyncio.run(first())
    asyncio.run(second())


def test_the_schedulers_learned_file_is_readable_by_it_alone(tmp_path: Path) -> None:
    """It names tenants and holds their idempotency keys (leases): 0600 in a directory of
    its own, 0700, whatever the umask lets other files be."""
    from tangram.service.learned_file import LearnedFile

    learned = LearnedFile(tmp_path / "state" / "learned" / "pool.json")
    old = os.umask(0o022)
    try:
        learned.write(b"{}")
        learned.write(b"{}")  # (replaced, as each save does)
    finally:
        os.umask(old)
    assert _mode(learned.path) == 0o600 and _mode(learned.path.parent) == 0o700
