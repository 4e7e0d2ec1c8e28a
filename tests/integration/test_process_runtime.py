"""The process runtime against the real kernel: cgroups, process groups, pipes.

Needs root and a writable cpuset hierarchy (v1 here; v2 where the host has it); skipped
cleanly otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent import exec_server, process_runtime, runtimes
from tangram.node_agent.cgroups import CgroupV1, CgroupV2, detect, format_cpulist
from tangram.node_agent.exec_server import Built
from tangram.node_agent.inventory import parse_cpulist
from tangram.node_agent.process_runtime import ExecError, ProcessRuntime, _alive

CORES = sorted(os.sched_getaffinity(0))
T = TypeVar("T")


def _cgroups_usable() -> bool:
    if os.geteuid() != 0:
        return False
    cg = detect()
    probe = f"tangram-probe-{uuid.uuid4().hex[:8]}"
    try:
        cg.create(probe)
        cg.remove(probe)
    except (OSError, RuntimeError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _cgroups_usable(), reason="needs root and writable cgroups")


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[ProcessRuntime]:
    rt = ProcessRuntime(
        tmp_path / "work",
        detect(),
        idle_cores=CORES[:1],
        group_prefix=f"tangram-test-{uuid.uuid4().hex[:8]}",
    )
    yield rt
    for t in list(rt._open):
        rt.close(t)
    rt.cgroups.remove(rt.prefix)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_command_starts_with_every_signal_at_its_default(runtime: ProcessRuntime) -> None:
    """An agent started in the background (`tangram up ... &`: SIGINT and SIGQUIT ignored)
    must not hand that on, or its commands could not be interrupted."""
    runtime.open("t1")
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        res = run(runtime.exec("t1", ["grep", "^SigIgn", "/proc/self/status"], CORES[-1:]))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert res.exit_code == 0
    bits = int(res.stdout.split()[1], 16)  # signals 1-31 (glibc reserves 32, 33 for itself)
    assert bits & 0x7FFF_FFFF == 0, res.stdout


def test_the_command_runs_on_exactly_its_cores_and_they_are_reclaimed(
    runtime: ProcessRuntime,
) -> None:
    runtime.open("t1")
    cores = CORES[-1:]
    res = run(runtime.exec("t1", ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"], cores))
    assert res.exit_code == 0
    seen = parse_cpulist(res.stdout.split(":")[1])
    assert seen == cores
    # Between actions the trajectory sits on the idle set again.
    assert parse_cpulist(runtime.cgroups.cpus(runtime._group("t1"))) == CORES[:1]
    assert res.setup_s >= 0 and res.exec_s > 0 and res.teardown_s >= 0


def test_dop_reaches_the_command(runtime: ProcessRuntime) -> None:
    runtime.open("t1")
    res = run(runtime.exec("t1", ["sh", "-c", "echo {dop} $TANGRAM_DOP"], CORES))
    assert res.stdout.split() == [str(len(CORES))] * 2
    assert res.dop == len(CORES)


def test_the_working_directory_persists_between_actions(runtime: ProcessRuntime) -> None:
    runtime.open("t1")
    run(runtime.exec("t1", ["sh", "-c", "echo state > notes.txt"], CORES[:1]))
    res = run(runtime.exec("t1", ["cat", "notes.txt"], CORES[:1]))
    assert res.stdout == "state\n"


def test_a_runaway_command_and_its_children_die_at_the_timeout(runtime: ProcessRuntime) -> None:
    runtime.open("t1")
    # The grandchild leaves the process group: only the cgroup still knows it.
    script = "setsid sleep 60 & sleep 60"
    res = run(runtime.exec("t1", ["sh", "-c", script], CORES[:1], timeout_s=0.5))
    assert res.timed_out and res.exit_code is None
    assert runtime.cgroups.pids(runtime._group("t1")) == []


@pytest.mark.parametrize(
    "script",
    ["setsid sleep 1000 & echo started", "(sleep 1001 &) ; echo started"],
    ids=["setsid", "double-fork"],
)
def test_no_process_outlives_its_action(runtime: ProcessRuntime, script: str) -> None:
    """The command exits at once, leaving a sleeper outside its process group; the
    trajectory's cgroup still holds it, and the action's end ends it."""
    runtime.open("t1")
    res = run(runtime.exec("t1", ["sh", "-c", script], CORES[:1], timeout_s=60))
    assert (res.exit_code, res.timed_out, res.stdout) == (0, False, "started\n")
    assert runtime.cgroups.pids(runtime._group("t1")) == []


def test_a_process_that_left_its_cgroup_holding_the_output_does_not_hold_the_action(
    runtime: ProcessRuntime,
) -> None:
    """A root command can move a child out of its trajectory's cgroup, where no kill of the
    group finds it; holding the command's output pipes, it held the action (and, without a
    timeout, the trajectory) for as long as it liked."""
    runtime.open("t1")
    cg = runtime.cgroups
    assert isinstance(cg, CgroupV1 | CgroupV2)
    escape = f"{cg.cpuset}/cgroup.procs"  # the hierarchy's root group
    if isinstance(cg, CgroupV1):
        escape += f" {cg.cpu}/cgroup.procs"
    script = (f"sleep 1003 & for f in {escape}; do echo $! > $f; done; echo $! > pid; "
              "echo started")  # fmt: skip
    try:
        action = runtime.exec("t1", ["sh", "-c", script], CORES[:1])  # (no timeout of its own)
        res = run(asyncio.wait_for(action, 120))  # (a guard: before, it never ended)
        assert (res.exit_code, res.stdout) == (0, "started\n")
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((runtime.workdir("t1") / "pid").read_text()), signal.SIGKILL)
    assert runtime.cgroups.pids(runtime._group("t1")) == []


def test_what_an_action_leaves_ends_with_the_last_concurrent_action(
    runtime: ProcessRuntime,
) -> None:
    """Concurrent actions of a trajectory share its cgroup, so a leftover of one cannot be
    told from the other's processes: it ends when the last of them does."""
    runtime.open("t1")
    group = runtime._group("t1")

    async def scenario() -> list[int]:
        # The long action waits for its go file, so it surely runs while the short one ends.
        long = asyncio.create_task(runtime.exec(
            "t1", ["sh", "-c", "while [ ! -e go ]; do sleep 0.01; done"], CORES[:1],
            timeout_s=60))  # fmt: skip
        # (Its sleeper lets go of the action's pipes, or the action would last as long.)
        short = await runtime.exec(
            "t1", ["sh", "-c", "setsid sleep 1002 >/dev/null 2>&1 &"], CORES[:1], timeout_s=60
        )
        assert short.exit_code == 0
        during = [p for p in runtime.cgroups.pids(group) if "1002" in _cmdline(p)]
        (runtime.workdir("t1") / "go").touch()
        assert (await long).exit_code == 0
        return during

    assert len(run(scenario())) == 1  # the short action's sleeper, alive meanwhile
    assert runtime.cgroups.pids(group) == []


