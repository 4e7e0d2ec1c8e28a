"""A real coding environment: pytest -n {dop} in a Debian container runs on its cores.

The image (python3, pytest, pytest-xdist, an unprivileged ``agent`` user) is built by
debootstrap once and cached (tests/integration/docker_engine.py). A small test suite is
written into the trajectory's working directory through exec (the environment has no
network), then run with as many xdist workers as the command was given cores: every
test records its worker, its CPU affinity and its TANGRAM_DOP, and the records must show
exactly DoP workers, each seeing exactly the assigned cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import textwrap
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent import sessions
from tangram.node_agent.docker_runtime import DockerRuntime
from tangram.node_agent.exec_server import Built
from tangram.node_agent.execution import ExecError

# One worker runs every Docker test, so only one of them may start (and stop) dockerd.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.xdist_group("docker")]
CORES = sorted(os.sched_getaffinity(0))
N_TESTS = 8  # enough that xdist's load scheduling hands every worker some

# Runs inside the container. Each test writes its own record file, so concurrent
# workers never share a file. (No "{dop}" here: the runtime would fill it in.)
SUITE = textwrap.dedent(
    """
    import json
    import os
    import pathlib

    import pytest


    @pytest.mark.parametrize("i", range(N_TESTS))
    def test_record(i):
        record = {
            "test": i,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "none"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "dop": os.environ.get("TANGRAM_DOP"),
            "uid": os.getuid(),
        }
        records = pathlib.Path("records")
        records.mkdir(exist_ok=True)
        (records / f"{i}.json").write_text(json.dumps(record))
    """
).replace("N_TESTS", str(N_TESTS))
WRITE = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])"
READ = (
    "import json, pathlib; "
    "print(json.dumps([json.loads(p.read_text()) for p in pathlib.Path('records').iterdir()]))"
)


@pytest.fixture
def env(
    docker_client: Any, coding_image: str, execd: Built, tmp_path: Any
) -> Iterator[tuple[DockerRuntime, str]]:
    """A trajectory with the test suite in its workdir; it runs as the image's unprivileged
    user without the template naming one."""
    runtime = DockerRuntime(CORES[:1], client=docker_client, execd=execd, state_dir=tmp_path)
    t = f"t-{uuid.uuid4().hex[:10]}"
    runtime.open(t, EnvSpec(name="coding", image=coding_image, memory_gb=0.5))
    try:
        wrote = asyncio.run(
            runtime.exec(t, ["python3", "-c", WRITE, "test_suite.py", SUITE], CORES[:1])
        )
        assert wrote.exit_code == 0, wrote.stderr
        yield runtime, t
    finally:
        runtime.close(t)


def run_suite(runtime: DockerRuntime, t: str, cores: Sequence[int]) -> list[dict[str, Any]]:
    res = asyncio.run(
        runtime.exec(
            t,
            ["python3", "-m", "pytest", "-n", "{dop}", "-q", "-p", "no:cacheprovider"],
            cores,
            timeout_s=300,
        )
    )
    assert res.exit_code == 0, res.stdout + res.stderr
    assert res.path == "fast", res.fallback
    assert re.search(rf"\b{N_TESTS} passed\b", res.stdout), res.stdout
    assert res.cores == tuple(cores)
    read = asyncio.run(runtime.exec(t, ["python3", "-c", READ], CORES[:1]))
    assert read.exit_code == 0, read.stderr
    records: list[dict[str, Any]] = json.loads(read.stdout)
    assert sorted(r["test"] for r in records) == list(range(N_TESTS))
    return records


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_pytest_runs_one_xdist_worker_per_assigned_core(env: tuple[DockerRuntime, str]) -> None:
    cores = CORES[:2]
    records = run_suite(*env, cores)
    assert {r["worker"] for r in records} == {"gw0", "gw1"}
    for r in records:
        assert r["affinity"] == cores
        assert r["dop"] == "2"
        assert r["uid"] == 1000  # the unprivileged agent user, not root


def test_one_core_means_dop_one(env: tuple[DockerRuntime, str]) -> None:
    cores = CORES[-1:]
    records = run_suite(*env, cores)
    assert {r["worker"] for r in records} == {"gw0"}
    for r in records:
        assert r["affinity"] == cores
        assert r["dop"] == "1"
        assert r["uid"] == 1000


def test_bash_and_python_sessions_persist_and_hold_cores_only_during_actions(
    env: tuple[DockerRuntime, str],
) -> None:
    runtime, t = env
    cores = CORES[-1:]

    async def session(kind: str, code: str) -> str:
        res = await runtime.session(t, kind, code, cores, timeout_s=60)
        assert res.exit_code == 0, res.stdout + res.stderr
        assert res.path == kind
        return res.stdout

    async def scenario() -> tuple[str, str]:
        # bash: the working directory and variables outlive the action
        await session("bash", "mkdir -p deep && cd deep && LEVEL=deep")
        bash = await session("bash", "pwd; echo $LEVEL; id -u; echo {dop} $TANGRAM_DOP")
        # python: globals persist; during an action it runs on the action's cores
        await session("python", "import os\nhits = 1")
        python = await session("python", "hits += 1\n(hits, sorted(os.sched_getaffinity(0)))")
        return bash, python

    bash, python = asyncio.run(scenario())
    assert bash.split() == ["/work/deep", "deep", "1000", "1", "1"]
    assert python == f"(2, {cores})\n"
    # between actions both sessions are back on the idle core set
    pids = _session_pids(runtime, t)
    assert len(pids) == 2
    for pid in pids:
        assert sorted(os.sched_getaffinity(pid)) == CORES[:1]


def test_concurrent_first_uses_of_a_session_start_one_shell(
    env: tuple[DockerRuntime, str],
) -> None:
    """Two actions that both find the session not started yet: one shell is started and
    both run in it (one after the other), so what either leaves is there for the next."""
    runtime, t = env

    async def shell_pid(code: str) -> str:
        res = await runtime.session(t, "bash", code, CORES[-1:], name="twin", timeout_s=60)
        assert res.exit_code == 0, res.stdout
        return res.stdout.strip()

    async def scenario() -> list[str]:
        first = await asyncio.gather(shell_pid("MARK=set; echo $$"), shell_pid("echo $$"))
        return [*first, await shell_pid('echo "$$ $MARK"')]

    a, b, after = asyncio.run(scenario())
    assert a == b
    assert after == f"{a} set"


def test_a_sessions_background_processes_live_until_the_session_ends(
    env: tuple[DockerRuntime, str],
) -> None:
    """Sessions are the exception to "no process outlives its action": what a session
    starts in the background lives across its actions, and ends with the session."""
    runtime, t = env
    cores = CORES[-1:]

    def sleepers() -> list[str]:
        top = runtime.envs[t].container.top(ps_args="-eo pid,args")
        return sorted(p[1] for p in top["Processes"] if p[1].startswith("sleep 10"))

    async def session(code: str) -> str:
        res = await runtime.session(t, "bash", code, cores, name="bg", timeout_s=60)
        assert res.exit_code == 0, res.stdout
        return res.stdout.strip()

    async def scenario() -> list[list[str]]:  # one loop: a session is bound to its loop
        seen = []
        # Started, and waited for until each has become its sleep (a fork runs before its
        # exec: the action's end must not be what races it).
        await session(
            'seen() { for f in /proc/[0-9]*/cmdline; do [ "$(tr "\\0" " " < $f 2>/dev/null)" '
            '= "sleep $1 " ] && return 0; done; return 1; }'
        )
        started = await session(
            "setsid sleep 1003 & sleep 1004 & until seen 1003 && seen 1004; do :; done; "
            "echo started"
        )
        assert started.endswith("started")  # after the job numbers an interactive bash prints
        seen.append(sleepers())
        # A plain action's end kills what that action left, not what the session runs.
        plain = await runtime.exec(t, ["sh", "-c", "setsid sleep 1005 &"], cores)
        assert plain.exit_code == 0
        seen.append(sleepers())
        # Its job, still there (bash may first report the setsid wrapper's end as Done).
        assert (await session("kill -0 $! && echo alive")).endswith("alive")
        await session("exit 0")
        seen.append(sleepers())
        return seen

    during, after_plain, after_exit = asyncio.run(scenario())
    assert during == after_plain == ["sleep 1003", "sleep 1004"]
    assert after_exit == []


def _session_pids(runtime: DockerRuntime, t: str) -> list[int]:
    top = runtime.envs[t].container.top(ps_args="-eo pid,args")
    return [int(p[0]) for p in top["Processes"] if "bash --norc" in p[1] or "python3 -u -c" in p[1]]


def test_the_memory_limit_holds(env: tuple[DockerRuntime, str]) -> None:
    runtime, t = env  # the environment has 0.5 GiB and no swap
    grab = "b = bytearray(900 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('survived')"
    res = asyncio.run(runtime.exec(t, ["python3", "-c", grab], CORES[:1], timeout_s=120))
    assert res.exit_code == 137 and "survived" not in res.stdout  # SIGKILL by the OOM killer
    assert res.oom_killed  # (told apart from any other SIGKILL: the result said nothing)
    alive = asyncio.run(runtime.exec(t, ["true"], CORES[:1]))
    assert alive.exit_code == 0  # the environment itself lives on
    killed = asyncio.run(runtime.exec(t, ["sh", "-c", "kill -9 $$"], CORES[:1]))
    assert killed.exit_code == 137 and not killed.oom_killed
    # A shell whose child the OOM killer killed exits 137: said as well.
    shell = ["sh", "-c", f'python3 -c "{grab}"; exit $?']
    child = asyncio.run(runtime.exec(t, shell, CORES[:1], timeout_s=120))
    assert child.exit_code == 137 and child.signal is None and child.oom_killed
    # A Python session's interpreter killed so: its failure said "exited: " and no more.
    with pytest.raises(ExecError) as e:
        asyncio.run(runtime.session(t, "python", grab.replace("print", "_ = str"), CORES[:1]))
    assert "ended (killed by SIGKILL)" in str(e.value) and "out-of-memory" in str(e.value)


def test_a_session_killed_at_its_timeout_says_its_state_is_lost(
    env: tuple[DockerRuntime, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that ignored its interrupt was killed, and its result read as that of one
    that lived through it: the next step ran in a fresh session, its state silently gone."""
    monkeypatch.setattr(sessions, "INTERRUPT_GRACE_S", 0.5)
    runtime, t = env

    async def scenario() -> list[tuple[bool, str, str]]:
        said = []
        for code in ["X=5", "sleep 30", "echo X=$X", "trap '' INT; while :; do sleep 0.1; done",
                     "echo X=$X"]:  # fmt: skip
            res = await runtime.session(t, "bash", code, CORES[:1], timeout_s=1)
            said.append((res.timed_out, res.note, res.stdout.strip()))
        return said

    _, interrupted, kept, killed, fresh = asyncio.run(scenario())
    assert interrupted[:2] == (True, "") and kept == (False, "", "X=5")
    assert killed[0] and "was killed: its state is lost" in killed[1], killed
    assert fresh == (False, "", "X=")
