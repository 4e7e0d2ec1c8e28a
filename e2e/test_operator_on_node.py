"""The operator on a real kubelet + containerd: everything runs as pods, nothing as a
local process.

``helm install`` (loopback values: this single node's pod network reaches nothing, so the
operator, the pool's scheduler and its node agent run on the node's network, bound to
127.0.0.1) → ``kubectl apply`` of the coding example → the agent DaemonSet's pod Running,
with no Docker socket → a client opens a trajectory; ``pytest -n {dop}`` runs in its
sandbox pod, on exactly the cores of each action (read inside the pod) → the agent pod is
deleted, the DaemonSet makes a new one, and the trajectory goes on with its files; the
scheduler's container is killed and resumes what it learned from the pool's ConfigMap; the
trajectory goes on after the scheduler pod is deleted too, and the new pod resumes what
the last one learned → a
TrajectoryEnv whose image is nowhere and a sandbox killed behind the agent's back end
their trajectories with the kubelet's reason, on the pool's SandboxesHealthy condition and
as Events → the node leaves the pool's nodeSelector: after agentGraceSeconds the operator
deletes the sandbox pod no agent will take back → the pool is deleted: no pod, cgroup or
exec server is left.

The images are the project's own (``images/build.sh``, nothing pulled), imported into the
node's containerd. The tests share state and run in file order, like one user's session.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.controlplane import ControlPlane
from harness.kubelet import RealNode
from harness.pods import free_port, kubectl_json, wait_for

from tangram.client import AsyncClient, Client, TangramError

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "arl-tangram"
CODING = ROOT / "manifests" / "examples" / "coding" / "pool.yaml"
RELEASE, SYSTEM = "arl-tangram", "tangram-system"
NS = "rl-node"  # the example's namespace is rl; another module may have used that name
SWE_IMAGE = "ghcr.io/example/swe-env:latest"  # what the example names; imported, not pulled
STATE_DIR = Path(f"/var/lib/tangram/{NS}/coding")  # the agent's hostPath (builders.state_dir)
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
IMAGE = f"arl-tangram/operator:{VERSION.group(1) if VERSION else '0.1.0'}"
# The sandbox test suite: each test writes the cores it may run on, as the kernel says.
SUITE = """
import os, pathlib

def _cores(name):
    status = pathlib.Path("/proc/self/status").read_text()
    line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
    pathlib.Path(name).write_text(line.split()[1])

def test_one():
    _cores("seen-1")

def test_two():
    _cores("seen-2")
"""


@dataclass
class Session:
    cp: ControlPlane
    node: RealNode
    bin: Path
    port: int = 0  # the pool's scheduler, on the node's 127.0.0.1
    seen: dict[str, Any] = field(default_factory=dict)  # what later tests check against

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl(*args, **kw)

    def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        return kubectl_json(self.cp.kubectl)(kind, name, namespace)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return items

    def helm(self, *args: str) -> None:
        argv = [str(self.bin / "helm"), f"--kubeconfig={self.cp.admin_kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self, account: str) -> str:
        if not self.kubectl("get", "sa", account, "-n", NS, "--ignore-not-found").stdout:
            self.kubectl("create", "serviceaccount", account, "-n", NS)
        return self.kubectl("create", "token", account, "-n", NS).stdout.strip()

    def logs(self) -> str:
        """The pods' logs of the namespaces in play, for a failure's message."""
        parts = []
        for ns in (SYSTEM, NS):
            for pod in self.pods(ns, "app.kubernetes.io/name"):
                name = pod["metadata"]["name"]
                out = self.kubectl("logs", name, "-n", ns, "--all-containers", "--tail=30",
                                   check=False)  # fmt: skip
                parts.append(f"--- {ns}/{name}\n{out.stdout}{out.stderr}")
        return "\n".join(parts) + f"\n--- node\n{self.node.log_tail()}"

    def wait(self, what: str, check: Any, timeout: float = 120) -> Any:
        try:
            return wait_for(what, check, timeout)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None


def _build_image(work: Path) -> str:
    """The project's image (operator, scheduler and node agent in one), as a user makes it."""
    log = work / "images.log"
    with log.open("w") as out:
        argv = ["bash", str(ROOT / "images" / "build.sh"), "operator"]
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        pytest.fail(f"images/build.sh operator failed ({done.returncode}):\n{tail}")
    return IMAGE


