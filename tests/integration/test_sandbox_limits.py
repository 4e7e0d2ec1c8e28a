"""A sandbox's limits, met, are said as such: a setup command that runs past its time
(it used to read "failed with exit code None"), and an exec server that cannot fork a
handler for a request because the sandbox's process limit is reached (actions used to
fail with an empty reason, "exec server: ")."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent.env_files import EnvFiles
from tangram.node_agent.exec_server import Built, Channel
from tangram.node_agent.execution import ExecError
from tangram.node_agent.pod_runtime import PodRuntime

from .host_env import RecordedCgroups, fast_path, reach
from .service_harness import until
from .test_exec_server import alive, serving


def test_a_setup_command_past_its_time_is_said_to_have_timed_out(
    execd: Built, tmp_path: Path
) -> None:
    rt = object.__new__(PodRuntime)  # its setup step only: no cluster
    rt.setup_timeout_s = 0.5
    rt.fast = fast_path()
    rt.cgroups = RecordedCgroups()  # type: ignore[assignment]
    rt.idle_cores = (0,)
    rt.cgroup_root = tmp_path / "cgroup"  # (no pids.max there: the node's limit holds)
    rt._facts = {}
    setup = [["sh", "-c", "echo $$ > pid; exec sleep 600"]]
    spec = EnvSpec(name="swe", image="swe:1", setup=setup)
    with serving(execd) as (sock, pid), pytest.raises(ExecError) as e:
        rt._prepare(reach(sock, pid, tmp_path), spec)
    assert "timed out after 0.5 s" in str(e.value), e.value
    assert e.value.reason == "SetupFailed" and not e.value.retryable
    until(lambda: not alive(int((tmp_path / "pid").read_text())), "the setup command is killed")


@contextlib.contextmanager
def pids_limited(limit: int) -> Iterator[Path]:
    """A pids cgroup that holds at most ``limit`` processes: its ``cgroup.procs``."""
    v1 = Path("/sys/fs/cgroup/pids")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"tangram-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"needs root and a writable pids cgroup: {e}")
    try:
        try:
            (group / "pids.max").write_text(str(limit))
        except OSError as e:
            pytest.skip(f"needs root and a writable pids cgroup: {e}")
        yield group / "cgroup.procs"
    finally:
        until(lambda: not (group / "cgroup.procs").read_text().strip(), "the group emptied")
        group.rmdir()


def test_a_request_the_exec_server_cannot_fork_for_names_the_pids_limit(
    execd: Built, tmp_path: Path
) -> None:
    # The server is the group's one process: its fork for a connection's handler fails.
    with pids_limited(1) as procs:
        joined = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]
        with serving(execd, joined) as (sock, pid):
            assert str(pid) in procs.read_text().split()

            async def go() -> tuple[str, str]:
                with pytest.raises(ExecError) as ran:
                    await Channel.start(sock, ["true"], server_pid=pid)

                async def connect() -> Channel:
                    return await Channel.connect(sock, pid)

                with pytest.raises(ExecError) as listed:
                    await EnvFiles(connect, str(tmp_path)).list(str(tmp_path))
                return str(ran.value), str(listed.value)

            for said in asyncio.run(go()):
                assert "closed the connection without an answer" in said, said
                assert "process limit (pids)" in said, said
