"""The pod runtime on the real node: sandboxes are pods the kubelet runs on containerd, the
agent reaches their exec servers through the host's /proc and writes their cgroups, with
no Docker socket anywhere; warm claims, cold opens, a restarted agent taking its pods back
with their files, and nothing left after close."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.controlplane import ControlPlane
from harness.kubelet import RealNode
from harness.pods import wait_for

from tangram.api.wire import EnvSpec
from tangram.node_agent.env_template import DEFAULT_USER
from tangram.node_agent.exec_server import build
from tangram.node_agent.execution import ExecError
from tangram.node_agent.kube_pods import kube_pod_api
from tangram.node_agent.kubelet_state import cpu_manager_policy
from tangram.node_agent.pod_runtime import DEFAULT_EXECD_PATH, PodRuntime

pytestmark = pytest.mark.e2e

NS = "sandboxes"
EXECD_IMAGE = "docker.io/tangram-test/execd:1"
CORES = sorted(os.sched_getaffinity(0))
WARM = "t-1." + "w" * 123 + "-"  # the longest id the API takes, and no label value


@pytest.fixture(scope="module")
def images(
    real_node: RealNode, busybox_on_node: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    """(sandbox image, execd image) in the node's containerd. The execd image holds the
    exec server where the agent's image has it, as the only file."""
    built = build(tmp_path_factory.mktemp("execd"))
    assert built.path is not None, built.reason
    real_node.import_execd_image(built.path, EXECD_IMAGE, DEFAULT_EXECD_PATH)
    return busybox_on_node, EXECD_IMAGE


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    control_plane.kubectl("create", "namespace", NS)
    yield NS
    control_plane.kubectl("delete", "namespace", NS, "--wait=true", timeout=120)


def _runtime(cp: ControlPlane, node: RealNode, execd_image: str) -> PodRuntime:
    return PodRuntime(
        [CORES[0]],
        api=kube_pod_api(NS, str(cp.admin_kubeconfig)),
        node=node.name,
        namespace=NS,
        execd_image=execd_image,
    )


def _run(rt: PodRuntime, t: str, argv: list[str], cores: list[int]) -> Any:
    return asyncio.run(rt.exec(t, argv, cores, timeout_s=60))


def _pods(cp: ControlPlane) -> list[dict[str, Any]]:
    out = cp.kubectl("get", "pods", "-n", NS, "-l", "tangram.dev/sandbox=true", "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def test_sandboxes_are_pods_with_cores_only_while_an_action_runs(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    cp = control_plane
    image, execd_image = images
    rt = _runtime(cp, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, workdir="/work", warm=1, pool="p")

    assert rt.warm(spec) == 1
    # The warm pod is claimed by an id no label can hold (128 characters, ending in "-").
    warm = rt.open(WARM, spec)
    assert warm.warm
    cold = rt.open("t-2", spec)
    assert not cold.warm
    pods = {p["metadata"]["annotations"]["tangram.dev/trajectory"]: p for p in _pods(cp)}
    assert set(pods) == {WARM, "t-2"}
    assert pods["t-2"]["metadata"]["labels"]["tangram.dev/trajectory"] == "t-2"
    pod = pods[WARM]
    assert pod["spec"]["nodeName"] == real_node.name
    assert pod["spec"]["automountServiceAccountToken"] is False
    sandbox = pod["spec"]["containers"][0]
    assert sandbox["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert sandbox["resources"]["limits"]["memory"] == "256Mi"
    assert "cpu" not in sandbox["resources"]["requests"]  # the pool's cores, not the pod's

    # The action's cores inside the pod while it runs; the idle core afterwards.
    core = CORES[-1]
    res = _run(rt, WARM, ["sh", "-c", "grep Cpus_allowed_list /proc/self/status; "
                           "echo kept > /work/f; echo $TANGRAM_DOP"], [core])  # fmt: skip
    assert res.exit_code == 0, res
    assert res.stdout.split() == ["Cpus_allowed_list:", str(core), "1"]
    assert res.path == "fast"
    assert rt.cgroups.cpus(rt.envs[WARM].reach.cgroup) == str(CORES[0])
    # The files API: the pod's exec server writes as the sandbox's user, where it works.
    files = rt.files(WARM)

    async def one_file() -> tuple[bytes, int]:
        async def body() -> Any:
            yield b"through the exec server\n"

        await files.write("g", body())
        _, data = await files.read("/work/g")
        return b"".join([chunk async for chunk in data]), (await files.stat("g")).uid

    got, owner = asyncio.run(one_file())
    assert got == b"through the exec server\n"
    assert str(owner) == _run(rt, WARM, ["id", "-u"], [core]).stdout.strip()

    async def a_tree() -> tuple[tuple[int, int], list[str]]:
        """A directory in as one tar and back out as one."""
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w") as tar:
            for name, content in (("src/a.py", b"a\n"), ("src/b/c.txt", b"c\n")):
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))

        async def body() -> Any:
            yield packed.getvalue()

        counts = await files.untar("tree", body())
        _, data = await files.tar("/work/tree")
        back = b"".join([chunk async for chunk in data])
        with tarfile.open(fileobj=io.BytesIO(back)) as tar:
            return counts, sorted(tar.getnames())

    counts, names = asyncio.run(a_tree())
    assert counts == (2, 4)  # two files, four bytes; their directories made on the way
    assert names == ["src", "src/a.py", "src/b", "src/b/c.txt"]

    # Another agent on the node (another pool, a GPU agent) neither adopts nor deletes them.
    stranger = PodRuntime([CORES[0]], api=kube_pod_api(NS, str(cp.admin_kubeconfig)),
                          node=real_node.name, namespace=NS, execd_image=execd_image,
                          agent="another-pool")  # fmt: skip
    assert stranger.adopt() == [] and len(_pods(cp)) == 2
    # A restarted agent takes its pods back, files and all; nothing was deleted.
    again = _runtime(cp, real_node, execd_image)
    assert again.adopt() == [WARM, "t-2"]
    assert again.cgroups.cpus(again.envs[WARM].reach.cgroup) == str(CORES[0])
    assert _run(again, WARM, ["cat", "/work/f"], [core]).stdout == "kept\n"
    assert len(_pods(cp)) == 2  # the warm one was claimed by t-1

    again.close(WARM)
    again.close("t-2")
    again.shutdown_warm()
    wait_for("every sandbox pod to go", lambda: not _pods(cp), 60)


