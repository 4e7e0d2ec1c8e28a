"""Faults, with the scheduler and the node agent as separate processes (`tangram serve`,
`tangram agent`) or as one (`tangram up`): an agent, a scheduler or the embedded mode
killed mid-action or mid-service-call and restarted, same-key retries answered without
running anything twice, and a flood beyond admission control."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tangram.client import ActionResult, ActionStatus, Client, TangramError
from tangram.client.common import settings
from tangram.service.embedded import free_port
from tests import GPU_EXTRA

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("service")]
ROOT = Path(__file__).resolve().parents[2]

POOL = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: faults}
spec:
  cpu: {idleCores: 1}
  admission: {maxQueued: 3}
  scheduler: {agentGraceSeconds: 120}
---
apiVersion: tangram.dev/v1alpha1
kind: TrajectoryEnv
metadata: {name: shell}
spec:
  poolRef: faults
  image: unused
  memoryGiB: 0.1
"""


def _tangram(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(predicate: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


class Cluster:
    def __init__(self, tmp: Path, grace_s: int = 120, pool: str = POOL) -> None:
        (tmp / "pool.yaml").write_text(pool.replace("Seconds: 120", f"Seconds: {grace_s}"))
        self.tmp, self.port = tmp, free_port()
        self.env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp / "tokens")}
        self.url = f"http://127.0.0.1:{self.port}"
        self.agents: list[subprocess.Popen[str]] = []
        self.start_scheduler()

    def start_scheduler(self) -> None:
        self.scheduler = _tangram(
            "serve", "-f", str(self.tmp / "pool.yaml"), "--port", str(self.port), env=self.env
        )
        _wait(lambda: self._get("/healthz") == 200, "the scheduler did not start")

    def _get(self, path: str) -> int:
        return _status(self.url + path)

    def agent(self, state: str, *flags: str, runtime: str = "process") -> subprocess.Popen[str]:
        proc = _tangram(
            "agent",
            "--scheduler",
            f"ws://127.0.0.1:{self.port}/v1/agents",
            "--runtime",
            runtime,
            "--node",
            "n1",
            "--state-dir",
            str(self.tmp / state),
            *flags,
            env=self.env,
        )
        self.agents.append(proc)
        _wait(lambda: self._get("/readyz") == 200, "the agent did not register")
        return proc

    def stop(self) -> None:
        for proc in (*self.agents, self.scheduler):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (*self.agents, self.scheduler):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tmp_path / "tokens"))  # the clients' too
    c = Cluster(tmp_path, getattr(request, "param", 120))
    yield c
    c.stop()


def test_an_agent_killed_mid_action_ends_it_unknown_and_its_trajectory_waits_for_it(
    cluster: Cluster,
) -> None:
    victim = cluster.agent("state-a")
    started = cluster.tmp / "started"
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        assert client.exec(t.id, ["sh", "-c", "echo kept > f"]).exit_code == 0
        box: list[ActionResult] = []
        argv = ["sh", "-c", f"touch {started}; sleep 60"]
        runner = threading.Thread(target=lambda: box.append(client.exec(t.id, argv)))
        runner.start()
        _wait(started.exists, "the action did not start")  # it runs on the agent now
        victim.kill()
        runner.join(30)
        (r,) = box
        assert r.status is ActionStatus.ERROR  # it may have run: not retryable as new
        assert r.error is not None and r.error.code == "outcome_unknown", r.error
        assert not r.error.retryable
        # The trajectory waits for its agent: actions meanwhile are answered 503 (retry).
        assert client.get(t.id).state.value == "away"
        with pytest.raises(TangramError) as e:
            client.exec(t.id, ["true"])
        assert e.value.status == 503 and "reconnecting" in str(e.value)
        # The agent comes back with its state: the trajectory goes on with its files.
        cluster.agent("state-a")
        _wait(lambda: client.get(t.id).state.value == "open", "the trajectory was not taken back")
        assert client.exec(t.id, ["cat", "f"]).stdout == "kept\n"
    # A client that retries rides the window out without seeing it.
    with Client(cluster.url, retries=8) as client:
        cluster.agents[-1].kill()
        _wait(lambda: client.get(t.id).state.value == "away", "the agent's leave went unseen")
        back = threading.Timer(1.0, cluster.agent, args=("state-a",))
        back.start()
        assert client.exec(t.id, ["cat", "f"]).stdout == "kept\n"
        back.join()  # (its wait for the agent's registration ends before the cluster stops)
        client.close(t.id)