@pytest.fixture(scope="module")
def session(
    control_plane: ControlPlane,
    real_node: RealNode,
    e2e_bin_dir: Path,
    docker_client: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Session]:
    from tests.integration.docker_engine import coding_image

    work = tmp_path_factory.mktemp("on-node")
    image = _build_image(work)
    # The kubelet spells short names out in full (docker.io/...): import them so.
    real_node.import_image(docker_client, image, f"docker.io/{image}")
    swe = coding_image(docker_client)
    if swe is None:
        pytest.fail("the coding test image cannot be built (needs root and debootstrap)")
    real_node.import_image(docker_client, swe, SWE_IMAGE)
    # Fake nodes of earlier modules would take the operator's and scheduler's pods.
    control_plane.kubectl("delete", "nodes", "-l", "type=kwok", "--ignore-not-found")
    fresh_state = not STATE_DIR.exists()
    s = Session(control_plane, real_node, e2e_bin_dir)
    try:
        yield s
    finally:
        # A test that failed midway leaves its pool: delete it while the operator still
        # runs to finish it, as the last test does. Uninstalling the operator under a live
        # pool left helm waiting out its 300 s, and the failure's report behind that.
        s.kubectl(
            "delete", "ap", "--all", "-A", "--ignore-not-found", "--timeout=180s",
            check=False, timeout=200,
        )  # fmt: skip
        s.helm("uninstall", RELEASE, "-n", SYSTEM, "--ignore-not-found", "--wait")
        if fresh_state:  # the agent's hostPath, made by the kubelet for this test
            shutil.rmtree(STATE_DIR, ignore_errors=True)


# ---- the session ---------------------------------------------------------------------


def test_helm_install_runs_the_operator_as_a_pod_on_the_node(session: Session) -> None:
    s = session
    s.helm("install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace",
           "--set", "loopback.enabled=true",
           "--set", f"loopback.apiServer=127.0.0.1:{s.cp.ports.apiserver}",
           "--set", f"loopback.livenessPort={free_port()}",
           # The node has 2 cores and the pool's agent requests both (below).
           "--set-string", "resources.requests.cpu=0",
           "--set", "crds.keep=false", "--wait", "--timeout", "180s")  # fmt: skip
    (pod,) = s.pods(SYSTEM, "app.kubernetes.io/component=operator")
    assert pod["spec"]["nodeName"] == s.node.name
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["hostNetwork"] is True


