"""The runtime registry: a runtime is one class and one ``register`` call; the agent, its
hello and the command line take it up without naming it anywhere else."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tangram.api.wire import (
    AgentExec,
    AgentFiles,
    AgentOpen,
    AgentSession,
    EnvSpec,
    Problem,
    Session,
)
from tangram.node_agent import agent as agent_module
from tangram.node_agent import runtimes
from tangram.node_agent.agent import NodeAgent
from tangram.node_agent.env_files import EnvFiles, FileError
from tangram.node_agent.execution import ExecError, ExecIO, ExecResult, Gone, Opened, Output


class Recorder:
    """A runtime of the test's own: it remembers what the agent asked of it."""

    kind = "recorder"
    fast_path = ""
    no_io = ""

    def __init__(self, setting: runtimes.Setting) -> None:
        self.setting = setting
        self.calls: list[tuple[Any, ...]] = []
        self.envs: set[str] = {"left-by-a-previous-agent"}
        self.problem: Problem | None = None
        self.ended: list[Gone] = []  # what the next gone() reports
        self.refuse: ExecError | None = None  # what the next open raises
        self.warm_failed: runtimes.WarmFailed | None = None

    def adopt(self) -> list[str]:
        self.calls.append(("adopt",))
        return sorted(self.envs)

    def held(self) -> list[str]:
        return sorted(self.envs)

    async def open(self, trajectory: str, spec: EnvSpec) -> tuple[float, bool]:
        if self.refuse is not None:
            raise self.refuse
        self.envs.add(trajectory)
        self.calls.append(("open", trajectory, spec.name))
        return 0.5, True

    async def keep_warm(self, specs: Sequence[EnvSpec]) -> None:
        self.calls.append(("warm", ",".join(s.name for s in specs)))

    def close(self, trajectory: str) -> None:
        self.envs.discard(trajectory)

    async def gone(self) -> list[Gone]:
        ended, self.ended = self.ended, []
        self.envs -= {g.trajectory for g in ended}
        return ended

    async def exec(self, trajectory: str, argv: Sequence[str], cores: Sequence[int], *,
                   timeout_s: float | None, env: Mapping[str, str],
                   output_cap: int, io: ExecIO | None = None) -> ExecResult:  # fmt: skip
        self.calls.append(("exec", trajectory, list(argv), list(cores), dict(env)))
        out = Output(b"recorded\n", False, b"", False)
        return ExecResult.of(0, out, False, cores, (0.0, 0.0, 0.0, 0.0), path="recorder")

    async def session(self, trajectory: str, kind: str, code: str, cores: Sequence[int],
                      **kw: Any) -> ExecResult:  # fmt: skip
        raise ExecError("no sessions here")

    def files(self, trajectory: str) -> EnvFiles:
        self.calls.append(("files", trajectory))
        raise FileError(errno.ENOENT, "no files here")

    async def shutdown(self) -> None:
        self.calls.append(("shutdown",))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> list[Recorder]:
    made: list[Recorder] = []

    def make(setting: runtimes.Setting) -> Recorder:
        made.append(Recorder(setting))
        return made[-1]

    monkeypatch.setitem(runtimes._REGISTRY, "recorder", runtimes.Registration(make, "a test"))
    return made


def test_a_registered_runtime_serves_the_agent_without_naming_it_anywhere_else(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path / "state", runtime="recorder", node="n1")
    (rt,) = recorder
    assert rt.setting.node == "n1" and rt.setting.state_dir == tmp_path / "state"
    assert rt.setting.idle == agent.idle_cores
    hello = agent.hello()
    assert hello.runtime == "recorder"
    assert [t.id for t in hello.trajectories] == ["left-by-a-previous-agent"]
    spec = EnvSpec(name="box", image="unused", memory_gb=0.1)

    async def scenario() -> list[Any]:
        opened = await agent.handle(AgentOpen(rid=1, trajectory="t1", env=spec))
        ran = await agent.handle(
            AgentExec(rid=2, trajectory="t1", argv=["true"], cores=[3], environ={"A": "1"})
        )
        session = await agent.handle(
            AgentSession(rid=3, trajectory="t1", code="x", cores=[3], session=Session(kind="bash"))
        )
        await agent.shutdown()
        return [opened, ran, session]

    opened, ran, session = asyncio.run(scenario())
    assert opened.ok and opened.opened_s == 0.5 and opened.warm is True
    assert ran.ok and ran.result is not None and ran.result.stdout == "recorded\n"
    assert not session.ok and session.error == "no sessions here"
    assert rt.calls == [("adopt",), ("open", "t1", "box"),
                        ("exec", "t1", ["true"], [3], {"A": "1"}), ("shutdown",)]  # fmt: skip


