"""The Docker runtime against a real Docker Engine: cpusets, limits, hardening, re-adoption."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import socket
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from docker.errors import APIError

from tangram.api.wire import EnvSpec
from tangram.node_agent.docker_runtime import DockerRuntime
from tangram.node_agent.env_template import DEFAULT_USER, LABEL
from tangram.node_agent.exec_server import Built, socket_in
from tangram.node_agent.execution import STOP, ExecError, ExecIO, ExecResult
from tangram.node_agent.fast_path import cgroup_of
from tangram.node_agent.inventory import parse_cpulist

# One worker runs every Docker test, so only one of them may start (and stop) dockerd.
pytestmark = [pytest.mark.docker, pytest.mark.xdist_group("docker")]
CORES = sorted(os.sched_getaffinity(0))


PATHS = ["fast", "portable"]


@pytest.fixture
def runtime(
    docker_client: Any, busybox: str, execd: Built, tmp_path: Any
) -> Iterator[DockerRuntime]:
    rt = DockerRuntime(CORES[:1], client=docker_client, execd=execd, state_dir=tmp_path)
    yield rt
    for t in list(rt.envs):
        rt.close(t)
    rt.shutdown_warm()


def template(busybox: str, **kw: Any) -> EnvSpec:
    return EnvSpec(name="test-env", image=busybox, memory_gb=0.25, **kw)


def tid() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def run(rt: DockerRuntime, t: str, argv: list[str], cores: list[int], **kw: Any) -> ExecResult:
    return asyncio.run(rt.exec(t, argv, cores, **kw))


def group_limits(rt: DockerRuntime, t: str) -> tuple[list[int], float]:
    """The cores and quota (in cores) the container's cgroup holds right now."""
    env = rt.envs[t]
    env.container.reload()
    group = cgroup_of(int(env.container.attrs["State"]["Pid"]), rt.cgroups)
    root = Path("/sys/fs/cgroup")
    if rt.cgroups.version == 1:
        quota = int((root / "cpu" / group / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / group / "cpu.cfs_period_us").read_text())
    else:
        q, p = (root / group / "cpu.max").read_text().split()
        quota, period = int(q), int(p)
    return parse_cpulist(rt.cgroups.cpus(group)), quota / period


