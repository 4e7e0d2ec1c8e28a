"""What the node agent reads of a sandbox's cgroup besides its cores: the OOM killer's
count, in each version's file (the real files: tests/integration/test_coding_env.py)."""

from __future__ import annotations

from pathlib import Path

from tangram.node_agent.cgroups import CgroupV1, CgroupV2

GROUP = "docker/abc"


def test_v2_counts_oom_kills_in_memory_events(tmp_path: Path) -> None:
    group = tmp_path / GROUP
    group.mkdir(parents=True)
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 3\n")
    assert CgroupV2(tmp_path).oom_kills(GROUP) == 3


def test_v1_counts_oom_kills_in_the_memory_hierarchy(tmp_path: Path) -> None:
    group = tmp_path / "memory" / GROUP
    group.mkdir(parents=True)
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert CgroupV1(tmp_path).oom_kills(GROUP) == 1


def test_no_count_where_there_is_none(tmp_path: Path) -> None:
    """No memory controller here, or a kernel before 4.13 (no ``oom_kill`` line): None,
    and a SIGKILL is then told as no more than a SIGKILL."""
    assert CgroupV2(tmp_path).oom_kills(GROUP) is None
    group = tmp_path / "memory" / GROUP
    group.mkdir(parents=True)
    (group / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    assert CgroupV1(tmp_path).oom_kills(GROUP) is None