def test_a_runtime_of_virtual_cores_keeps_its_idle_core_apart_from_the_actions(
    tmp_path: Path,
) -> None:
    agent = NodeAgent.create(tmp_path / "state", runtime="noop", cores_for_actions=4)
    assert (agent.action_cores, agent.idle_cores) == ([0, 1, 2, 3], [4])


def test_an_unknown_runtime_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ExecError, match=r"'gvisor': unknown \(known: auto, docker, pod"):
        NodeAgent.create(tmp_path / "state", runtime="gvisor")


def test_auto_is_docker_and_without_an_engine_fails_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No silent fallback to the process runtime (issue #18): a real Docker client aimed
    at a socket nobody listens on, and one line saying what to do."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    setting = runtimes.Setting(tmp_path, "n1", [0])
    with pytest.raises(ExecError) as refused:
        runtimes.create("auto", setting)
    said = str(refused.value)
    assert said.startswith("runtime auto means docker, and docker: the engine is not reachable")
    assert "start a Docker Engine" in said and "--runtime process" in said
    assert "no isolation" in said

    from tangram.cli.main import main

    root = Path(__file__).resolve().parents[2]
    code = main(["up", "-f", str(root / "manifests/examples/local"), "--state-dir",
                 str(tmp_path / "state"), "--token-file", str(tmp_path / "tokens")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("tangram: error:")] == [
        f"tangram: error: --runtime auto: {said}"  # (no --gpus: not its cause)
    ]
    assert not (tmp_path / "state" / "trajectories").exists()  # no process runtime made


def test_a_gpu_role_that_cannot_start_is_said_once_by_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--runtime auto --gpus cuda:9: --gpus cuda:9: no CUDA device`` named it twice (and
    the runtime, not its cause). Without PyTorch it is that which is missing: named alike."""
    from tangram.cli.main import main

    root = Path(__file__).resolve().parents[2]
    code = main(["up", "-f", str(root / "manifests/examples/local"), "--runtime", "noop",
                 "--gpus", "cuda:9", "--state-dir", str(tmp_path / "state"),
                 "--token-file", str(tmp_path / "tokens")])  # fmt: skip
    (said,) = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert code == 2
    assert said.startswith("tangram: error: --gpus cuda") and said.count("--") == 1, said


def test_a_sandbox_failure_reaches_the_agents_reply_with_its_cause(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path / "state", runtime="recorder", node="n1")
    (rt,) = recorder
    spec = EnvSpec(name="box", image="nowhere/missing:1", memory_gb=0.1)
    rt.refuse = ExecError("image nowhere/missing:1: not on the node", reason="ImageUnavailable")
    refused = asyncio.run(agent.handle(AgentOpen(rid=1, trajectory="t1", env=spec)))
    assert not refused.ok and refused.reason == "ImageUnavailable" and not refused.retryable
    assert refused.error == "image nowhere/missing:1: not on the node"
    rt.refuse = ExecError("not running after 120 s", reason="SandboxStartTimeout", retryable=True)
    late = asyncio.run(agent.handle(AgentOpen(rid=2, trajectory="t1", env=spec)))
    assert late.reason == "SandboxStartTimeout" and late.retryable


def test_an_environment_that_ended_is_reported_lost_unasked_even_between_links(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path / "state", runtime="recorder", node="n1")
    (rt,) = recorder
    rt.ended = [Gone("left-by-a-previous-agent", "SandboxEvicted", "pod rl/x was evicted")]
    assert asyncio.run(agent.report_gone()) == 1  # no link: kept for the next one
    sent: list[Any] = []
    agent.attach(sent.append)
    (notice,) = sent
    assert notice.rid == 0 and not notice.ok and notice.lost == "left-by-a-previous-agent"
    assert notice.reason == "SandboxEvicted" and notice.error == "pod rl/x was evicted"
    assert agent.hello().trajectories == []
    assert asyncio.run(agent.report_gone()) == 0


def test_a_request_whose_exec_server_went_is_told_why_and_an_id_opened_again_is_not(
    recorder: list[Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cause is looked for at once; once the id is opened again (a tenant's own id:
    another environment), an old cause is not the new one's."""
    monkeypatch.setattr(agent_module, "ENDED_LOOK_S", 0.05)
    agent = NodeAgent.create(tmp_path / "state", runtime="recorder", node="n1")
    (rt,) = recorder
    rt.ended = [Gone("t1", "SandboxDeleted", "pod rl/t1 was deleted")]
    spec = EnvSpec(name="box", image="unused", memory_gb=0.1)

    async def scenario() -> tuple[str, str]:
        first = await agent.ended_why("t1")
        await agent.open("t1", spec)
        return first, await agent.ended_why("t1")

    assert asyncio.run(scenario()) == (" (SandboxDeleted: pod rl/t1 was deleted)", "")


def test_a_node_that_cannot_run_actions_says_why_in_its_hello(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path / "state", runtime="recorder", node="n1")
    assert agent.hello().problem is None
    recorder[0].problem = Problem(reason="CPUManagerStatic", message="node n1: CPU manager static")
    problem = agent.hello().problem
    assert problem is not None and problem.reason == "CPUManagerStatic"


def test_top_ups_of_one_runtime_run_one_at_a_time() -> None:
    """Refills after several opens in a row would each see the pool short and together
    overfill it: they wait for each other."""

    class Inner:
        active = peak = 0

        def warm(self, spec: EnvSpec) -> int:
            self.active += 1
            self.peak = max(self.peak, self.active)
            time.sleep(0.05)
            self.active -= 1
            return 0

    inner = Inner()
    sandboxes = runtimes.Sandboxes("inner", inner)
    spec = EnvSpec(name="box", image="unused", warm=1)

    async def refills() -> None:
        await asyncio.gather(*(sandboxes.warm(spec) for _ in range(4)))

    asyncio.run(refills())
    assert inner.peak == 1


def test_keeping_a_set_warm_retires_every_other_env_first_then_tops_each_up() -> None:
    class Inner:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def retire_warm(self, keep: set[str]) -> int:
            self.calls.append(("retire", sorted(keep)))
            return 0

        def warm(self, spec: EnvSpec) -> int:
            self.calls.append(("warm", spec.name))
            return 0

    inner = Inner()
    specs = [EnvSpec(name=n, image="unused", warm=1) for n in ("a", "b")]
    asyncio.run(runtimes.Sandboxes("inner", inner).keep_warm(specs))
    assert inner.calls == [("retire", ["a", "b"]), ("warm", "a"), ("warm", "b")]


def test_an_open_cut_off_while_its_sandbox_starts_closes_the_sandbox_once_made() -> None:
    """The link dropped while a pod started: its thread goes on, and what it makes is
    nobody's (the next hello, sent meanwhile, did not list it), so it is closed."""
    made, go = threading.Event(), threading.Event()

    class Inner:
        def __init__(self) -> None:
            self.envs: dict[str, str] = {}
            self.closed: list[str] = []

        def open(self, trajectory: str, spec: EnvSpec) -> Opened:
            go.wait(30)
            self.envs[trajectory] = f"pod-for-{trajectory}"
            made.set()
            return Opened("pod", False, 0.1)

        def close(self, trajectory: str) -> None:
            self.closed.append(self.envs.pop(trajectory))

    inner = Inner()
    sandboxes = runtimes.Sandboxes("inner", inner)

    async def scenario() -> None:
        opening = asyncio.ensure_future(sandboxes.open("t1", EnvSpec(name="box", image="i")))
        await asyncio.sleep(0)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert sandboxes.held() == []  # what a hello now would list
        go.set()
        while not inner.closed:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(scenario(), 30))  # (a guard against a hang)
    assert made.is_set() and inner.closed == ["pod-for-t1"] and sandboxes.held() == []


def test_a_warm_environment_still_being_made_as_the_agent_stops_is_released_with_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent stops (its tasks cancelled) while a warm pod starts: the pod is made all
    the same, in its thread, and must not land after the warm pool was emptied."""
    started, go = threading.Event(), threading.Event()

    def pod_up_while_stopping(running: Any, timeout: float) -> Any:
        go.set()  # the pod comes up once the agent is stopping, not before
        return concurrent.futures.wait(running, timeout)

    monkeypatch.setattr("tangram.node_agent.runtimes.wait_all", pod_up_while_stopping)

    class Inner:
        def __init__(self) -> None:
            self.warm_pool: list[str] = []
            self.released: list[str] = []

        def warm(self, spec: EnvSpec) -> int:
            started.set()
            go.wait(5)  # (a stop that does not wait for it: the pod lands after)
            self.warm_pool.append("warm-pod")
            return 1

        def shutdown_warm(self) -> None:
            self.released += self.warm_pool
            self.warm_pool.clear()

    inner = Inner()
    sandboxes = runtimes.Sandboxes("inner", inner)

    async def scenario() -> None:
        topping_up = asyncio.ensure_future(sandboxes.warm(EnvSpec(name="b", image="i", warm=1)))
        await asyncio.to_thread(started.wait, 30)
        topping_up.cancel()  # as the agent's shutdown cancels what runs
        await sandboxes.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 30))  # (a guard against a hang)
    assert (inner.released, inner.warm_pool) == (["warm-pod"], [])


def test_a_file_request_goes_to_the_runtime_and_its_refusal_is_the_reply(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path, runtime="recorder")
    assert {"files", "open-keys"} <= set(agent.hello().features)
    req = AgentFiles(rid=3, trajectory="t1", action="stat", path="/x")
    reply = asyncio.run(agent.handle(req))
    # The environment's refusal keeps its errno (the service maps it: ENOENT is a 404).
    assert (reply.rid, reply.ok, reply.error) == (3, False, "no files here")
    assert reply.errno == errno.ENOENT
    assert recorder[0].calls[-1] == ("files", "t1")


def test_a_streamed_request_leaves_no_stream_behind_keyed_or_not(
    recorder: list[Recorder], tmp_path: Path
) -> None:
    agent = NodeAgent.create(tmp_path, runtime="recorder")
    asyncio.run(agent.open("t1", EnvSpec(name="e", image="i")))
    for rid, key in ((1, None), (2, "k")):
        req = AgentExec(rid=rid, trajectory="t1", argv=["true"], cores=[0], stream=True, key=key)
        agent.received(req)  # as the link does, before the request's task starts
        assert asyncio.run(agent.handle(req)).ok
    assert agent._streams == {}


def test_output_cut_at_its_cap_inside_a_character_leaves_the_character_out() -> None:
    """Cut at the cap, "é" (two bytes) ended as U+FFFD, a character the command never
    wrote; output not cut that ends in a broken character still shows it."""
    from tangram.node_agent.execution import ExecResult, Output

    cut = b"ab" + "é".encode()[:1]
    stamps = (0.0, 0.0, 0.0, 0.0)
    r = ExecResult.of(0, Output(cut, True, b"x\xff", True), False, [0], stamps)
    assert (r.stdout, r.stderr) == ("ab", "x\ufffd")  # (a byte that is no UTF-8: shown)
    whole = ExecResult.of(0, Output(cut, False, b"", False), False, [0], stamps)
    assert whole.stdout == "ab\ufffd"