def test_a_keyed_action_cut_off_by_an_agent_crash_is_reported_unknown_never_run_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    victim = cluster.agent("state-a")
    marker = tmp_path / "runs"
    slow = ["sh", "-c", f"echo start >> {marker}; sleep 2; echo end >> {marker}"]
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        ended = client.exec(t.id, ["echo", "done before"], idempotency_key="before")
        box: list[ActionResult] = []
        runner = threading.Thread(
            target=lambda: box.append(client.exec(t.id, slow, idempotency_key="cut"))
        )
        runner.start()
        _wait(marker.exists, "the action did not start")
        victim.kill()
        runner.join(30)
        (r,) = box
        assert r.error is not None and r.error.code == "outcome_unknown", r.error
        assert not r.error.retryable and r.idempotency_key == "cut"
    cluster.agent("state-a")
    with Client(cluster.url, retries=10) as client:  # rides out the agent's return
        again = client.exec(t.id, slow, idempotency_key="cut")  # the retry it invited
        assert again.status is ActionStatus.ERROR and again.error is not None
        assert again.error.code == "outcome_unknown" and not again.error.retryable
        assert marker.read_text().count("start") == 1  # not run a second time
        replay = client.exec(t.id, ["echo", "done before"], idempotency_key="before")
        assert replay.stdout == ended.stdout == "done before\n"
        assert client.exec(t.id, ["true"], idempotency_key="after").status is ActionStatus.OK
        client.close(t.id)


def test_a_command_cut_off_by_an_agent_crash_is_retried_under_its_returned_key_never_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The probe's F1, as a rollout worker meets it: no key given, the agent killed -9
    while the command runs (on its one core) and a second command waits for that core.
    The command ran on to its end, unkilled, yet its result said node_lost, retryable,
    and its resubmission ran it again. Now the running one ends outcome_unknown, not
    retryable, naming the key the client made; the waiting one ends node_lost, retryable
    (never sent). With the agent back, a retry under each returned key runs the waiting
    one once and answers the other unknown: each command ran once."""
    victim = cluster.agent("state-a", "--cores", "1")
    runs = tmp_path / "runs"
    slow = ["sh", "-c", f"echo start >> {runs}; sleep 3; echo end >> {runs}"]
    after = ["sh", "-c", f"echo after >> {runs}"]
    box: dict[str, ActionResult] = {}

    def exec_(name: str, client: Client, tid: str, argv: list[str]) -> threading.Thread:
        thread = threading.Thread(target=lambda: box.update({name: client.exec(tid, argv)}))
        thread.start()
        return thread

    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        running = exec_("running", client, t.id, slow)
        _wait(lambda: runs.exists() and "start" in runs.read_text(), "it did not start")
        waiting = exec_("waiting", client, t.id, after)
        _wait(lambda: _metric(cluster, "tangram_queue_depth") == 1, "the second did not queue")
        victim.kill()
        running.join(30)
        waiting.join(30)
    ran, waited = box["running"], box["waiting"]
    assert ran.status is ActionStatus.ERROR and ran.error is not None, ran
    assert (ran.error.code, ran.error.retryable) == ("outcome_unknown", False)
    assert "after the action was sent there: it may have run" in ran.error.message
    assert ran.idempotency_key and ran.idempotency_key in ran.error.message
    assert waited.status is ActionStatus.ERROR and waited.error is not None, waited
    assert (waited.error.code, waited.error.retryable) == ("node_lost", True)
    assert waited.allocation.node is None and waited.idempotency_key
    _wait(lambda: "end" in runs.read_text(), "the command was not left to run to its end")
    cluster.agent("state-a", "--cores", "1")
    with Client(cluster.url, retries=10) as client:  # rides out the agent's return
        again = client.exec(t.id, slow, idempotency_key=ran.idempotency_key)
        assert again.error is not None and again.error.code == "outcome_unknown", again
        assert again.idempotency_key == ran.idempotency_key
        for _ in range(2):  # its first run, then that run's answer
            late = client.exec(t.id, after, idempotency_key=waited.idempotency_key)
            assert late.status is ActionStatus.OK and late.exit_code == 0, late
        assert runs.read_text().split() == ["start", "end", "after"]
        client.close(t.id)


def test_the_embedded_mode_killed_mid_action_never_runs_the_action_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of ``tangram up`` while a keyed action runs, restart with the same state
    directory, retry with the same key: answered as unknown, not run again."""
    if os.geteuid() != 0:
        pytest.skip("the process runtime writes cgroups: needs root")
    (tmp_path / "pool.yaml").write_text(POOL)
    port = free_port()
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")}
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tmp_path / "tokens"))
    url = f"http://127.0.0.1:{port}"
    argv = ["up", "-f", str(tmp_path / "pool.yaml"), "--port", str(port), "--runtime",
            "process", "--state-dir", str(tmp_path / "state")]  # fmt: skip

    def up() -> subprocess.Popen[str]:
        proc = _tangram(*argv, env=env)
        _wait(lambda: _status(url + "/readyz") == 200, "tangram up did not start")
        return proc

    marker = tmp_path / "runs"
    slow = ["sh", "-c", f"echo start >> {marker}; sleep 2; echo end >> {marker}"]
    first = up()
    try:
        with Client(url, retries=0) as client:
            tid = client.open("shell").id
            runner = threading.Thread(
                target=lambda: _swallow(lambda: client.exec(tid, slow, idempotency_key="k"))
            )
            runner.start()
            _wait(marker.exists, "the action did not start")
            first.kill()
            first.wait(10)
            runner.join(30)
    finally:
        if first.poll() is None:
            first.kill()
    second = up()
    try:
        with Client(url, retries=5) as client:
            again = client.exec(tid, slow, idempotency_key="k")
            assert again.error is not None and again.error.code == "outcome_unknown", again
            assert marker.read_text().count("start") == 1
            assert client.exec(tid, ["true"]).status is ActionStatus.OK
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)