def test_a_command_cannot_answer_for_the_exec_server(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    """A command that plants its own listener under the socket's name is refused: the
    agent checks the pid that listens (the sandbox's PID 1)."""
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, workdir="/work", pool="p")
    rt.open("t-3", spec)
    try:
        reach = rt.envs["t-3"].reach
        fake = Path(f"/proc/{reach.pid}/root/.tangram/run/fake.sock")
        import socket

        # As a command in the sandbox could: a listener of another process, moved over
        # the real socket's name (the directory is the sandbox's).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as planted:
            planted.bind(str(fake))
            planted.listen(1)
            os.replace(fake, reach.socket)
            with pytest.raises(Exception, match="not by the environment's exec server"):
                _run(rt, "t-3", ["echo", "forged"], [CORES[-1]])
    finally:
        rt.close("t-3")


def _sleepers(container_id: str) -> list[str]:
    """The host's processes of the container (by its cgroup) that run ``sleep``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and container_id in (entry / "cgroup").read_text():
                args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                if "sleep" in args:
                    found.append(args)
        except OSError:
            continue  # ended while looked at
    return found


def test_no_process_outlives_its_action_in_a_sandbox_pod(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    """A command that exits at once, leaving a setsid'd and a double-forked sleeper: the
    action's end ends them (the exec server is their subreaper)."""
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p")
    rt.open("t-8", spec)
    try:
        script = "setsid sleep 1000 & (sleep 1001 &) ; echo started"
        res = _run(rt, "t-8", ["sh", "-c", script], [CORES[-1]])
        assert (res.exit_code, res.timed_out, res.stdout) == (0, False, "started\n")
        assert _sleepers(rt.envs["t-8"].reach.key) == []
    finally:
        rt.close("t-8")
    wait_for("every sandbox pod to go", lambda: not _pods(control_plane), 60)


