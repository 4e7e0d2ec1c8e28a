"""Environment templates: the container spec, the user choice, names and identities."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent.docker_runtime import tree
from tangram.node_agent.env_template import (
    DEFAULT_USER,
    User,
    Workdir,
    check_trajectory_id,
    digest,
    pick_user,
    spec,
)
from tangram.node_agent.execution import ExecError

PASSWD = """root:x:0:0:root:/root:/bin/bash
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
dev:x:1001:1001::/home/dev:/bin/bash
agent:x:1000:1000::/home/agent:/bin/bash
"""


def test_the_images_first_regular_user_is_chosen_unless_one_is_asked_for() -> None:
    assert pick_user(PASSWD, None) == User(1000, 1000)
    assert pick_user(PASSWD, "dev") == User(1001, 1001)
    assert pick_user(PASSWD, "dev:50") == User(1001, 50)
    assert pick_user(PASSWD, "1234") == User(1234, 1234)
    assert pick_user(PASSWD, "1001") == User(1001, 1001)
    with pytest.raises(ExecError, match=r"security\.user: 'ghost' is not in") as e:
        pick_user(PASSWD, "ghost")
    assert e.value.reason == "SandboxStartFailed" and not e.value.retryable  # (was a 503)


def test_root_only_when_the_environment_names_it() -> None:
    assert pick_user(PASSWD, "root") is None
    assert pick_user(PASSWD, "0") is None
    assert pick_user(PASSWD, "0:0") is None
    # Neither the environment nor the image names a user, and the image has no regular
    # one: a fixed unprivileged uid, never root.
    assert pick_user("root:x:0:0::/root:/bin/sh\n", None) == DEFAULT_USER
    assert pick_user("", None) == DEFAULT_USER
    assert DEFAULT_USER.uid != 0 and DEFAULT_USER.gid != 0
    # An image whose USER is root is no request for root either.
    assert pick_user(PASSWD, None, image="root") == User(1000, 1000)
    assert pick_user("", None, image="0") == DEFAULT_USER


def test_the_images_own_user_comes_before_its_first_regular_user() -> None:
    assert pick_user(PASSWD, None, image="dev") == User(1001, 1001)
    assert pick_user(PASSWD, None, image="4321") == User(4321, 4321)
    assert pick_user(PASSWD, None, image="4321:77") == User(4321, 77)
    assert pick_user(PASSWD, "agent", image="dev") == User(1000, 1000)  # the env's first
    assert pick_user(PASSWD, "0", image="dev") is None


@pytest.mark.parametrize(
    ("mode", "writable"),
    [(0o755, False), (0o775, True), (0o777, True), (0o1777, True), (0o700, False)],
)
def test_a_workdir_is_writable_by_its_owner_group_or_anyone_as_its_bits_say(
    mode: int, writable: bool
) -> None:
    owned_by_root = Workdir(0, 50, mode)
    assert owned_by_root.writable_by(User(1000, 50)) is writable  # through the group
    assert owned_by_root.writable_by(None)  # root
    assert Workdir(1000, 1000, mode).writable_by(User(1000, 1000)) is bool(mode & 0o200)
    assert Workdir(0, 0, mode).writable_by(User(1000, 1000)) is bool(mode & 0o002)


def test_the_spec_is_hardened_and_wires_the_exec_server() -> None:
    tpl = EnvSpec(name="swe", image="img", memory_gb=2, env={"A": "1"}, pool="p")
    kw = spec(
        tpl,
        name="tangram-t-x",
        labels={"dev.tangram/owner": "o"},
        idle_cores=[0, 1],
        user=User(1000, 1000),
        execd="/cache/execd",
    )
    assert kw["network_mode"] == "none"
    assert kw["cap_drop"] == ["ALL"] and kw["security_opt"] == ["no-new-privileges"]
    assert kw["mem_limit"] == kw["memswap_limit"] == kw["mem_reservation"] == 2 * 1024**3
    assert kw["cpuset_cpus"] == "0-1" and kw["cpu_quota"] == 10_000
    assert kw["user"] == "1000:1000"
    assert kw["entrypoint"] == ["/.tangram/execd", "/.tangram/run/exec.sock"]
    assert kw["labels"]["dev.tangram/pool"] == "p" and kw["labels"]["dev.tangram/owner"] == "o"
    plain = spec(tpl, name="n", labels={}, idle_cores=[0], user=None, execd=None)
    assert plain["entrypoint"] == ["sleep"] and "volumes" not in plain and "user" not in plain
    assert "tmpfs" not in plain


def test_the_exec_servers_socket_directory_is_a_bounded_tmpfs_not_a_host_directory() -> None:
    """Whatever the sandbox can write there is bounded by the kernel: a host directory
    bind-mounted there (the agent's state) took writes no disk limit counted."""
    tpl = EnvSpec(name="swe", image="img", pool="p")
    kw = spec(tpl, name="n", labels={}, idle_cores=[0], user=User(7, 8), execd="/cache/execd")
    assert kw["volumes"] == {"/cache/execd": {"bind": "/.tangram/execd", "mode": "ro"}}
    options = dict(o.partition("=")[::2] for o in kw["tmpfs"]["/.tangram/run"].split(","))
    assert options["size"] == "64k" and int(options["nr_inodes"]) <= 16
    # The exec server (the sandbox's user) makes its socket there, also after a restart.
    assert (options["uid"], options["gid"]) == ("7", "8")
    as_root = spec(tpl, name="n", labels={}, idle_cores=[0], user=None, execd="/cache/execd")
    assert "uid=" not in as_root["tmpfs"]["/.tangram/run"]
    ro = tpl.model_copy(update={"read_only_root": True})
    kw = spec(ro, name="n", labels={}, idle_cores=[0], user=User(7, 8), execd="/cache/execd")
    assert set(kw["tmpfs"]) == {"/work", "/tmp", "/.tangram/run"}  # the workdir's kept


def test_a_read_only_root_gets_a_workdir_the_user_can_write() -> None:
    tpl = EnvSpec(name="e", image="i", read_only_root=True)
    kw = spec(tpl, name="n", labels={}, idle_cores=[0], user=User(7, 8), execd=None)
    assert kw["read_only"] and kw["tmpfs"]["/work"] == "rw,exec,uid=7,gid=8"


def test_the_template_digest_ignores_the_warm_pool_size_only() -> None:
    a = EnvSpec(name="e", image="i", warm=1)
    assert digest(a) == digest(EnvSpec(name="e", image="i", warm=5))
    assert digest(a) != digest(EnvSpec(name="e", image="i", env={"X": "1"}))
    assert digest(a) != digest(EnvSpec(name="e", image="i", setup=[["make"]]))
    assert digest(a) != digest(EnvSpec(name="e", image="i", disk_gb=2))


def test_the_digest_of_an_env_without_a_disk_limit_is_the_one_before_the_field() -> None:
    """Sandboxes made by an agent from before diskGiB are still this version's: adopted
    and handed out, not retired. (The digest that release computed, at 6000639.)"""
    assert digest(EnvSpec(name="e", image="i")) == "3be2e0cbc80c40f9"


@pytest.mark.parametrize("bad", ["", "-x", "a/b", "a b", "x" * 129, "é"])
def test_trajectory_ids_must_make_container_names(bad: str) -> None:
    with pytest.raises(ExecError, match="trajectory"):
        check_trajectory_id(bad)
    check_trajectory_id("traj-17_a.b")


def test_tree_finds_descendants_and_the_group(tmp_path: Path) -> None:
    # pid: (ppid, pgid); 10 leads its group; 13 was orphaned to 1 but is still in the group
    procs = {1: (0, 1), 10: (1, 10), 11: (10, 10), 12: (11, 12), 13: (1, 10), 20: (1, 20)}
    for pid, (ppid, pgid) in procs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} {pgid} 0\n")
    (tmp_path / "self").mkdir()
    assert tree(tmp_path, 10) == [10, 11, 12, 13]
    assert tree(tmp_path, 11) == [11, 12]  # not a group leader: its group is not its own