def _status(url: str) -> int:
    try:
        return httpx.get(url).status_code
    except httpx.HTTPError:
        return 0


def _swallow(call: object) -> None:
    with contextlib.suppress(Exception):  # what the client saw as its service went away
        call()  # type: ignore[operator]


@pytest.mark.parametrize("cluster", [1], indirect=True)  # agentGraceSeconds: 1
def test_trajectories_of_an_agent_that_stays_away_past_the_grace_are_lost(
    cluster: Cluster,
) -> None:
    victim = cluster.agent("state-a")
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        victim.kill()
        _wait(lambda: client.get(t.id).state.value == "lost", "the trajectory was not lost")
        with pytest.raises(TangramError) as e:
            client.exec(t.id, ["true"])
        assert e.value.status == 409 and "lost" in str(e.value)
        # The agent's return does not revive it: its environment is closed as stale.
        cluster.agent("state-a")
        _wait(lambda: not any((cluster.tmp / "state-a").rglob(t.id)), "the stale env stayed")
        assert client.get(t.id).state.value == "lost"  # after its agent is back
        with client.trajectory("shell") as fresh:
            assert fresh.exec(["true"]).status is ActionStatus.OK


def test_a_flood_beyond_admission_is_answered_429_and_nothing_accepted_is_lost(
    cluster: Cluster,
) -> None:
    cluster.agent("state-a")
    with Client(cluster.url, retries=0) as client:
        trajectories = [client.open("shell").id for _ in range(8)]
        accepted: list[ActionResult] = []
        refused: list[TangramError] = []
        lock = threading.Lock()

        def submit(tid: str) -> None:
            try:
                r = client.exec(tid, ["sleep", "1"])
                with lock:
                    accepted.append(r)
            except TangramError as e:
                with lock:
                    refused.append(e)

        threads = [threading.Thread(target=submit, args=(t,)) for t in trajectories]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert refused and all(e.status == 429 for e in refused)
        assert accepted and all(r.status is ActionStatus.OK and r.exit_code == 0 for r in accepted)
        assert len(accepted) + len(refused) == len(trajectories)
        for t in trajectories:
            client.close(t)