def test_sandbox_pods_run_unprivileged_unless_root_is_asked_for(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    """busybox has no USER and no /etc/passwd, and its /work is root's: the pod runs as
    the fixed unprivileged user, which owns /work; root only when the env names it."""
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    plain = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p")
    as_root = EnvSpec(name="root-box", image=image, memory_gb=0.25, pool="p", user="0")
    rt.open("t-9", plain)
    rt.open("t-10", as_root)
    try:
        res = _run(rt, "t-9", ["sh", "-c", "id -u; id -g; touch /work/mine && echo wrote"],
                   [CORES[-1]])  # fmt: skip
        assert res.stdout.split() == [str(DEFAULT_USER.uid), str(DEFAULT_USER.gid), "wrote"]
        pods = {p["metadata"]["labels"]["tangram.dev/trajectory"]: p for p in _pods(control_plane)}
        context = pods["t-9"]["spec"]["containers"][0]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (DEFAULT_USER.uid,
                                                                 DEFAULT_USER.gid)  # fmt: skip
        assert _run(rt, "t-10", ["id", "-u"], [CORES[-1]]).stdout == "0\n"
    finally:
        rt.close("t-9")
        rt.close("t-10")
    wait_for("every sandbox pod to go", lambda: not _pods(control_plane), 60)


def test_a_sandbox_pod_that_writes_past_its_disk_limit_is_reported_gone_with_why(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    """diskGiB is the pod's ephemeral-storage limit: the real kubelet evicts the pod once
    its writable layer is over it, and the agent's watch names the cause."""
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p", disk_gb=0.03)  # 31 MiB
    rt.open("t-11", spec)
    (pod,) = _pods(control_plane)
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["limits"]["ephemeral-storage"] == "31Mi"
    res = _run(rt, "t-11", ["sh", "-c", "head -c 67108864 /dev/zero > /work/big"], [CORES[-1]])
    assert res.exit_code == 0, res
    ended = wait_for("the eviction seen", rt.gone, 120)
    assert [(g.trajectory, g.reason) for g in ended] == [("t-11", "DiskLimitExceeded")]
    assert "31Mi" in ended[0].message and "diskGiB" in ended[0].message  # the kubelet's words
    assert "t-11" not in rt.envs
    wait_for("every sandbox pod to go", lambda: not _pods(control_plane), 60)


def test_a_runtime_class_the_cluster_lacks_fails_the_open_naming_it(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p", runtime_class_name="gvisor")
    with pytest.raises(ExecError, match="gvisor") as e:
        rt.open("t-4", spec)
    assert "creating pod" in str(e.value) and e.value.reason == "RuntimeClassNotFound"
    assert "t-4" not in rt.envs and not _pods(control_plane)  # nothing half-made is left


def test_a_runtime_class_whose_handler_the_node_lacks_fails_at_once_naming_it(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    """The RuntimeClass exists, but this node's containerd has no such handler: the pod
    never gets a sandbox; the kubelet says why in an Event, which the runtime reads
    rather than waiting out its start timeout."""
    image, execd_image = images
    rc = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
          "metadata": {"name": "tangram-absent"}, "handler": "tangram-absent"}  # fmt: skip
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(rc))
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p",
                   runtime_class_name="tangram-absent")  # fmt: skip
    try:
        with pytest.raises(ExecError) as e:
            rt.open("t-5", spec)
        assert e.value.reason == "RuntimeClassUnavailable" and not e.value.retryable, e.value
        assert "tangram-absent" in str(e.value)
        wait_for("the pod to go", lambda: not _pods(control_plane), 60)
    finally:
        control_plane.kubectl("delete", "runtimeclass", "tangram-absent", "--ignore-not-found")


def test_a_sandbox_killed_behind_the_agents_back_is_reported_gone_with_why(
    control_plane: ControlPlane, real_node: RealNode, images: tuple[str, str], namespace: str
) -> None:
    image, execd_image = images
    rt = _runtime(control_plane, real_node, execd_image)
    spec = EnvSpec(name="box", image=image, memory_gb=0.25, pool="p")
    rt.open("t-6", spec)
    rt.open("t-7", spec)
    assert rt.gone() == []
    os.kill(rt.envs["t-6"].reach.pid, signal.SIGKILL)  # the sandbox's PID 1
    ended = wait_for("the kill seen", rt.gone, 30)
    assert [(g.trajectory, g.reason) for g in ended] == [("t-6", "SandboxExited")]
    assert "exit code 137" in ended[0].message
    assert set(rt.envs) == {"t-7"}
    control_plane.kubectl("delete", "pod", "-n", NS, "-l", "tangram.dev/trajectory=t-7",
                          "--wait=false")  # fmt: skip
    ended = wait_for("the deletion seen", rt.gone, 30)
    assert [(g.trajectory, g.reason) for g in ended] == [("t-7", "SandboxDeleted")]
    wait_for("every sandbox pod to go", lambda: not _pods(control_plane), 60)


def test_the_agent_reads_the_real_kubelets_cpu_manager_policy(real_node: RealNode) -> None:
    """Through the kubelet's own process, under its own --root-dir: this node's is none."""
    assert cpu_manager_policy() == "none"