def test_an_action_that_starts_as_the_last_other_ends_is_not_taken_for_its_leftover(
    runtime: ProcessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command is in the trajectory's cgroup from its fork, before its start returns: a
    concurrent one that ends meanwhile, the last counted, would kill it with what it left."""
    runtime.open("t1")
    spawned = process_runtime._spawned
    first: list[asyncio.Task[Any]] = []
    calls: list[None] = []

    async def the_first_ends_meanwhile(spawn: Any) -> Any:
        started = await spawned(spawn)
        calls.append(None)
        if len(calls) == 2:  # the second command: forked, in the cgroup, not yet returned
            (runtime.workdir("t1") / "go").touch()
            await asyncio.wait(first)
            (runtime.workdir("t1") / "go2").touch()
        return started

    monkeypatch.setattr(process_runtime, "_spawned", the_first_ends_meanwhile)

    async def scenario() -> tuple[int | None, str]:
        wait = "while [ ! -e {} ]; do sleep 0.01; done"
        first.append(asyncio.create_task(runtime.exec(
            "t1", ["sh", "-c", wait.format("go")], CORES[:1], timeout_s=60)))  # fmt: skip
        await asyncio.sleep(0)  # (the first is started before the second)
        second = await runtime.exec(
            "t1", ["sh", "-c", wait.format("go2") + "; echo second"], CORES[:1], timeout_s=60
        )
        assert (await first[0]).exit_code == 0
        return second.exit_code, second.stdout

    assert run(scenario()) == (0, "second\n")


def test_a_timeout_kills_its_action_and_not_a_concurrent_one(runtime: ProcessRuntime) -> None:
    runtime.open("t1")

    async def scenario() -> tuple[object, object]:
        # The healthy action runs, surely, from before the other's timeout to after it.
        script = "touch running; while [ ! -e go ]; do sleep 0.01; done; echo finished"
        healthy = asyncio.create_task(
            runtime.exec("t1", ["sh", "-c", script], CORES[:1], timeout_s=60)
        )
        while not (runtime.workdir("t1") / "running").exists():
            await asyncio.sleep(0.01)
        stuck = await runtime.exec("t1", ["sleep", "60"], CORES[:1], timeout_s=0.2)
        (runtime.workdir("t1") / "go").touch()
        return stuck, await healthy

    stuck, healthy = run(scenario())
    assert stuck.timed_out  # type: ignore[attr-defined]
    assert (healthy.exit_code, healthy.stdout) == (0, "finished\n")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "stuck",
    [  # (the leftover lives until the other action is let go, after this one ends)
        "setsid sh -c 'while [ ! -e go ]; do sleep 0.01; done' & exit 0",  # exited
        "setsid sh -c 'while [ ! -e go ]; do sleep 0.01; done' & sleep 30",  # running too
    ],
)
def test_a_timeout_beside_a_concurrent_action_ends_without_waiting_for_or_killing_it(
    runtime: ProcessRuntime, stuck: str
) -> None:
    """Its leftovers (another session) cannot be told from the concurrent action's
    processes: they live until the trajectory's last command ends, and the timed-out
    action ends without waiting for the pipes they hold."""
    runtime.open("t1")
    work = runtime.workdir("t1")

    async def scenario() -> tuple[object, bool, object]:
        script = "touch running; while [ ! -e go ]; do sleep 0.01; done; echo finished"
        healthy = asyncio.create_task(
            runtime.exec("t1", ["sh", "-c", script], CORES[:1], timeout_s=60)
        )
        while not (work / "running").exists():
            await asyncio.sleep(0.01)
        ended = await asyncio.wait_for(  # (a guard: waiting for the pipes never ends here)
            runtime.exec("t1", ["sh", "-c", stuck], CORES[:1], timeout_s=0.5), 30
        )
        before_the_other = not healthy.done()  # it ended while the other still ran
        (work / "go").touch()
        return ended, before_the_other, await healthy

    ended, before_the_other, healthy = run(scenario())
    assert ended.timed_out and before_the_other  # type: ignore[attr-defined]
    assert (healthy.exit_code, healthy.stdout) == (0, "finished\n")  # type: ignore[attr-defined]
    assert runtime.cgroups.pids(runtime._group("t1")) == []  # the leftovers ended with it


def test_a_cancel_beside_a_concurrent_action_ends_without_waiting_for_its_leftover(
    runtime: ProcessRuntime,
) -> None:
    """As the timeout above, by a cancel: the cancelled action ends while the other runs,
    though what it left holds its pipes."""
    runtime.open("t1")
    work = runtime.workdir("t1")
    leftover = "setsid sh -c 'while [ ! -e go ]; do sleep 0.01; done' &"

    async def scenario() -> tuple[bool, object]:
        script = "touch running; while [ ! -e go ]; do sleep 0.01; done; echo finished"
        healthy = asyncio.create_task(
            runtime.exec("t1", ["sh", "-c", script], CORES[:1], timeout_s=60)
        )
        stuck = asyncio.create_task(runtime.exec(
            "t1", ["sh", "-c", f"{leftover} touch stuck; sleep 30"], CORES[:1], timeout_s=60
        ))  # fmt: skip
        while not (work / "running").exists() or not (work / "stuck").exists():
            await asyncio.sleep(0.01)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stuck, 30)  # (a guard: waiting for the pipes never ends)
        before_the_other = not healthy.done()
        (work / "go").touch()
        return before_the_other, await healthy

    before_the_other, healthy = run(scenario())
    assert before_the_other
    assert (healthy.exit_code, healthy.stdout) == (0, "finished\n")  # type: ignore[attr-defined]


def test_an_action_cancelled_as_it_starts_gives_its_cores_back(runtime: ProcessRuntime) -> None:
    runtime.open("t1")
    group = runtime._group("t1")
    idle = runtime.cgroups.cpus(group)

    async def scenario() -> None:
        task = asyncio.create_task(runtime.exec("t1", ["sleep", "30"], CORES[-1:], timeout_s=60))
        await asyncio.sleep(0)  # it has taken its cores and is spawning the command
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert runtime.cgroups.cpus(group) == idle


def test_an_action_cancelled_as_it_starts_ends_though_what_it_left_holds_its_pipes(
    runtime: ProcessRuntime,
) -> None:
    """asyncio's own cancel of a spawn waits till the child's pipes close, which here is
    when the background sleep ends: the cancelled action must end now, and kill it."""
    runtime.open("t1")
    group = runtime._group("t1")
    idle = runtime.cgroups.cpus(group)

    async def scenario() -> None:
        task = asyncio.create_task(
            runtime.exec("t1", ["sh", "-c", "sleep 60 & sleep 60"], CORES[-1:], timeout_s=90)
        )
        await asyncio.sleep(0)  # forked; asyncio connects its pipes
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)  # (a guard: the sleeps would hold it 60 s)

    run(scenario())
    assert runtime.cgroups.cpus(group) == idle
    assert runtime.cgroups.pids(group) == []  # the sleeps too: no command of it runs


def test_a_program_that_cannot_start_exits_127_and_gives_its_cores_back(
    runtime: ProcessRuntime,
) -> None:
    runtime.open("t1")
    group = runtime._group("t1")
    idle = runtime.cgroups.cpus(group)
    result = run(runtime.exec("t1", ["/no/such/tool"], CORES[-1:], timeout_s=5))
    assert result.exit_code == 127 and "No such file or directory" in result.stderr
    assert runtime.cgroups.cpus(group) == idle  # back on the idle set, as after any action
    assert run(runtime.exec("t1", ["true"], CORES[:1], timeout_s=5)).exit_code == 0
    assert runtime.cgroups.cpus(group) == idle


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_cancelling_the_task_kills_the_command(runtime: ProcessRuntime) -> None:
    runtime.open("t1")

    async def scenario() -> None:
        task = asyncio.create_task(runtime.exec("t1", ["sleep", "60"], CORES[:1]))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert runtime.cgroups.pids(runtime._group("t1")) == []
    assert parse_cpulist(runtime.cgroups.cpus(runtime._group("t1"))) == CORES[:1]


def test_output_is_capped_and_flagged(runtime: ProcessRuntime) -> None:
    runtime.open("t1")
    res = run(
        runtime.exec(
            "t1",
            ["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; echo err >&2"],
            CORES[:1],
            output_cap=1000,
        )
    )
    assert len(res.stdout) == 1000 and res.stdout_truncated
    assert res.stderr == "err\n" and not res.stderr_truncated


def test_close_removes_everything(runtime: ProcessRuntime) -> None:
    work = runtime.open("t1")
    run(runtime.exec("t1", ["sh", "-c", "touch f"], CORES[:1]))
    runtime.close("t1")
    assert not work.exists()
    with pytest.raises(FileNotFoundError):
        runtime.cgroups.cpus(runtime._group("t1"))
    with pytest.raises(ExecError, match="not open"):
        run(runtime.exec("t1", ["true"], CORES[:1]))


def test_close_removes_a_tree_deeper_than_pythons_recursion_limit(
    runtime: ProcessRuntime,
) -> None:
    """``shutil.rmtree`` recursed once per level: a command's deep ``mkdir -p`` left the
    directory, which a restarted agent then took back as an open trajectory."""
    work = runtime.open("t1")
    deep = "d/" * (sys.getrecursionlimit() + 100)
    res = run(runtime.exec("t1", ["mkdir", "-p", deep], CORES[:1]))
    assert res.exit_code == 0, res
    assert (work / deep).is_dir()
    runtime.close("t1")
    assert list(runtime.base_dir.iterdir()) == []  # nothing left, under any name
    restarted = ProcessRuntime(
        runtime.base_dir, runtime.cgroups, idle_cores=CORES[:1], group_prefix=runtime.prefix
    )
    assert restarted.adopt() == []


@pytest.mark.parametrize("where", ["data", "."], ids=["inside", "over-its-directory"])
def test_close_unmounts_what_a_command_mounted_and_never_deletes_through_it(
    runtime: ProcessRuntime, tmp_path: Path, where: str
) -> None:
    """A bind mount a command left in its directory (nothing isolates a root command
    here): the removal went through it and deleted the host's files."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "precious.txt").write_text("keep me")
    work = runtime.open("t1")
    mount = f"mkdir -p data && mount --bind {host} {where}"
    assert run(runtime.exec("t1", ["sh", "-c", mount], CORES[:1])).exit_code == 0
    assert process_runtime.mounts_under(runtime.base_dir)
    runtime.close("t1")
    assert (host / "precious.txt").read_text() == "keep me"
    assert not work.exists() and list(runtime.base_dir.iterdir()) == []
    assert process_runtime.mounts_under(runtime.base_dir) == []


def test_what_a_close_could_not_remove_is_never_adopted_and_removed_at_a_restart(
    runtime: ProcessRuntime,
) -> None:
    runtime.open("t1")
    runtime.close("t1")
    left = runtime.base_dir / ".closed-0123456789abcdef"  # as a removal that failed leaves it
    (left / "sub").mkdir(parents=True)
    restarted = ProcessRuntime(
        runtime.base_dir, runtime.cgroups, idle_cores=CORES[:1], group_prefix=runtime.prefix
    )
    assert restarted.adopt() == []
    assert not left.exists()


def test_a_failed_build_of_the_files_server_is_tried_again(
    runtime: ProcessRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that failed once (a full disk) failed the files API until the agent
    restarted; it is built again once ``REBUILD_AFTER_S`` has passed (0 here)."""
    real = exec_server.build
    failed = [Built(None, "No space left on device")]
    monkeypatch.setattr(runtimes, "build", lambda d: failed.pop() if failed else real(d))
    monkeypatch.setattr(runtimes, "REBUILD_AFTER_S", 0.0)
    procs = runtimes.Processes(runtime, CORES[:1], tmp_path / "cache")
    work = runtime.open("t1")
    (work / "notes.txt").write_text("kept")
    with pytest.raises(ExecError, match="No space left on device"):
        procs.files("t1")
    entry = run(procs.files("t1").stat("notes.txt"))
    assert entry.size == 4


def test_under_uvloop_a_background_job_with_its_output_elsewhere_does_not_hold_the_action(
    runtime: ProcessRuntime,
) -> None:
    """uvloop (the embedded mode's loop) spawned commands with copies of their own output
    sockets: a job sent to the background with its output elsewhere held them, and the
    action ended only when the trajectory's last command did (here: never)."""
    uvloop = pytest.importorskip("uvloop")  # (uvicorn[standard] brings it)
    runtime.open("t1")
    job = "sleep 600 >/dev/null 2>&1 </dev/null & echo started; ls /proc/self/fd"

    async def scenario() -> None:
        other = asyncio.ensure_future(runtime.exec("t1", ["sleep", "600"], CORES[:1]))
        res = await asyncio.wait_for(runtime.exec("t1", ["sh", "-c", job], CORES[:1]), 60)
        assert res.stdout.split() == ["started", "0", "1", "2", "3"], res  # 3: ls's own
        assert not other.done()
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other

    uvloop.run(scenario())


def test_the_files_api_does_not_follow_a_trajectory_directory_replaced_by_a_link(
    runtime: ProcessRuntime, tmp_path: Path
) -> None:
    """A command replaced its directory with a link to another: the files API read and
    overwrote the files there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    procs = runtimes.Processes(runtime, CORES[:1], tmp_path / "cache")
    runtime.open("t1")
    swap = f'd="$PWD"; cd /; rm -rf "$d" && ln -s {outside} "$d"'
    assert run(runtime.exec("t1", ["sh", "-c", swap], CORES[:1])).exit_code == 0
    with pytest.raises(ExecError, match=r"Not a directory|Too many levels"):
        run(procs.files("t1").stat("victim.txt"))
    assert (outside / "victim.txt").read_text() == "keep me"
    runtime.close("t1")
    assert (outside / "victim.txt").read_text() == "keep me"  # (nor removed through it)


def test_a_setup_command_fails_or_times_out_as_in_the_other_runtimes(
    runtime: ProcessRuntime, tmp_path: Path
) -> None:
    """The process runtime ran setup commands with no time limit, and its failures had
    no reason (the pool's status could not say SetupFailed)."""
    procs = runtimes.Processes(runtime, CORES[:1], tmp_path / "cache")
    procs.setup_timeout_s = 0.5
    hang = ["sh", "-c", "echo $$ > ../hung.pid; echo 'Proceed (y/n)?' >&2; exec sleep 600"]
    for setup, said in (
        (["sh", "-c", "echo no mirror >&2; exit 3"], "failed with exit code 3: no mirror"),
        (hang, "timed out after 0.5 s (killed): Proceed (y/n)?"),
    ):
        with pytest.raises(ExecError) as e:
            run(procs.open("t1", EnvSpec(name="e", image="-", setup=[setup])))
        assert said in str(e.value), e.value
        assert e.value.reason == "SetupFailed" and not e.value.retryable
        assert "t1" not in runtime.held()
    hung = int((runtime.base_dir / "hung.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)


def test_an_open_cancelled_during_its_setup_leaves_nothing(
    runtime: ProcessRuntime, tmp_path: Path
) -> None:
    """The scheduler forgets an open it cut off (its agent's link dropped, the agent
    stopped): the directory, cgroup and setup command were left, and the trajectory was
    named held in the next hello, nobody's."""
    procs = runtimes.Processes(runtime, CORES[:1], tmp_path / "cache")
    setup = ["sh", "-c", "echo $$ > ../setup.pid; exec sleep 600"]

    async def scenario() -> None:
        opening = asyncio.ensure_future(procs.open("t1", EnvSpec(name="e", image="-",
                                                                 setup=[setup])))  # fmt: skip
        pid_file = runtime.base_dir / "setup.pid"
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.01)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    run(scenario())
    assert "t1" not in runtime.held() and not runtime.workdir("t1").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(int((runtime.base_dir / "setup.pid").read_text()), 0)


def test_bad_requests_are_refused(runtime: ProcessRuntime) -> None:
    with pytest.raises(ExecError, match="trajectory"):
        runtime.open("../escape")
    runtime.open("t1")
    with pytest.raises(ExecError, match="argv"):
        run(runtime.exec("t1", [], CORES[:1]))
    with pytest.raises(ExecError, match="cores"):
        run(runtime.exec("t1", ["true"], []))


def test_cpulist_round_trip() -> None:
    for cores in ([0], [0, 1, 2, 5], [3, 4, 7, 8, 9]):
        assert parse_cpulist(format_cpulist(cores)) == cores


def test_v2_writes_cpuset_and_cpu_max(tmp_path: Path) -> None:
    # This host's v2 hierarchy has no controllers, so v2 is checked on a file tree:
    # delegation through cgroup.subtree_control, then the two limit files.
    (tmp_path / "cgroup.subtree_control").write_text("")
    cg = CgroupV2(tmp_path)
    cg.create("tangram")
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"  # last write wins
    (tmp_path / "tangram" / "cgroup.subtree_control").write_text("")
    cg.limit("tangram", [0, 1, 2, 5], 4.0)
    assert (tmp_path / "tangram" / "cpuset.cpus").read_text() == "0-2,5"
    assert (tmp_path / "tangram" / "cpu.max").read_text() == "400000 100000"
    cg.limit("tangram", [1], None)
    assert (tmp_path / "tangram" / "cpu.max").read_text() == "max 100000"


def test_v1_quota_files(tmp_path: Path) -> None:
    for h in ("cpuset", "cpu"):
        (tmp_path / h).mkdir()
    (tmp_path / "cpuset" / "cpuset.cpus").write_text("0-3\n")
    (tmp_path / "cpuset" / "cpuset.mems").write_text("0\n")
    cg = CgroupV1(tmp_path)
    # A real v1 kernel creates the knobs on mkdir; a file tree needs them made.
    (tmp_path / "cpuset" / "g").mkdir()
    (tmp_path / "cpuset" / "g" / "cpuset.cpus").write_text("")
    (tmp_path / "cpuset" / "g" / "cpuset.mems").write_text("")
    cg.create("g")
    assert (tmp_path / "cpuset" / "g" / "cpuset.mems").read_text() == "0\n"
    cg.limit("g", [2, 3], 1.5)
    assert (tmp_path / "cpuset" / "g" / "cpuset.cpus").read_text() == "2-3"
    assert (tmp_path / "cpu" / "g" / "cpu.cfs_quota_us").read_text() == "150000"


def test_a_restarted_agent_adopts_its_trajectories_and_stops_their_leftovers(
    runtime: ProcessRuntime, tmp_path: Path
) -> None:
    runtime.open("t1")
    run(runtime.exec("t1", ["sh", "-c", "echo kept > notes.txt"], CORES[:1]))
    # A command left running in the trajectory's cgroup, as a crashed agent would leave it
    # (an agent that lives kills what an action leaves when it ends).
    leftover = subprocess.Popen(["sleep", "600"])
    for procs in runtime.cgroups.join_files(runtime._group("t1")):
        Path(procs).write_text(str(leftover.pid))
    assert runtime.cgroups.pids(runtime._group("t1")) == [leftover.pid]
    restarted = ProcessRuntime(
        runtime.base_dir, runtime.cgroups, idle_cores=CORES[:1], group_prefix=runtime.prefix
    )
    assert restarted.adopt() == ["t1"]
    assert restarted.cgroups.pids(restarted._group("t1")) == []
    assert leftover.wait() == -9
    res = run(restarted.exec("t1", ["cat", "notes.txt"], CORES[:1]))
    assert res.stdout == "kept\n"
    runtime._open.discard("t1")  # the restarted runtime owns it now
    restarted.close("t1")


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_an_action_keeps_its_cores_when_a_concurrent_one_ends(runtime: ProcessRuntime) -> None:
    runtime.open("t1")

    async def scenario() -> tuple[str, str]:
        slow = asyncio.create_task(
            runtime.exec(
                "t1", ["sh", "-c", "sleep 1; grep Cpus_allowed_list /proc/self/status"], CORES[1:2]
            )
        )
        await asyncio.sleep(0.2)
        await runtime.exec("t1", ["true"], CORES[:1])  # ends while the slow one runs
        res = await slow
        return res.stdout, runtime.cgroups.cpus(runtime._group("t1"))

    seen, after = run(scenario())
    assert parse_cpulist(seen.split(":")[1]) == CORES[1:2]  # not the idle set
    assert parse_cpulist(after) == CORES[:1]  # idle once both ended


def test_an_agent_without_cgroup_access_says_so_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tangram.node_agent import cgroups
    from tangram.node_agent.agent import NodeAgent

    monkeypatch.setattr(cgroups, "detect", lambda: CgroupV1(tmp_path / "no-cgroups"))
    with pytest.raises(ExecError, match="write access to the cgroup hierarchy"):
        NodeAgent.create(tmp_path / "state", runtime="process")


def test_named_by_name_it_runs_and_warns_loudly_that_it_isolates_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    setting = runtimes.Setting(tmp_path, "n1", CORES[:1], owner_id=f"test-{uuid.uuid4().hex[:8]}")
    with caplog.at_level(logging.WARNING, "tangram.agent"):
        rt = runtimes.create("process", setting)
    try:
        assert rt.kind == "process"
        (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        said = warning.getMessage()
        assert said.startswith("runtime process: NO ISOLATION. Commands run directly on this host")
        assert f"as uid {os.geteuid()}" in said and "token files" in said
    finally:
        run(rt.shutdown())


def test_closing_a_trajectory_kills_its_files_servers_before_removing_its_directory(
    tmp_path: Path,
) -> None:
    """A files server writing into the trajectory (an upload under way) is killed by its
    close: left running, it would write on into a directory being removed."""
    setting = runtimes.Setting(tmp_path, "n1", CORES[:1], owner_id=f"test-{uuid.uuid4().hex[:8]}")
    rt = runtimes.create("process", setting)
    inner: ProcessRuntime = rt.inner  # type: ignore[attr-defined]

    async def scenario() -> None:
        await rt.open("t1", EnvSpec(name="e", image="unused"))
        work = inner.workdir("t1")
        more = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield b"x" * 65536
            await more.wait()  # the rest of the upload, once the test says so
            yield b"y"

        upload = asyncio.ensure_future(rt.files("t1").write("big", body()))
        while not inner.files_servers.get("t1"):
            await asyncio.sleep(0.01)
        (server,) = inner.files_servers["t1"]
        await asyncio.to_thread(rt.close, "t1")  # as the agent closes it
        assert not _alive(server) and not work.exists()
        more.set()
        with pytest.raises((ExecError, ConnectionError)):
            await upload

    try:
        run(scenario())
    finally:
        run(rt.shutdown())