@pytest.mark.parametrize("path", PATHS)
def test_the_command_sees_exactly_its_cores_then_the_idle_set(
    runtime: DockerRuntime, busybox: str, path: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = run(runtime, t, ["grep", "Cpus_allowed_list", "/proc/self/status"], CORES[-1:], path=path)
    assert res.exit_code == 0 and res.path == path
    assert parse_cpulist(res.stdout.split(":")[1]) == CORES[-1:]
    quota = run(runtime, t, ["cat", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"], CORES, path=path)
    if quota.exit_code == 0:  # cgroup v1 shows the container its own cpu group
        assert int(quota.stdout) == len(CORES) * 100_000
    assert group_limits(runtime, t) == (CORES[:1], 0.1)  # back on the idle set


@pytest.mark.parametrize("path", PATHS)
def test_dop_and_the_memory_limit_reach_the_container(
    runtime: DockerRuntime, busybox: str, path: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    res = run(runtime, t, ["sh", "-c", "echo {dop} $TANGRAM_DOP"], CORES, path=path)
    assert res.stdout.split() == [str(len(CORES))] * 2
    limit = run(
        runtime,
        t,
        [
            "sh",
            "-c",
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
            "|| cat /sys/fs/cgroup/memory.max",
        ],
        CORES[:1],
        path=path,
    )
    assert int(limit.stdout) == int(0.25 * 1024**3)


@pytest.mark.parametrize("path", PATHS)
def test_hardening_is_in_effect(runtime: DockerRuntime, busybox: str, path: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    status = run(runtime, t, ["cat", "/proc/self/status"], CORES[:1], path=path).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"
    nets = run(runtime, t, ["ls", "/sys/class/net"], CORES[:1], path=path).stdout.split()
    assert nets == ["lo"]


def only_pid1_left(runtime: DockerRuntime, t: str) -> bool:
    return len(runtime.envs[t].container.top()["Processes"]) == 1


@pytest.mark.parametrize("path", PATHS)
def test_a_runaway_command_is_killed_at_its_timeout(
    runtime: DockerRuntime, busybox: str, path: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", "setsid sleep 600 & sleep 600"]
    res = run(runtime, t, argv, CORES[:1], timeout_s=1.0, path=path)
    assert res.timed_out and res.exit_code is None
    assert only_pid1_left(runtime, t)
    assert group_limits(runtime, t) == (CORES[:1], 0.1)


@pytest.mark.parametrize("path", PATHS)
def test_a_stopped_command_is_killed_with_what_it_wrote_kept(
    runtime: DockerRuntime, busybox: str, path: str
) -> None:
    """The agent's cancel that keeps the output (``STOP``): killed as at a deadline."""
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", "echo before; echo err >&2; touch /work/started; exec sleep 600"]

    async def go() -> ExecResult:
        stop = asyncio.Event()
        STOP.set(stop)
        running = asyncio.ensure_future(runtime.exec(t, argv, CORES[:1], path=path))
        while (await runtime.exec(t, ["ls", "/work"], CORES[:1])).stdout != "started\n":
            await asyncio.sleep(0.05)
        stop.set()
        return await running

    res = asyncio.run(go())
    assert res.timed_out and res.exit_code is None, res
    assert (res.stdout, res.stderr) == ("before\n", "err\n"), res
    assert only_pid1_left(runtime, t)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_command_stopped_as_it_starts_is_killed_too(
    runtime: DockerRuntime, busybox: str, path: str, delay: float
) -> None:
    """A stop that came while the portable path's exec was being started (no pid yet)
    killed nothing: the command ran to its own end, its cores given away meanwhile."""
    t = tid()
    runtime.open(t, template(busybox))

    async def go() -> ExecResult:
        stop = asyncio.Event()
        STOP.set(stop)
        running = asyncio.ensure_future(runtime.exec(t, ["sleep", "600"], CORES[:1], path=path))
        await asyncio.sleep(delay)
        stop.set()
        return await asyncio.wait_for(running, 60)  # (a hang guard: it ends at once)

    res = asyncio.run(go())
    assert res.timed_out and res.exit_code is None, res
    assert only_pid1_left(runtime, t)


def test_the_fast_path_also_kills_what_a_command_orphaned(
    runtime: DockerRuntime, busybox: str
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    # The middle shell exits at once: the sleeper is nobody's descendant any more.
    argv = ["sh", "-c", "sh -c 'setsid sleep 600 &'; sleep 600"]
    res = run(runtime, t, argv, CORES[:1], timeout_s=1.0, path="fast")
    assert res.timed_out
    assert only_pid1_left(runtime, t)


@pytest.mark.parametrize(
    "argv",
    [
        ["sh", "-c", "setsid sleep 1000 & echo started"],  # its own session
        ["sh", "-c", "(sleep 1001 &) ; echo started"],  # double-forked: an orphan at once
        ["sh", "-c", "(setsid sh -c '(sleep 1002 &)' &) ; echo started"],  # both
    ],
    ids=["setsid", "double-fork", "setsid-double-fork"],
)
def test_no_process_outlives_its_action(
    runtime: DockerRuntime, busybox: str, argv: list[str]
) -> None:
    """The command exits at once, leaving a sleeper that escaped its process group; the
    action's end is its end too (the exec server is its subreaper)."""
    t = tid()
    runtime.open(t, template(busybox))
    res = run(runtime, t, argv, CORES[:1], timeout_s=60, path="fast")
    assert (res.exit_code, res.timed_out, res.stdout) == (0, False, "started\n")
    assert only_pid1_left(runtime, t)
    # The next action starts on a clean slate and runs as usual.
    assert run(runtime, t, ["sh", "-c", "echo next"], CORES[:1]).stdout == "next\n"


def soon_only_pid1_left(runtime: DockerRuntime, t: str) -> bool:
    """Whether only PID 1 is left within a while: its sweep of what a killed handler left
    follows the connection's end, which the agent sees first."""
    deadline = time.monotonic() + 30
    while not only_pid1_left(runtime, t):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("sig", ["STOP", "KILL"])
def test_a_command_that_stops_or_kills_its_handler_ends_with_all_it_started(
    runtime: DockerRuntime, busybox: str, sig: str
) -> None:
    """The exec server's handler runs as the command's user, which may signal it. Stopped,
    it never answered the kill at the deadline: the action, and its core, were held for
    good. Killed, the command and its busy loop ran on, on the idle cores and in every
    later action's. Now the server kills a stopped handler, and what a killed one left."""
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", f"(while :; do :; done) & sleep 0.2; kill -{sig} $PPID; sleep 100"]
    with pytest.raises(ExecError) as e:  # (a stopped handler held it past any timeout)
        asyncio.run(asyncio.wait_for(runtime.exec(t, argv, CORES[:1], path="fast"), 60))
    assert "its handler ended first" in str(e.value), e.value
    # Its exec_s, not overhead: it slept 0.2 s before the kill (the agent's clock starts
    # a little after the command's: 0.198 s was read under load, so not "> 0.2").
    assert e.value.ran_s is not None and e.value.ran_s > 0.1
    assert soon_only_pid1_left(runtime, t)
    assert group_limits(runtime, t) == (CORES[:1], 0.1)
    assert run(runtime, t, ["sh", "-c", "echo next"], CORES[:1]).stdout == "next\n"


def test_a_tree_that_respawns_as_fast_as_it_dies_is_killed_whole(
    runtime: DockerRuntime, busybox: str
) -> None:
    """Each shell of the chain starts the next and waits for it, up to the pids limit; the
    deepest one forks again as soon as a pid is free. Killed a generation at a time, the
    chain outgrew the kill's rounds and lived on, at the pids limit: every later command
    failed to start. It is stopped whole first now, then killed."""
    t = tid()
    runtime.open(t, template(busybox, pids_limit=64))
    hydra = "while :; do setsid sh ./h.sh & wait; done"
    argv = ["sh", "-c", f"echo '{hydra}' > h.sh; setsid sh ./h.sh & sleep 1; echo done"]
    for _ in range(3):  # (the old kill lost the race most times, not every time)
        res = run(runtime, t, argv, CORES[:1], timeout_s=60, path="fast")
        assert (res.exit_code, res.stdout) == (0, "done\n")
        top = runtime.envs[t].container.top(ps_args="-eo pid,ppid,stat,args")["Processes"]
        assert soon_only_pid1_left(runtime, t), top
        assert run(runtime, t, ["sh", "-c", "echo next"], CORES[:1]).stdout == "next\n"


def test_a_command_cannot_stop_its_sandbox_by_signalling_pid_1(
    runtime: DockerRuntime, busybox: str, tmp_path: Path
) -> None:
    """The exec server, PID 1, stops on SIGTERM or SIGINT from the runtime; from a command
    of the sandbox (its user's, as PID 1's) they are ignored: `kill 1` ended the sandbox,
    and the trajectory was lost as a sandbox failure of the pool."""
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", "kill -TERM 1; kill -INT 1; sleep 0.5; echo alive"]
    assert run(runtime, t, argv, CORES[:1], path="fast").stdout == "alive\n"
    # Nor by queueing one that says it came from pid 0, as the runtime's do.
    forger = _static_binary(tmp_path, FORGED_TERM)
    with forger.open("rb") as f:
        data = f.read()
    runtime.envs[t].container.put_archive("/work", _tar("forge", data))
    argv = ["sh", "-c", "./forge; sleep 0.5; echo alive"]
    res = run(runtime, t, argv, CORES[:1], path="fast")
    assert (res.exit_code, res.stdout) == (0, "alive\n"), res
    assert run(runtime, t, ["sh", "-c", "echo next"], CORES[:1]).stdout == "next\n"


# SIGTERM queued to PID 1 with a sender pid of 0: what the kernel lets a process of the
# namespace say (any negative code, here SI_QUEUE).
FORGED_TERM = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    siginfo_t si;
    memset(&si, 0, sizeof si);
    si.si_signo = SIGTERM;
    si.si_code = SI_QUEUE;
    si.si_pid = 0;
    return syscall(SYS_rt_sigqueueinfo, 1, SIGTERM, &si) == 0 ? 0 : 1;
}
"""


def _static_binary(tmp_path: Path, source: str) -> Path:
    src, out = tmp_path / "prog.c", tmp_path / "prog"
    src.write_text(source)
    subprocess.run(["cc", "-static", "-O2", "-o", str(out), str(src)], check=True)
    return out


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_what_a_setup_command_leaves_running_is_killed_at_its_end(
    runtime: DockerRuntime, busybox: str
) -> None:
    """Setup ran through Docker's exec, where nothing killed what it left: a busy loop
    started there ran on the idle cores while the sandbox was idle, and took part of every
    action's cores. It runs through the exec server now, as every action (and as pods)."""
    t = tid()
    loop = "(while :; do :; done) > /dev/null 2>&1 &"
    runtime.open(t, template(busybox, setup=[["sh", "-c", f"{loop} echo set > ready"]]))
    assert only_pid1_left(runtime, t)
    assert run(runtime, t, ["cat", "ready"], CORES[:1]).stdout == "set\n"


@pytest.mark.parametrize("path", PATHS)
def test_cancellation_stops_the_command(runtime: DockerRuntime, busybox: str, path: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))

    async def scenario() -> None:
        task = asyncio.create_task(runtime.exec(t, ["sleep", "600"], CORES[:1], path=path))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert only_pid1_left(runtime, t)
    assert group_limits(runtime, t) == (CORES[:1], 0.1)


@pytest.mark.parametrize("path", PATHS)
def test_output_is_capped_and_flagged(runtime: DockerRuntime, busybox: str, path: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo err >&2"]
    res = run(runtime, t, argv, CORES[:1], output_cap=1000, path=path)
    assert len(res.stdout) == 1000 and res.stdout_truncated
    assert res.stderr == "err\n" and not res.stderr_truncated


@pytest.mark.parametrize("path", PATHS)
def test_exit_codes_and_signals(runtime: DockerRuntime, busybox: str, path: str) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    assert run(runtime, t, ["sh", "-c", "exit 3"], CORES[:1], path=path).exit_code == 3
    assert run(runtime, t, ["sh", "-c", "kill -9 $$"], CORES[:1], path=path).exit_code == 137
    missing = run(runtime, t, ["no-such-tool"], CORES[:1], path=path)
    assert missing.exit_code == 127 if path == "fast" else missing.exit_code in (126, 127)


@pytest.mark.parametrize("path", PATHS)
def test_a_command_given_no_stdin_reads_its_end_at_once(
    runtime: DockerRuntime, busybox: str, path: str
) -> None:
    """Without ``stdin`` a command's input was a pipe nobody wrote or closed: ``cat`` held
    its core until its timeout. Its input ends at once now, as /dev/null's, also when its
    output streams; one given ``stdin`` reads it to its end."""
    t = tid()
    runtime.open(t, template(busybox))
    argv = ["sh", "-c", "cat; echo after"]
    res = run(runtime, t, argv, CORES[:1], timeout_s=60, path=path)
    assert (res.exit_code, res.stdout, res.timed_out) == (0, "after\n", False)
    if path == "portable":  # (streams and stdin take the exec server)
        return
    chunks: list[bytes] = []

    async def output(fd: int, data: bytes) -> None:
        chunks.append(data)

    res = run(runtime, t, argv, CORES[:1], timeout_s=60, io=ExecIO(output=output))
    assert (res.exit_code, b"".join(chunks), res.timed_out) == (0, b"after\n", False)

    async def given() -> AsyncIterator[bytes]:
        yield b"typed\n"

    res = run(runtime, t, argv, CORES[:1], timeout_s=60, io=ExecIO(stdin=given()))
    assert (res.exit_code, res.stdout) == (0, "typed\nafter\n")


def test_a_restarted_agent_readopts_its_containers_with_their_files(
    runtime: DockerRuntime, docker_client: Any, busybox: str, execd: Built
) -> None:
    t = tid()
    runtime.open(t, template(busybox, setup=[["sh", "-c", "echo ready > setup.txt"]]))
    run(runtime, t, ["sh", "-c", "echo progress > notes.txt"], CORES[:1])
    restarted = DockerRuntime(
        CORES[:1], client=docker_client, execd=execd, state_dir=runtime.state_dir
    )
    assert t in restarted.adopt()
    res = run(restarted, t, ["cat", "setup.txt", "notes.txt"], CORES[:1])
    assert res.stdout == "ready\nprogress\n" and res.path == "fast"


def test_without_the_exec_server_the_portable_path_runs_and_says_why(
    docker_client: Any, busybox: str, tmp_path: Any
) -> None:
    rt = DockerRuntime(
        CORES[:1], client=docker_client, execd=Built(None, "no C compiler"), state_dir=tmp_path
    )
    t = tid()
    rt.open(t, template(busybox))
    try:
        res = run(rt, t, ["true"], CORES[:1])
        assert res.path == "portable" and res.fallback == "no C compiler"
        with pytest.raises(ExecError, match="fast path is not possible"):
            run(rt, t, ["true"], CORES[:1], path="fast")
    finally:
        rt.close(t)


def test_the_warm_pool_hands_out_ready_containers(runtime: DockerRuntime, busybox: str) -> None:
    tpl = template(busybox, warm=2, setup=[["sh", "-c", "echo warmed > setup.txt"]])
    assert runtime.warm(tpl) == 2
    t = tid()
    opened = runtime.open(t, tpl)
    assert opened.warm
    runtime.envs[t].container.reload()
    assert runtime.envs[t].container.name == f"tangram-t-{t}"
    res = run(runtime, t, ["cat", "setup.txt"], CORES[:1])
    assert res.stdout == "warmed\n" and res.path == "fast"
    assert runtime.warm(tpl) == 1  # refilled
    changed = template(busybox, warm=1, env={"V": "2"})
    assert runtime.warm(changed) == 1  # the older version's containers are gone
    assert sum(len(v) for v in runtime.warm_pool.values()) == 1
    assert not runtime.open(tid(), tpl).warm  # nothing warm of the old version is left


def test_a_non_root_user_owns_its_workdir(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox, user="1000:1000", workdir="/home/agent/work"))
    res = run(runtime, t, ["sh", "-c", "id -u; pwd; touch mine && echo ok"], CORES[:1])
    assert res.stdout.split() == ["1000", "/home/agent/work", "ok"]


def test_sandboxes_run_unprivileged_unless_root_is_asked_for(
    runtime: DockerRuntime, busybox: str
) -> None:
    """busybox has no USER and no /etc/passwd; its /work is root's (0755)."""
    t = tid()
    runtime.open(t, template(busybox))
    res = run(runtime, t, ["sh", "-c", "id -u; id -g; touch /work/mine && echo wrote"], CORES[:1])
    assert res.stdout.split() == [str(DEFAULT_USER.uid), str(DEFAULT_USER.gid), "wrote"]
    assert run(runtime, t, ["touch", "/bin/x"], CORES[:1]).exit_code != 0  # the image's
    root = tid()
    runtime.open(root, template(busybox, user="0"))
    assert run(runtime, root, ["id", "-u"], CORES[:1]).stdout == "0\n"


def test_the_images_own_user_is_the_default(
    runtime: DockerRuntime, docker_client: Any, busybox: str
) -> None:
    base = docker_client.containers.create(busybox, ["true"], network_mode="none")
    try:
        image = base.commit("tangram-test/busybox-user", "1", changes=["USER 4321:4321"])
    finally:
        base.remove(force=True)
    try:
        t = tid()
        runtime.open(t, template("tangram-test/busybox-user:1"))
        res = run(runtime, t, ["sh", "-c", "id -u; touch /work/mine && echo wrote"], CORES[:1])
        assert res.stdout.split() == ["4321", "wrote"]
        runtime.close(t)
    finally:
        docker_client.images.remove(image.id, force=True)


def test_writing_past_the_disk_limit_ends_the_environment_with_the_reason(
    runtime: DockerRuntime, busybox: str
) -> None:
    """This engine's overlay2 sits on ext4 (no storage_opt size): the agent measures the
    writable layer itself, here at every look."""
    runtime.disk_check_s = 0
    t, other = tid(), tid()
    runtime.open(t, template(busybox, disk_gb=0.05))  # 51 MiB
    runtime.open(other, template(busybox))  # no limit
    write = "head -c {} /dev/zero > /work/{}"
    assert run(runtime, t, ["sh", "-c", write.format(20 << 20, "a")], CORES[:1]).exit_code == 0
    assert run(runtime, other, ["sh", "-c", write.format(80 << 20, "a")], CORES[:1]).exit_code == 0
    assert runtime.gone() == []  # 20 MiB: under; the other has no limit
    assert run(runtime, t, ["sh", "-c", write.format(40 << 20, "b")], CORES[:1]).exit_code == 0
    ended = runtime.gone()
    assert [(g.trajectory, g.reason) for g in ended] == [(t, "DiskLimitExceeded")]
    assert "holds 60 MiB, over the TrajectoryEnv's diskGiB (0.05 GiB)" in ended[0].message
    assert set(runtime.envs) == {other}
    assert runtime.storage_opt is False  # found out, and said once in the log


def test_read_only_root_with_a_writable_workdir(runtime: DockerRuntime, busybox: str) -> None:
    t = tid()
    runtime.open(t, template(busybox, read_only_root=True))
    ok = run(runtime, t, ["touch", "/work/x"], CORES[:1])
    denied = run(runtime, t, ["touch", "/bin/x"], CORES[:1])
    assert ok.exit_code == 0 and denied.exit_code != 0


def test_failing_setup_and_bad_requests_are_refused(runtime: DockerRuntime, busybox: str) -> None:
    with pytest.raises(ExecError, match=r"setup \['false'\] failed with exit code 1") as e:
        runtime.open(tid(), template(busybox, setup=[["false"]]))
    assert e.value.reason == "SetupFailed"
    assert runtime.envs == {}
    assert not any(runtime.state_dir.iterdir())  # nothing of it on the host
    with pytest.raises(ExecError, match="not open"):
        run(runtime, "nope", ["true"], CORES[:1])
    with pytest.raises(ExecError, match="not found"):
        runtime.open(tid(), template("tangram-test/missing:0"))
    with pytest.raises(ExecError, match="trajectory"):
        runtime.open("bad/name", template(busybox))


def test_a_setup_command_past_its_time_is_killed_and_said_to_have_timed_out(
    runtime: DockerRuntime, docker_client: Any, busybox: str
) -> None:
    """Docker ran setup commands with no time limit (pods had 600 s): one waiting on a
    prompt held its open, its thread and its container for good."""
    runtime.setup_timeout_s = 0.5
    hang = ["sh", "-c", "echo 'Proceed (y/n)?' >&2; exec sleep 600"]
    with pytest.raises(ExecError) as e:
        runtime.open(tid(), template(busybox, setup=[hang]))
    assert "timed out after 0.5 s (killed): Proceed (y/n)?" in str(e.value), e.value
    assert e.value.reason == "SetupFailed" and not e.value.retryable
    assert runtime.envs == {}
    mine = {"label": f"{LABEL}/owner={runtime.owner}"}
    assert docker_client.containers.list(all=True, filters=mine) == []


def test_an_agent_adopts_only_its_own_containers(
    runtime: DockerRuntime, docker_client: Any, busybox: str, execd: Built, tmp_path: Path
) -> None:
    t = tid()
    runtime.open(t, template(busybox))
    stranger = DockerRuntime(
        CORES[:1], client=docker_client, execd=execd, state_dir=tmp_path / "another-agent"
    )
    assert t not in stranger.adopt()


def test_a_listener_planted_over_the_exec_socket_is_refused(
    runtime: DockerRuntime, busybox: str
) -> None:
    """The socket's directory is the container's to write: a command can move a server of
    its own over the socket's name. Its answers must never be taken for the sandbox's."""
    t = tid()
    runtime.open(t, template(busybox))
    assert run(runtime, t, ["true"], CORES[-1:]).path == "fast"
    env = runtime.envs[t]
    assert env.reach is not None
    real = env.reach.socket  # in the container's own directory, as the agent reaches it
    fake = real.with_name("planted.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as planted:
        planted.bind(str(fake))
        planted.listen(1)
        os.replace(fake, real)
        with pytest.raises(ExecError, match="not by the environment's exec server"):
            run(runtime, t, ["echo", "forged"], CORES[-1:])
    assert group_limits(runtime, t) == (CORES[:1], 0.1)  # the refusal left the idle set


def test_the_exec_servers_directory_holds_no_more_than_a_few_pages(
    runtime: DockerRuntime, busybox: str
) -> None:
    """/.tangram/run is the container's to write (its exec server, of the sandbox's user,
    makes the socket there). Whatever a command writes there must be bounded: it was a
    directory of the agent's state, bind-mounted, where writes past the env's diskGiB
    were neither refused nor counted (the writable layer's size is what is measured)."""
    runtime.disk_check_s = 0
    t = tid()
    runtime.open(t, template(busybox, disk_gb=0.05))  # 51 MiB
    fill = "head -c 104857600 /dev/zero > /.tangram/run/fill; echo $?; wc -c < /.tangram/run/fill"
    res = run(runtime, t, ["sh", "-c", fill], CORES[:1])
    status, held = res.stdout.split()
    assert status != "0", res  # refused (no space), not taken
    assert int(held) <= 64 << 10
    assert not [p for p in runtime.state_dir.rglob("*") if p.name == "fill"]  # not the host's
    # The full directory still serves: the socket is there already and takes no space.
    assert run(runtime, t, ["echo", "served"], CORES[:1]).stdout == "served\n"
    assert runtime.gone() == []  # and nothing of it counts as the env's disk use


def test_a_socket_replaced_from_inside_is_refused_without_the_agents_paths(
    runtime: DockerRuntime, busybox: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A command replaces exec.sock by a link: the next actions fail, telling the tenant
    what is wrong but not where the agent keeps the socket (its state directory, a host
    pid's /proc). The agent's log says where."""
    t = tid()
    runtime.open(t, template(busybox))
    swap = "cd /.tangram/run && mv exec.sock moved.sock && ln -s moved.sock exec.sock"
    assert run(runtime, t, ["sh", "-c", swap], CORES[:1]).exit_code == 0
    with caplog.at_level(logging.WARNING, logger="tangram.agent"):
        with pytest.raises(ExecError, match="exec server socket: not a socket") as action:
            run(runtime, t, ["id"], CORES[:1])
        with pytest.raises(ExecError, match="exec server socket: not a socket") as files:
            asyncio.run(runtime.files(t).list("/"))
    for refused in (str(action.value), str(files.value)):
        assert str(runtime.state_dir) not in refused and "/proc/" not in refused
    reach = runtime.envs[t].reach
    assert reach is not None and str(reach.socket) in caplog.text  # the agent's log has it
    assert group_limits(runtime, t) == (CORES[:1], 0.1)  # the refusal left the idle set


def test_a_stopped_container_is_restarted_and_reached_through_its_new_pid(
    runtime: DockerRuntime, docker_client: Any, busybox: str, execd: Built
) -> None:
    """The socket is in the container's own tmpfs, reached through its PID 1: a restart
    (adopt restarts stopped containers) gives it a new PID 1 and a new, empty tmpfs, and
    adopt returns once the new exec server listens (a command at once does not fail)."""
    t = tid()
    runtime.open(t, template(busybox))
    run(runtime, t, ["sh", "-c", "echo kept > notes.txt"], CORES[:1])
    runtime.envs[t].container.stop(timeout=1)
    restarted = DockerRuntime(
        CORES[:1], client=docker_client, execd=execd, state_dir=runtime.state_dir
    )
    assert t in restarted.adopt()
    env = restarted.envs[t]
    env.container.reload()
    pid = env.container.attrs["State"]["Pid"]
    # Resolved by adopt, once the new exec server's socket was there: not by a command.
    assert env.reach is not None and env.reach.pid == pid
    assert socket_in(Path("/proc"), pid).exists()
    res = run(restarted, t, ["cat", "notes.txt"], CORES[:1], path="fast")
    assert res.stdout == "kept\n"


def test_an_exec_server_whose_pid_went_to_another_process_is_not_trusted(
    runtime: DockerRuntime, busybox: str
) -> None:
    """Pids are reused: the agent checks that the exec server is the process it found
    (its start time), not merely a process with its pid."""
    t = tid()
    runtime.open(t, template(busybox))
    assert run(runtime, t, ["true"], CORES[-1:]).exit_code == 0
    env = runtime.envs[t]
    assert env.reach is not None
    env.reach = dataclasses.replace(env.reach, started=env.reach.started + 1)
    with pytest.raises(ExecError, match="has ended"):
        run(runtime, t, ["echo", "hi"], CORES[-1:])
    assert group_limits(runtime, t) == (CORES[:1], 0.1)


class _Over:
    """An engine client object as it is, but for the attributes given (a failure the real
    engine cannot be made to produce on demand)."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def containers_of(rt: DockerRuntime, docker_client: Any) -> list[str]:
    found = docker_client.containers.list(all=True, filters={"label": f"{LABEL}/owner={rt.owner}"})
    return sorted(c.name for c in found)


@pytest.mark.parametrize("how", ["refused", "cancelled"])
def test_a_portable_exec_that_never_starts_gives_its_cores_back(
    runtime: DockerRuntime,
    docker_client: Any,
    busybox: str,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """Docker refuses the exec (a restarting container), or the action is cancelled while
    it is being created: the container's cgroup and the cores' allotment go back."""
    t = tid()
    runtime.open(t, template(busybox))
    asked, release = threading.Event(), threading.Event()

    def exec_create(*args: Any, **kwargs: Any) -> Any:
        asked.set()
        if how == "cancelled":
            release.wait(30)
        raise APIError("409 Client Error: Conflict (container is restarting)")

    api = _Over(docker_client.api, exec_create=exec_create)
    monkeypatch.setattr(runtime, "client", _Over(docker_client, api=api))

    async def scenario() -> None:
        task = asyncio.create_task(runtime.exec(t, ["true"], CORES[-1:], path="portable"))
        try:
            if how == "cancelled":
                await asyncio.wait_for(asyncio.to_thread(asked.wait, 30), 30)
                task.cancel()
            with pytest.raises(asyncio.CancelledError if how == "cancelled" else APIError):
                await asyncio.wait_for(task, 30)
        finally:
            release.set()

    asyncio.run(scenario())
    assert group_limits(runtime, t) == (CORES[:1], 0.1)
    monkeypatch.undo()
    # The next action has its own cores, not the union with the ones that never ran.
    argv = ["grep", "Cpus_allowed_list", "/proc/self/status"]
    res = run(runtime, t, argv, CORES[:1], path="portable")
    assert parse_cpulist(res.stdout.split(":")[1]) == CORES[:1]


@pytest.mark.parametrize("where", ["create", "start"])
def test_a_container_whose_answer_is_lost_is_removed(
    runtime: DockerRuntime,
    docker_client: Any,
    busybox: str,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """The engine made (or started) the container but its answer timed out (requests'
    ReadTimeout is no DockerException): nothing of it may stay, its name least of all."""

    def create(image: str, **kwargs: Any) -> Any:
        made = docker_client.containers.create(image, **kwargs)
        if not str(kwargs.get("name", "")).startswith("tangram-"):
            return made  # the probe of the image's user and workdir
        lost = requests.exceptions.ReadTimeout("Read timed out. (read timeout=60)")
        if where == "create":
            raise lost
        real_start = made.start

        def start(*args: Any, **kw: Any) -> None:
            real_start(*args, **kw)
            raise lost

        made.start = start
        return made

    containers = _Over(docker_client.containers, create=create)
    monkeypatch.setattr(runtime, "client", _Over(docker_client, containers=containers))
    t = tid()
    with pytest.raises(requests.exceptions.ReadTimeout):
        runtime.open(t, template(busybox))
    assert containers_of(runtime, docker_client) == []
    assert not any(runtime.state_dir.iterdir())  # nor anything of it on the host
    monkeypatch.undo()
    runtime.open(t, template(busybox))  # the trajectory's name is free
    assert run(runtime, t, ["true"], CORES[:1]).exit_code == 0


class _Killed(BaseException):
    """The agent is killed (kill -9, OOM, an upgrade) at this point."""


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "open"])
def test_only_a_container_whose_setup_ran_is_adopted(
    runtime: DockerRuntime,
    busybox: str,
    execd: Built,
    monkeypatch: pytest.MonkeyPatch,
    warm: bool,
) -> None:
    """A successor agent starting while its predecessor was still setting a container up
    must not take that half-built container for a ready one: it removes it."""
    tpl = template(busybox, warm=1 if warm else 0, setup=[["sh", "-c", "echo ok > setup.txt"]])
    docker_client = runtime.client
    seen: dict[str, Any] = {}

    def successor() -> DockerRuntime:
        return DockerRuntime(
            CORES[:1], client=docker_client, execd=execd, state_dir=runtime.state_dir
        )

    def setup_then_killed(env: Any, template: EnvSpec) -> None:
        after = successor()
        seen["open"] = after.adopt()
        seen["warm"] = sum(len(v) for v in after.warm_pool.values())
        seen["left"] = containers_of(runtime, docker_client)
        raise _Killed

    monkeypatch.setattr(runtime, "_setup", setup_then_killed)
    t = tid()
    with pytest.raises(_Killed):
        runtime.warm(tpl) if warm else runtime.open(t, tpl)
    assert seen == {"open": [], "warm": 0, "left": []}
    monkeypatch.undo()
    # Once set up it is ready, and adopted as such.
    runtime.warm(tpl) if warm else runtime.open(t, tpl)
    after = successor()
    assert after.adopt() == ([] if warm else [t])
    assert sum(len(v) for v in after.warm_pool.values()) == (1 if warm else 0)
    if not warm:
        assert run(after, t, ["cat", "setup.txt"], CORES[:1]).stdout == "ok\n"


def test_a_command_whose_container_dies_under_it_fails_and_is_no_success(
    runtime: DockerRuntime, docker_client: Any, busybox: str
) -> None:
    """Found on a real kubelet (a sandbox pod deleted mid-command): the exec server's
    connection ended without an exit status, and the action was ``ok`` with an exit code
    of None, as if the command had run to its end (a keyed retry replayed that)."""
    t = tid()
    runtime.open(t, template(busybox))

    async def scenario() -> None:
        action = asyncio.ensure_future(runtime.exec(t, ["sh", "-c", "touch up; sleep 60"],
                                                    CORES[:1], path="fast"))  # fmt: skip
        while not (await runtime.exec(t, ["ls"], CORES[:1], path="fast")).stdout.count("up"):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(runtime.envs[t].container.kill)
        with pytest.raises(ExecError, match="ended before the command's exit status"):
            await asyncio.wait_for(action, 60)

    asyncio.run(scenario())