def test_the_coding_pool_runs_its_scheduler_and_agent_as_pods(session: Session) -> None:
    s = session
    s.port = free_port()
    s.kubectl("create", "namespace", NS)
    example = CODING.read_text().replace("namespace: rl\n", f"namespace: {NS}\n")
    s.kubectl(
        "apply", "-f", "-", stdin=example.replace("rl/rollout-worker", f"{NS}/rollout-worker")
    )
    # Sized for this 2-core node: one core for actions, one idle; the scheduler requests
    # no core; its port is a free one of the node.
    pool = {
        "spec": {
            "cpu": {"coresPerNode": 1, "idleCores": 1},
            "scheduler": {"port": s.port, "resources": {"requests": {"cpu": None}}},
        }
    }
    s.kubectl("patch", "ap", "coding", "-n", NS, "--type=merge", "-p", json.dumps(pool))
    # The test image has python3, pytest and pytest-xdist, but no git for the setup.
    env = {"spec": {"warmPool": 1, "memoryGiB": 1, "workdir": "/work",
                    "setup": [["python3", "-c", "import pytest, xdist"]]}}  # fmt: skip
    s.kubectl("patch", "tenv", "swe", "-n", NS, "--type=merge", "-p", json.dumps(env))

    def ready() -> bool:
        conditions = (s.get("ap", "coding", NS).get("status") or {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    s.wait("the pool to be Ready", ready, 240)
    (agent,) = s.pods(NS, "app.kubernetes.io/component=node-agent")
    assert agent["status"]["phase"] == "Running" and agent["spec"]["nodeName"] == s.node.name
    # No Docker socket: sandboxes are pods of the node's own CRI runtime.
    volumes = json.dumps(agent["spec"]["volumes"])
    assert "docker" not in volumes and "sock" not in volumes
    command = agent["spec"]["containers"][0]["command"]
    assert command[command.index("--runtime") + 1] == "pod"
    s.seen["agent"] = agent["metadata"]["uid"]
    # The warm sandbox pod is ready before anyone asks.
    s.wait("a warm sandbox pod", lambda: s.pods(NS, "tangram.dev/sandbox=true"), 120)
    assert httpx.get(f"{s.url}/healthz").status_code == 200


def test_pytest_runs_in_a_sandbox_pod_on_the_cores_of_each_action(session: Session) -> None:
    s = session
    with Client(s.url, s.token("rollout-worker")) as client:
        t = client.open("swe")
        s.seen["trajectory"] = t.id
        # The suite goes in, and its report comes out, through the files API: the sandbox
        # pod's exec server writes and reads them as the sandbox's user.
        files = client.files(t.id)
        assert files.write("test_cores.py", SUITE).size == len(SUITE.encode())
        run = client.exec(t.id, profile="pytest", args=["--junitxml=report.xml"])
        assert run.status.value == "ok" and "2 passed" in run.stdout, run
        assert b'tests="2"' in files.read("/work/report.xml")
        (entry,) = [e for e in files.list(".") if e.name == "test_cores.py"]
        owner = client.exec(t.id, ["id", "-u"]).stdout.strip()
        assert (entry.type, str(entry.uid)) == ("file", owner)
        # A live exec in the sandbox pod: its first line before it ends, then SIGINT.
        assert asyncio.run(_interrupted(s.url, s.token("rollout-worker"), t.id)) == 130
        assert run.allocation is not None and run.allocation.node == s.node.name
        cores = ",".join(str(c) for c in run.allocation.cores)
        seen = client.exec(t.id, ["sh", "-c", "cat seen-1; echo; cat seen-2"])
        # Both xdist workers ran on the action's cores, which the agent wrote for it alone.
        assert seen.stdout.split() == [cores, cores], (seen.stdout, run.allocation)
        s.seen["cores"] = cores
        # A shell action gets its own allocation, seen from inside the pod while it runs.
        shell = client.exec(t.id, ["sh", "-c", "grep Cpus_allowed_list /proc/self/status"])
        assert shell.allocation is not None
        assert shell.stdout.split()[1] == ",".join(str(c) for c in shell.allocation.cores)
    (pod,) = s.pods(NS, f"tangram.dev/trajectory={t.id}")
    assert pod["spec"]["nodeName"] == s.node.name
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ActionPool"
    s.seen["sandbox"] = pod["metadata"]["uid"]
    s.seen["container"] = pod["status"]["containerStatuses"][0]["containerID"].split("://")[1]


async def _interrupted(url: str, token: str, tid: str) -> int | None:
    """A streamed exec's first output, then SIGINT: its exit code."""
    async with AsyncClient(url, token) as client:
        live = await client.exec_live(tid, ["sh", "-c", "echo first; sleep 600"])
        async for _, text in live.output():
            assert text == "first\n"
            break
        await live.signal("SIGINT")
        return (await live.result()).exit_code


def test_an_agent_pod_restart_keeps_the_trajectory_and_its_files(session: Session) -> None:
    s = session
    tid = s.seen["trajectory"]
    s.kubectl("delete", "pod", "-n", NS, "-l", "app.kubernetes.io/component=node-agent",
              "--wait=true", timeout=120)  # fmt: skip

    def replaced() -> bool:
        pods = s.pods(NS, "app.kubernetes.io/component=node-agent")
        return any(p["metadata"]["uid"] != s.seen["agent"]
                   and p["status"].get("phase") == "Running" for p in pods)  # fmt: skip

    s.wait("the DaemonSet's new agent pod", replaced, 120)
    # The client retries the 503s answered while the new agent connects.
    with Client(s.url, s.token("rollout-worker"), retries=30) as client:
        again = client.exec(tid, ["cat", "seen-1"])
        assert again.status.value == "ok", again
        assert again.stdout == s.seen["cores"]  # the file written before the restart
        assert client.get(tid).state.value == "open"
        (pod,) = s.pods(NS, f"tangram.dev/trajectory={tid}")
        assert pod["metadata"]["uid"] == s.seen["sandbox"]  # the same pod, never remade


def test_a_killed_scheduler_resumes_what_it_learned(session: Session) -> None:
    """Killed as the OOM killer would, the scheduler's container restarts and reads back
    what it saved (every 30 s) in the pool's learned-state ConfigMap."""
    s = session
    (pod,) = s.pods(NS, "app.kubernetes.io/component=scheduler")
    status = pod["status"]["containerStatuses"][0]
    before = s.wait("the learned state saved", lambda: _learned(s), 90)
    for pid in _processes_of(status["containerID"].split("://")[1]):
        os.kill(int(pid), signal.SIGKILL)

    def restarted() -> bool:
        (now,) = s.pods(NS, "app.kubernetes.io/component=scheduler")
        (c,) = now["status"]["containerStatuses"]
        return bool(c["restartCount"] > status["restartCount"] and c.get("ready"))

    s.wait("the scheduler's container restarted and ready", restarted, 120)
    logs = " ".join(s.kubectl("logs", "-n", NS, pod["metadata"]["name"]).stdout.split())
    assert f"resumed (action types: {len(before['profiles'])}," in logs, logs[-2000:]
    with Client(s.url, s.token("rollout-worker"), retries=30) as client:
        again = client.exec(s.seen["trajectory"], ["cat", "seen-1"])
        assert again.status.value == "ok" and again.stdout == s.seen["cores"], again


def _learned(s: Session) -> dict[str, Any] | None:
    """The scheduler's saved state, once it holds a profile and a think time."""
    data = s.get("configmap", "tangram-coding-learned", NS).get("data") or {}
    if "learned.json" not in data:
        return None
    state: dict[str, Any] = json.loads(data["learned.json"])
    return state if state["profiles"] and state["think_s"]["seen"] else None


def test_a_scheduler_pod_restart_keeps_the_trajectory_and_its_files(session: Session) -> None:
    s = session
    tid = s.seen["trajectory"]
    (old,) = s.pods(NS, "app.kubernetes.io/component=scheduler")
    s.kubectl("delete", "pod", "-n", NS, old["metadata"]["name"], "--wait=true", timeout=120)

    def replaced() -> bool:
        pods = s.pods(NS, "app.kubernetes.io/component=scheduler")
        return any(p["metadata"]["uid"] != old["metadata"]["uid"]
                   and p["status"].get("phase") == "Running" for p in pods)  # fmt: skip

    s.wait("the Deployment's new scheduler pod", replaced, 120)
    # Connection errors while it starts, then 503s while the agent reconnects: retried.
    with Client(s.url, s.token("rollout-worker"), retries=30) as client:
        again = client.exec(tid, ["cat", "seen-1"])
        assert again.status.value == "ok", again
        assert again.stdout == s.seen["cores"]  # the file, from before both restarts
        assert client.get(tid).state.value == "open"
        (pod,) = s.pods(NS, f"tangram.dev/trajectory={tid}")
        assert pod["metadata"]["uid"] == s.seen["sandbox"]
        client.close(tid)
    # A new pod, and what the last one learned (saved as it stopped) resumed all the same.
    (new,) = s.pods(NS, "app.kubernetes.io/component=scheduler")
    logs = " ".join(s.kubectl("logs", "-n", NS, new["metadata"]["name"]).stdout.split())
    learned = f"learned state: ConfigMap {NS}/tangram-coding-learned, resumed (action types:"
    assert learned in logs, logs[-2000:]


def test_sandbox_failures_end_their_trajectories_and_show_on_the_pool(session: Session) -> None:
    s = session
    ghost = {"apiVersion": "tangram.dev/v1alpha1", "kind": "TrajectoryEnv",
             "metadata": {"name": "ghost", "namespace": NS},
             "spec": {"poolRef": "coding", "image": "tangram.invalid/ghost:1",
                      "memoryGiB": 0.5}}  # fmt: skip
    s.kubectl("apply", "-f", "-", stdin=json.dumps(ghost))
    with Client(s.url, s.token("rollout-worker")) as client:

        def refused() -> TangramError | None:
            try:
                client.open("ghost")
            except TangramError as e:
                return e if e.status == 502 else None  # 400 until the operator pushes it
            raise AssertionError("a sandbox with an image that is nowhere opened")

        error = s.wait("the ghost environment refused", refused, 180)
        assert "(ImageUnavailable)" in str(error) and "tangram.invalid/ghost:1" in str(error)
        assert not s.pods(NS, "tangram.dev/env=ghost")  # its pod is not left behind

        t = client.open("swe")
        (pod,) = s.pods(NS, f"tangram.dev/trajectory={t.id}")
        container = pod["status"]["containerStatuses"][0]["containerID"].split("://")[1]
        for pid in _processes_of(container):  # as the kernel's OOM killer would
            os.kill(int(pid), signal.SIGKILL)
        s.wait("the trajectory lost", lambda: client.get(t.id).state.value == "lost", 60)
        with pytest.raises(TangramError) as lost:
            client.exec(t.id, ["true"])
        assert lost.value.status == 409 and "(SandboxExited)" in str(lost.value)
        assert "exit code 137" in str(lost.value)
        s.wait("its pod removed", lambda: not s.pods(NS, f"tangram.dev/trajectory={t.id}"), 60)
        client.close(t.id)

    def unhealthy() -> dict[str, Any] | None:
        conditions = (s.get("ap", "coding", NS).get("status") or {}).get("conditions", [])
        cond = next((c for c in conditions if c["type"] == "SandboxesHealthy"), None)
        said = cond["message"] if cond else ""
        both = "ImageUnavailable (TrajectoryEnv ghost" in said and "SandboxExited" in said
        return cond if cond and cond["status"] == "False" and both else None

    cond = s.wait("SandboxesHealthy False naming both causes", unhealthy, 120)
    assert cond["reason"] == "SandboxExited"  # the latest

    def event() -> bool:
        out = s.kubectl("get", "events", "-n", NS, "-o", "json",
                        "--field-selector", "involvedObject.kind=ActionPool").stdout  # fmt: skip
        said = [(e["type"], e["reason"], e["message"]) for e in json.loads(out)["items"]]
        return ("Warning", cond["reason"], cond["message"]) in said

    s.wait("a Warning Event with the condition's cause", event, 60)

    def ghost_failing() -> dict[str, str] | None:
        found = (s.get("tenv", "ghost", NS).get("status") or {}).get("conditions", [])
        conditions = {c["type"]: c for c in found}
        said = conditions.get("SandboxesHealthy")
        return said if said and said["reason"] == "ImageUnavailable" else None

    # Accepted by its pool, and its own sandboxes' failure beside it.
    said = s.wait("the ghost TrajectoryEnv's SandboxesHealthy", ghost_failing, 60)
    assert said["status"] == "False" and "tangram.invalid/ghost:1" in said["message"]
    columns = s.kubectl("get", "tenv", "ghost", "-n", NS, "--no-headers").stdout.split()
    assert columns[3:5] == ["True", "ImageUnavailable"], columns  # NAME POOL IMAGE READY …
    s.kubectl("delete", "tenv", "ghost", "-n", NS)


def test_a_node_that_leaves_the_pool_has_its_sandbox_pods_deleted(session: Session) -> None:
    """The pool's nodeSelector stops matching the node while a trajectory is open there:
    the DaemonSet takes the agent pod away (which keeps the open sandbox, as on a
    restart), the trajectory is lost after agentGraceSeconds, and the operator deletes the
    sandbox pod no agent will take back. Back in the pool, the node serves again."""
    s = session

    def patch(spec: dict[str, Any]) -> None:
        s.kubectl("patch", "ap", "coding", "-n", NS, "--type=merge", "-p",
                  json.dumps({"spec": spec}))  # fmt: skip

    patch({"scheduler": {"agentGraceSeconds": 5}})
    with Client(s.url, s.token("rollout-worker"), retries=30) as client:
        t = client.open("swe")
        (pod,) = s.pods(NS, f"tangram.dev/trajectory={t.id}")
        patch({"cpu": {"nodeSelector": {"tangram.dev/role": "elsewhere"}}})
        agents = "app.kubernetes.io/component=node-agent"
        s.wait("the agent pod gone from the node", lambda: not s.pods(NS, agents), 120)
        s.wait("the trajectory lost", lambda: client.get(t.id).state.value == "lost", 60)
        s.wait("its sandbox pod deleted", lambda: not s.pods(NS, "tangram.dev/sandbox=true"), 90)
        client.close(t.id)

    def event() -> str | None:
        out = s.kubectl("get", "events", "-n", NS, "-o", "json",
                        "--field-selector", "involvedObject.kind=ActionPool").stdout  # fmt: skip
        said = [e["message"] for e in json.loads(out)["items"]
                if (e["type"], e["reason"]) == ("Warning", "OrphanedSandboxesDeleted")]  # fmt: skip
        return said[0] if said else None

    message = s.wait("the operator's Event for the deleted sandbox", event, 30)
    # (a warm sandbox the agent was making as it stopped may go with it)
    assert f"on node {s.node.name} (" in message and pod["metadata"]["name"] in message, message

    patch({"cpu": {"nodeSelector": {"tangram.dev/role": "sandbox"}},
           "scheduler": {"agentGraceSeconds": 120}})  # fmt: skip
    s.wait("a warm sandbox pod again", lambda: s.pods(NS, "tangram.dev/sandbox=true"), 180)
    with Client(s.url, s.token("rollout-worker"), retries=30) as client:
        t = client.open("swe")
        assert client.exec(t.id, ["true"]).status.value == "ok"
        client.close(t.id)


def test_deleting_the_pool_leaves_no_pod_cgroup_or_exec_server(session: Session) -> None:
    s = session
    s.kubectl("delete", "ap", "coding", "-n", NS, "--wait=false")
    s.wait("the pool to go", lambda: not s.kubectl("get", "ap", "-n", NS, "-o", "name").stdout)

    def no_pods() -> bool:
        return not s.kubectl("get", "pods", "-n", NS, "-o", "name").stdout.strip()

    s.wait("every pod of the pool to go", no_pods)
    for controller in ("cpuset", "cpu", "memory"):
        assert s.node.cgroup_dir(controller, s.seen["sandbox"], s.seen["container"]) is None
    assert _processes_of(s.seen["container"]) == []


def _processes_of(container_id: str) -> list[str]:
    """PIDs of the host's processes in the container's cgroups."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if container_id in (entry / "cgroup").read_text():
                    found.append(entry.name)
            except OSError:
                continue
    return found