def test_a_restarted_scheduler_takes_back_trajectories_and_running_actions(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.agent("state-a")
    marker = tmp_path / "runs"
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell", labels={"job": "j1"})
    slow = ["sh", "-c", f"echo run >> {marker}; sleep 3; echo finished"]
    seen = _crash_mid_action(cluster, t.id, slow, "k", marker)
    assert isinstance(seen, Exception)  # the client saw the scheduler go
    with Client(cluster.url, retries=5) as client:
        again = client.exec(t.id, slow, idempotency_key="k")  # the retry of the same action
        assert again.status is ActionStatus.OK and again.stdout == "finished\n"
        assert marker.read_text() == "run\n"  # it ran once
        info = client.get(t.id)
        assert info.state.value == "open" and info.labels == {"job": "j1"}
        later = client.exec(t.id, ["sh", "-c", f"cat {marker}"], idempotency_key="k2")
        assert later.stdout == "run\n"
        client.close(t.id)


def test_a_restarted_scheduler_gives_a_trajectorys_variables_to_its_commands_still(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``env_vars`` (and an E2B sandbox's ``envs``) are kept by the agent with the
    environment: after a scheduler restart the trajectory's commands still get them."""
    from e2b import Sandbox

    cluster.agent("state-a")
    with _http(cluster) as http:  # a refusal names the field, as any 400 does
        bad = http.post("/v1/trajectories", json={"env": "shell", "env_vars": {"A-B": "x"}})
        assert bad.status_code == 400 and bad.json()["error"]["details"][0]["field"] == "env_vars"
    echo = ["sh", "-c", 'echo "$KEPT $OWN"']
    monkeypatch.setenv("E2B_SANDBOX_URL", cluster.url)
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell", env_vars={"KEPT": "kept", "OWN": "trajectory's"})
        assert client.exec(t.id, echo, env={"OWN": "own"}).stdout == "kept own\n"
        token = settings(cluster.url, None)[1]
        box = Sandbox.create("shell", envs={"KEPT": "boxed"}, api_url=cluster.url, api_key=token)
        assert box.commands.run("echo $KEPT").stdout == "boxed\n"
    cluster.scheduler.kill()
    cluster.scheduler.wait(10)
    cluster.start_scheduler()
    _wait(lambda: cluster._get("/readyz") == 200, "the agent did not come back")
    with Client(cluster.url, retries=5) as client:
        assert client.exec(t.id, echo, env={"OWN": "own"}).stdout == "kept own\n"
        assert client.exec(t.id, echo).stdout == "kept trajectory's\n"
        token = settings(cluster.url, None)[1]  # (a restarted scheduler writes new tokens)
        again = Sandbox.connect(box.sandbox_id, api_url=cluster.url, api_key=token)
        assert again.commands.run("echo $KEPT").stdout == "boxed\n"
        again.kill()
        client.close(t.id)


def _crash_mid_action(
    cluster: Cluster, trajectory: str, argv: list[str], key: str, started: Path
) -> object:
    """Submit ``argv`` (it creates ``started``) and crash the scheduler while it runs
    (``_crash_while``)."""
    return _crash_while(cluster, lambda c: c.exec(trajectory, argv, idempotency_key=key), started)


def _crash_while(cluster: Cluster, submit: Callable[[Client], object], started: Path) -> object:
    """``submit`` with a client that does not retry, SIGKILL the scheduler once ``started``
    exists (the run began on the agent), start a new scheduler and wait for the agent to
    be back. Returns what the client got (an exception: its scheduler went away)."""
    seen: list[object] = []

    def run() -> None:
        with Client(cluster.url, retries=0) as client:
            try:
                seen.append(submit(client))
            except Exception as e:  # the caller looks at what it was
                seen.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    _wait(started.exists, "the run did not start")
    cluster.scheduler.kill()  # a crash mid-run: no graceful anything; the agent goes on
    cluster.scheduler.wait(10)
    runner.join(30)
    cluster.start_scheduler()
    _wait(lambda: cluster._get("/readyz") == 200, "the agent did not come back")
    return seen[0]


def test_an_open_retried_after_a_scheduler_restart_gets_the_trajectory_it_opened(
    cluster: Cluster,
) -> None:
    """The open's answer was lost with its scheduler: the retry under the same key gets
    the trajectory the agent handed back, not a second one."""
    cluster.agent("state-a")
    body = {"env": "shell", "labels": {"job": "j1"}, "idempotency_key": "open-1"}
    with _http(cluster) as http:
        first = http.post("/v1/trajectories", json=body)
        assert first.status_code == 201, first.text
    cluster.scheduler.kill()
    cluster.scheduler.wait(10)
    cluster.start_scheduler()
    _wait(lambda: cluster._get("/readyz") == 200, "the agent did not come back")
    tid = first.json()["id"]
    with _http(cluster) as http:
        again = http.post("/v1/trajectories", json=body)
        assert again.status_code == 201 and again.json()["id"] == tid, again.text
        other = http.post("/v1/trajectories", json={**body, "labels": {}})
        assert other.status_code == 409, other.text
        assert other.json()["error"]["details"][0]["field"] == "idempotency_key"
        assert tid in other.text  # it names the trajectory the key opened
        assert _metric(cluster, "tangram_trajectories", state="open") == 1
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def _http(cluster: Cluster) -> httpx.Client:
    _, token = settings(cluster.url, None)  # (a restarted scheduler writes new tokens)
    return httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"})


def test_after_a_scheduler_restart_live_trajectories_answer_retry_until_their_agent_is_back(
    cluster: Cluster,
) -> None:
    agent = cluster.agent("state-a")
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        assert client.exec(t.id, ["sh", "-c", "echo kept > f"]).exit_code == 0
    agent.send_signal(signal.SIGSTOP)  # it cannot reconnect until it is let go
    try:
        cluster.scheduler.kill()
        cluster.scheduler.wait(10)
        cluster.start_scheduler()
        with Client(cluster.url, retries=0) as client:
            for ask in (lambda: client.get(t.id), lambda: client.exec(t.id, ["true"])):
                with pytest.raises(TangramError) as e:
                    ask()
                assert e.value.status == 503 and "reconnecting" in str(e.value), e.value
    finally:
        threading.Timer(1.0, agent.send_signal, args=(signal.SIGCONT,)).start()
    with Client(cluster.url, retries=10) as client:  # retries ride out the window
        assert client.exec(t.id, ["cat", "f"]).stdout == "kept\n"
        client.close(t.id)


def test_a_reload_applies_new_definitions_without_dropping_queued_actions(
    cluster: Cluster,
) -> None:
    cluster.agent("state-a")
    with Client(cluster.url, retries=0) as client:
        t1, t2 = client.open("shell").id, client.open("shell").id
        results: list[ActionResult] = []
        threads = [
            threading.Thread(target=lambda t=t: results.append(client.exec(t, ["sleep", "2"])))
            for t in (t1, t2)
        ]
        for th in threads:
            th.start()
        time.sleep(0.5)  # one runs on the only action core, the other waits in the queue
        (cluster.tmp / "pool.yaml").write_text(
            POOL.replace("maxQueued: 3", "maxQueued: 10")
            + "---\napiVersion: tangram.dev/v1alpha1\nkind: TrajectoryEnv\n"
            "metadata: {name: second}\nspec: {poolRef: faults, image: unused, memoryGiB: 0.1}\n"
        )
        cluster.scheduler.send_signal(signal.SIGHUP)
        _wait(lambda: _opens(client, "second"), "the new environment did not appear")
        for th in threads:
            th.join(30)
        assert [r.status for r in results] == [ActionStatus.OK, ActionStatus.OK]
        for t in (t1, t2):
            client.close(t)


def _opens(client: Client, env: str) -> bool:
    try:
        client.close(client.open(env).id)
    except TangramError:
        return False
    return True


def test_an_action_adopted_after_a_restart_can_be_cancelled(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.agent("state-a")
    marker = tmp_path / "runs"
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
    slow = ["sh", "-c", f"echo run >> {marker}; echo started; sleep 30; echo done >> {marker}"]
    _crash_mid_action(cluster, t.id, slow, "long", marker)
    with Client(cluster.url, retries=5) as client:
        assert client.cancel("key:long")
        r = client.exec(t.id, slow, idempotency_key="long")  # the same action: now ended
        assert r.status is ActionStatus.CANCELLED
        assert r.stdout == "started\n", r  # (what it wrote, as a run this scheduler placed)
        assert marker.read_text() == "run\n"  # killed, never finished, never rerun
        assert client.exec(t.id, ["true"]).status is ActionStatus.OK  # its cores came back
        client.close(t.id)


def test_a_cancelled_keyed_run_is_answered_cancelled_again_after_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Its agent keeps the key's answer, a killed run with its output; a scheduler that
    did not see the cancel (restarted) took that answer for ok, with no exit code."""
    cluster.agent("state-a")
    started = tmp_path / "started"
    argv = ["sh", "-c", f"echo before; touch {started}; exec sleep 30"]
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
        box: list[ActionResult] = []
        run = threading.Thread(
            target=lambda: box.append(client.exec(t.id, argv, idempotency_key="k"))
        )
        run.start()
        _wait(started.exists, "the command did not start")
        assert client.cancel("key:k")
        run.join(30)
    assert [(r.status, r.stdout) for r in box] == [(ActionStatus.CANCELLED, "before\n")]
    cluster.scheduler.kill()
    cluster.scheduler.wait()
    cluster.start_scheduler()
    with Client(cluster.url, retries=10) as client:
        again = client.exec(t.id, argv, idempotency_key="k")
        assert (again.status, again.stdout) == (ActionStatus.CANCELLED, "before\n"), again
        client.close(t.id)


def _while_gated(submit: Callable[[], object], gate: Path) -> object:
    """What ``submit`` got while a gated run still ran, then opens the gate. Were it to wait
    for that run rather than be refused, it gets the run's result once the gate opens (at
    most 30 s on): the caller's check then shows it, rather than the test hanging."""
    seen: list[object] = []

    def run() -> None:
        try:
            seen.append(submit())
        except Exception as e:  # the caller looks at what it was
            seen.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(30)
    gate.touch()
    runner.join(30)
    return seen[0]


def test_after_a_scheduler_restart_an_adopted_key_refuses_another_request(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Another request under the key of a run the restarted scheduler adopted is a
    conflict, as it is before a restart: never answered with the adopted run's output,
    neither while it runs nor once it ended (its answer kept for the key)."""
    cluster.agent("state-a")
    marker, gate = tmp_path / "runs", tmp_path / "gate"
    with Client(cluster.url, retries=0) as client:
        t = client.open("shell")
    waits = f"echo run >> {marker}; while [ ! -e {gate} ]; do sleep 0.1; done; echo finished"
    slow = ["sh", "-c", waits]
    _crash_mid_action(cluster, t.id, slow, "k", marker)
    other = ["sh", "-c", f"echo other >> {marker}"]
    with Client(cluster.url, retries=5) as client:
        running = _while_gated(lambda: client.exec(t.id, other, idempotency_key="k"), gate)
        r = client.exec(t.id, slow, idempotency_key="k")  # the same request: its result
        assert r.status is ActionStatus.OK and r.stdout == "finished\n"
        with pytest.raises(TangramError) as ended:
            client.exec(t.id, other, idempotency_key="k")
        for e in (running, ended.value):
            assert isinstance(e, TangramError) and e.status == 409, e
            assert "'k' was used for exec on" in str(e) and "with another request" in str(e)
        assert marker.read_text() == "run\n"  # the other command never ran
        client.close(t.id)


GPU_POOL = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: faults}
spec:
  gpu: {}
  scheduler: {agentGraceSeconds: 120}
---
apiVersion: tangram.dev/v1alpha1
kind: RewardService
metadata: {name: judge}
spec:
  poolRef: faults
  entrypoint: tests.fixtures.tiny_reward:build_gated
  weights: WEIGHTS
  gpuMemoryGiB: 0.01
  dopChoices: [1]
"""


@pytest.fixture
def gpu_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A scheduler and an agent whose GPU worker serves ``judge`` on one CPU-backed device
    (no exec runtime: no root needed). The model holds its GPU until the test lets it go.
    Its tests are marked ``torch``: `make test-gpu` (CI's second step) runs them."""
    pytest.importorskip("torch", reason=GPU_EXTRA)
    from tests.fixtures.tiny_reward import weights

    weights(str(tmp_path / "judge.pt"))
    monkeypatch.setenv("TANGRAM_TOKEN_FILE", str(tmp_path / "tokens"))
    c = Cluster(tmp_path, pool=GPU_POOL.replace("WEIGHTS", str(tmp_path / "judge.pt")))
    c.agent("state-g", "--gpus", "cpu:1", runtime="noop")
    yield c
    c.stop()


def _gated(tmp: Path, n: int = 2) -> tuple[list[dict[str, object]], Path, Path]:
    """Inputs of a gated call (see ``gated_score``), its log and its gate."""
    log, gate = tmp / "runs", tmp / "gate"
    inputs: list[dict[str, object]] = [
        {"x": [float(i + j) / 10 for j in range(16)], "log": str(log), "gate": str(gate)}
        for i in range(n)
    ]
    return inputs, log, gate


def _gpus_in_use(cluster: Cluster) -> float:
    return _metric(cluster, "tangram_units_in_use", resource="gpu")


def _metric(cluster: Cluster, name: str, **labels: str) -> float:
    text = httpx.get(cluster.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def _crash_mid_call(cluster: Cluster, inputs: list[dict[str, object]], log: Path) -> object:
    """Submit a call of judge under key ``k`` (it writes ``log`` as it starts) and crash
    the scheduler while the worker runs it (``_crash_while``)."""
    with Client(cluster.url, retries=10) as client:  # the worker loads judge meanwhile
        assert client.score("judge", [{**inputs[0], "gate": str(log.parent)}]).status.value == "ok"
    log.unlink()  # (that call's run, through an open gate: the directory exists)
    return _crash_while(cluster, lambda c: c.score("judge", inputs, idempotency_key="k"), log)


@pytest.mark.torch
def test_a_restarted_scheduler_adopts_a_running_service_call_and_its_retry_gets_it(
    gpu_cluster: Cluster, tmp_path: Path
) -> None:
    inputs, log, gate = _gated(tmp_path)
    seen = _crash_mid_call(gpu_cluster, inputs, log)
    assert isinstance(seen, Exception)  # the client saw the scheduler go
    # The new scheduler holds the call's GPU for it, so nothing else is placed there.
    assert _gpus_in_use(gpu_cluster) == 1.0
    box: list[ActionResult] = []
    with Client(gpu_cluster.url, retries=5) as client:
        retry = threading.Thread(
            target=lambda: box.append(client.score("judge", inputs, idempotency_key="k"))
        )
        retry.start()
        time.sleep(0.5)  # (the retry is waiting for the adopted call, or about to)
        gate.touch()
        retry.join(30)
        (r,) = box
        assert r.status is ActionStatus.OK, r.error
        assert r.output == _scores(inputs) and r.allocation.gpus == [0]
        assert log.read_text() == "run\n"  # it ran once, for both submissions
        assert _gpus_in_use(gpu_cluster) == 0.0  # its GPU came back
        assert client.score("judge", inputs).status is ActionStatus.OK


@pytest.mark.torch
def test_a_service_call_adopted_after_a_restart_can_be_cancelled(
    gpu_cluster: Cluster, tmp_path: Path
) -> None:
    inputs, log, gate = _gated(tmp_path)
    _crash_mid_call(gpu_cluster, inputs, log)
    with Client(gpu_cluster.url, retries=5) as client:
        assert client.cancel("key:k")  # the new scheduler knows the key: it adopted the call
        gate.touch()  # the worker's thread cannot be stopped: the call ends when it returns
        r = client.score("judge", inputs, idempotency_key="k")  # the same call: now ended
        assert r.status is ActionStatus.CANCELLED
        assert log.read_text() == "run\n"  # never run again
        assert client.score("judge", inputs).status is ActionStatus.OK  # its GPU came back


@pytest.mark.torch
def test_after_a_scheduler_restart_an_adopted_call_key_refuses_another_request(
    gpu_cluster: Cluster, tmp_path: Path
) -> None:
    """As for an action: another call under an adopted call's key is a conflict."""
    inputs, log, gate = _gated(tmp_path)
    _crash_mid_call(gpu_cluster, inputs, log)
    with Client(gpu_cluster.url, retries=5) as client:
        running = _while_gated(lambda: client.score("judge", inputs[:1], idempotency_key="k"), gate)
        r = client.score("judge", inputs, idempotency_key="k")  # the same call: its result
        assert r.status is ActionStatus.OK and r.output == _scores(inputs)
        with pytest.raises(TangramError) as ended:
            client.score("judge", inputs[:1], idempotency_key="k")
        for e in (running, ended.value):
            assert isinstance(e, TangramError) and e.status == 409, e
            assert "with another request" in str(e)
        assert log.read_text() == "run\n"  # it ran once


def _scores(inputs: list[dict[str, object]]) -> list[float]:
    import torch

    from tests.fixtures.tiny_reward import TinyReward

    torch.manual_seed(0)
    model = TinyReward()
    with torch.inference_mode():
        return [float(v) for v in model(torch.tensor([i["x"] for i in inputs]))]
