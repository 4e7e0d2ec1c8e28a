"""The pod runtime against a fake Kubernetes API (no cluster): a pod is warm or open only
once it is set up, an API error leaves no pod behind nor fails a pod that starts, and a
restarted agent keeps one pod per trajectory."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from tangram.api.wire import EnvSpec
from tangram.node_agent.env_template import digest
from tangram.node_agent.execution import ExecError
from tangram.node_agent.fast_path import Reachable
from tangram.node_agent.pod_runtime import AGENT, OPENED_AT, STATE, TRAJECTORY, PodRuntime
from tangram.node_agent.pod_template import LABEL, SANDBOX, label_value, sandbox_pod

SPEC = EnvSpec(name="swe", image="swe:1", pool="p", setup=[["pip", "install", "x"]])


def _busy(what: str) -> ExecError:
    return ExecError(f"{what}: the API server answered 429 Too Many Requests", retryable=True)


class FakeApi:
    """Pods by name, running as soon as they are created; what fails is set per test."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.lose_create_answer = False  # stored, then a 504 (or a read timeout)
        self.get_errors: list[ExecError] = []  # raised by the next reads, in turn

    def create(self, manifest: dict[str, Any]) -> None:
        pod = copy.deepcopy(manifest)
        name = pod["metadata"]["name"]
        pod["status"] = {"phase": "Running", "containerStatuses": [
            {"name": SANDBOX, "state": {"running": {}}, "containerID": f"containerd://{name}"}
        ]}  # fmt: skip
        self.pods[name] = pod
        if self.lose_create_answer:
            raise ExecError(f"creating pod {name}: the API server answered 504", retryable=True)

    def get(self, name: str) -> dict[str, Any] | None:
        if self.get_errors:
            raise self.get_errors.pop(0)
        return copy.deepcopy(self.pods.get(name))

    def events(self, name: str) -> list[dict[str, Any]]:
        return []

    def list(self, selector: str) -> list[dict[str, Any]]:
        want = dict(kv.split("=") for kv in selector.split(","))
        return [copy.deepcopy(p) for p in self.pods.values()
                if all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]  # fmt: skip

    def label(self, name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
        if name not in self.pods:
            raise ExecError(f"labelling pod {name}: the API server answered 404 Not Found")
        meta = self.pods[name]["metadata"]
        meta["labels"].update(labels)
        meta.setdefault("annotations", {}).update(annotations)

    def delete(self, name: str) -> None:
        self.pods.pop(name, None)  # (404 is no error)

    def state(self, name: str) -> str:
        return str(self.pods[name]["metadata"]["labels"][STATE])


class Runtime(PodRuntime):
    """Pods reached and limited without /proc or cgroups; ``prepare`` stands for setup."""

    def __init__(self, api: FakeApi, tmp: Path) -> None:
        (tmp / "proc").mkdir(exist_ok=True)
        (tmp / "cg").mkdir(exist_ok=True)
        super().__init__([0], api=api, node="n1", namespace="ns", execd_image="x", agent="a",
                         cgroup_root=tmp / "cg", proc_root=tmp / "proc")  # fmt: skip
        self.tmp = tmp
        self.prepare: Callable[[], None] = lambda: None

    def _reach(self, obj: dict[str, Any], *, wait_s: float) -> Reachable:
        return Reachable(obj["metadata"]["name"], self.tmp / "s", 1, "g", "/")

    def _limit(self, reach: Reachable, quota_cores: float | None) -> None:
        pass

    def _learn_facts(self, template: EnvSpec, reach: Reachable) -> bool:
        return False

    def _prepare(self, reach: Reachable, template: EnvSpec) -> None:
        self.prepare()


def _runtime(api: FakeApi, tmp: Path) -> Runtime:
    return Runtime(api, tmp)


class KilledError(Exception):
    """The agent dies here (kill -9, OOM, an upgrade): its handlers never run."""


@pytest.mark.parametrize("trajectory", [None, "t-1"])
def test_a_pod_is_warm_or_open_only_once_prepared_and_a_successor_deletes_it_before(
    tmp_path: Path, trajectory: str | None
) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    successor = _runtime(api, tmp_path)
    seen: dict[str, Any] = {}

    def killed_while_preparing() -> None:
        (name,) = api.pods
        seen["state"] = api.state(name)
        seen["adopted"] = successor.adopt()
        raise KilledError

    rt.prepare = killed_while_preparing
    with pytest.raises(KilledError):
        if trajectory:
            rt.open(trajectory, SPEC)
        else:
            rt.warm(SPEC.model_copy(update={"warm": 1}))
    assert seen["state"] == "preparing"
    # Its setup may never have run: neither a warm pod nor the trajectory's, and deleted.
    assert seen["adopted"] == [] and not any(successor.warm_pool.values())
    assert api.pods == {}


def test_a_prepared_pod_is_labelled_warm_then_open(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    assert rt.warm(SPEC.model_copy(update={"warm": 1})) == 1
    (name,) = api.pods
    assert api.state(name) == "warm"
    assert rt.open("t-1", SPEC.model_copy(update={"warm": 1})).warm
    assert api.state(name) == "open"
    rt.open("t-2", SPEC)
    (cold,) = set(api.pods) - {name}
    assert api.state(cold) == "open"
    assert api.pods[cold]["metadata"]["annotations"][TRAJECTORY] == "t-2"


def test_pods_of_an_agent_from_before_the_preparing_state_are_taken_back(tmp_path: Path) -> None:
    api = FakeApi()
    api.pods["w"] = _pod("w", "warm")
    api.pods["o"] = _pod("o", "open", "t-1", annotate=False)  # the id only as its label
    rt = _runtime(api, tmp_path)
    assert rt.adopt() == ["t-1"]
    assert [p.name for p in rt.warm_pool[digest(SPEC)]] == ["w"]
    assert set(api.pods) == {"w", "o"}


def test_a_create_whose_answer_was_lost_leaves_no_pod(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    api.lose_create_answer = True
    with pytest.raises(ExecError) as failed:
        rt.open("t-1", SPEC)
    assert failed.value.retryable
    assert api.pods == {}  # stored, but deleted by name
    api.lose_create_answer = False
    rt.open("t-1", SPEC)  # the retry
    assert list(api.pods) == [rt.envs["t-1"].name]


def _pod(name: str, state: str, trajectory: str | None = None, *, created: str = "",
         opened: str = "", annotate: bool = True, node: str = "n1") -> dict[str, Any]:  # fmt: skip
    labels = {f"{LABEL}/sandbox": "true", AGENT: label_value("a"), STATE: state,
              f"{LABEL}/template": digest(SPEC), f"{LABEL}/env": SPEC.name,
              f"{LABEL}/node": label_value(node)}  # fmt: skip
    notes = {}
    if trajectory:
        labels[TRAJECTORY] = label_value(trajectory)
        if annotate:
            notes[TRAJECTORY] = trajectory
    if opened:
        notes[OPENED_AT] = opened
    meta = {"name": name, "labels": labels, "annotations": notes,
            "creationTimestamp": created or "2025-01-01T00:00:00Z"}  # fmt: skip
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": SANDBOX}]},
            "status": {}}  # fmt: skip


def test_a_restarted_agent_leaves_the_pods_of_other_nodes_alone(tmp_path: Path) -> None:
    """Every agent of a pool has one id (the same state dir on every node): a restart of
    one must not take, nor delete, the sandboxes another node's agent holds."""
    api = FakeApi()
    for state, trajectory in (("open", "t-9"), ("warm", None), ("preparing", None)):
        api.pods[f"n2-{state}"] = _pod(f"n2-{state}", state, trajectory, node="n2")
    api.pods["n1-open"] = _pod("n1-open", "open", "t-1")
    # (a pod labelled for this node but bound to another: its label cannot be trusted)
    api.pods["moved"] = _pod("moved", "warm", node="n1")
    api.pods["moved"]["spec"]["nodeName"] = "n2"
    rt = _runtime(api, tmp_path)
    assert rt.adopt() == ["t-1"]
    assert set(api.pods) == {"n2-open", "n2-warm", "n2-preparing", "n1-open", "moved"}
    assert rt.warm_pool == {}


def test_a_warm_pod_that_died_while_it_waited_is_not_handed_out(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    rt.warm(SPEC.model_copy(update={"warm": 1}))
    ((dead,),) = rt.warm_pool.values()
    # Its exec server is no longer the process it was found with (evicted, OOM-killed).
    (tmp_path / "proc" / "7").mkdir()
    dead.reach = Reachable(dead.name, tmp_path / "s", 7, "g", "/", 12345, tmp_path / "proc")
    opened = rt.open("t-1", SPEC)
    assert not opened.warm and rt.envs["t-1"].name != dead.name
    assert dead.name not in api.pods  # discarded, not left holding the node's memory


def test_a_restarted_agent_keeps_the_last_opened_pod_of_a_trajectory(tmp_path: Path) -> None:
    api = FakeApi()
    # A warm pod made first but claimed last (its claim's answer was lost, the open
    # retried elsewhere before another open took it back): the claim's time decides.
    api.pods["claimed"] = _pod("claimed", "open", "t-1", created="2025-01-01T00:00:00Z",
                               opened="2025-01-01T00:10:00.000002+00:00")  # fmt: skip
    api.pods["made"] = _pod("made", "open", "t-1", created="2025-01-01T00:05:00Z",
                            opened="2025-01-01T00:10:00.000001+00:00")  # fmt: skip
    # An older agent's pods say only when they were made: the last made is kept.
    api.pods["old-1"] = _pod("old-1", "open", "t-2", created="2025-01-01T00:01:00Z")
    api.pods["old-2"] = _pod("old-2", "open", "t-2", created="2025-01-01T00:02:00Z")
    api.pods["old-0"] = _pod("old-0", "open", "t-2", created="2025-01-01T00:00:30Z")
    rt = _runtime(api, tmp_path)
    assert rt.adopt() == ["t-1", "t-2"]
    assert {t: p.name for t, p in rt.envs.items()} == {"t-1": "claimed", "t-2": "old-2"}
    assert set(api.pods) == {"claimed", "old-2"}  # the others deleted, none left unheld


def test_opens_record_when_they_happened_so_the_latest_wins(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    rt.open("t-1", SPEC)
    first = rt.envs["t-1"].name
    rt.envs.clear()  # as if its answer was lost and the open ran again
    rt.open("t-1", SPEC)
    second = rt.envs["t-1"].name
    again = _runtime(api, tmp_path)
    assert again.adopt() == ["t-1"]
    assert again.envs["t-1"].name == second and set(api.pods) == {second}
    assert first != second


def test_a_busy_api_server_while_a_pod_starts_is_asked_again(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    api.get_errors = [_busy("reading pod"), ExecError("reading pod: 503", retryable=True)]
    rt.open("t-1", SPEC)
    assert list(api.pods) == [rt.envs["t-1"].name]


def test_a_refusal_while_a_pod_starts_still_fails_the_open_at_once(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    api.get_errors = [ExecError("reading pod: the API server answered 403 Forbidden")]
    with pytest.raises(ExecError, match="403"):
        rt.open("t-1", SPEC)
    assert api.pods == {}


def test_a_busy_api_server_past_the_start_deadline_fails_the_open(tmp_path: Path) -> None:
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    rt.start_timeout_s = 0.0  # past the deadline at the first answer
    api.get_errors = [_busy("reading pod")] * 3
    with pytest.raises(ExecError, match="429") as failed:
        rt.open("t-1", SPEC)
    assert failed.value.retryable and api.pods == {}


def test_warm_pods_of_an_env_no_longer_kept_warm_are_deleted_and_open_ones_kept(
    tmp_path: Path,
) -> None:
    """An env removed or set to warm 0: its warm pods each hold the env's memory on the
    node, and nothing else would delete them (a restarted agent would adopt them again)."""
    api = FakeApi()
    rt = _runtime(api, tmp_path)
    other = SPEC.model_copy(update={"name": "other", "image": "other:1", "warm": 1})
    rt.warm(SPEC.model_copy(update={"warm": 3}))
    assert rt.open("t-1", SPEC).warm  # one of them becomes the trajectory's
    before = set(api.pods)
    rt.warm(other)
    (kept,) = set(api.pods) - before

    def states() -> list[str]:
        return sorted(api.state(name) for name in api.pods)

    assert states() == ["open", "warm", "warm", "warm"]
    assert rt.retire_warm({"other"}) == 2
    assert states() == ["open", "warm"]  # the trajectory's pod and the kept env's warm one
    assert api.state(kept) == "warm"
    assert not rt.open("t-2", SPEC).warm  # nothing warm of the retired env is left
    assert rt.open("t-3", other).warm  # the kept env's is
    assert rt.retire_warm({"other", SPEC.name}) == 0


@pytest.mark.parametrize("workdir", ["/tmp", "/tmp/", "/work"])
def test_a_read_only_root_mounts_each_path_once(workdir: str) -> None:
    """Two mounts at one path make a pod the API server refuses (mountPath must be unique)."""
    env = SPEC.model_copy(update={"workdir": workdir, "read_only_root": True})
    pod = sandbox_pod(env, name="n", namespace="ns", node="n1", execd_image="x",
                      execd_path="/x", extra_labels={})  # fmt: skip
    (sandbox,) = [c for c in pod["spec"]["containers"] if c["name"] == SANDBOX]
    paths = [str(PurePosixPath(m["mountPath"])) for m in sandbox["volumeMounts"]]
    assert len(paths) == len(set(paths)) and "/tmp" in paths
    assert str(PurePosixPath(workdir)) in paths  # writable, as the root is not
    names = {m["name"] for m in sandbox["volumeMounts"]}
    assert names <= {v["name"] for v in pod["spec"]["volumes"]}


@pytest.mark.parametrize("disk_gb", [None, 1.0])
def test_the_exec_servers_socket_directory_is_a_small_tmpfs(disk_gb: float | None) -> None:
    """The sandbox's user can write /.tangram/run: a memory emptyDir is a tmpfs the kubelet
    sizes by its sizeLimit, so writes there fail at that size, whatever the env's disk
    limit. On the node's disk they would fill it until the kubelet next measured the
    volume, and end the sandbox for a reason that is not its disk limit."""
    env = SPEC.model_copy(update={"disk_gb": disk_gb})
    pod = sandbox_pod(env, name="n", namespace="ns", node="n1", execd_image="x",
                      execd_path="/x", extra_labels={})  # fmt: skip
    (sandbox,) = [c for c in pod["spec"]["containers"] if c["name"] == SANDBOX]
    (mount,) = [m for m in sandbox["volumeMounts"] if m["mountPath"] == "/.tangram/run"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"] == "64Ki"


def test_what_a_read_only_root_pod_shows_of_its_workdir_is_not_taken_for_the_image(
    tmp_path: Path,
) -> None:
    """Its workdir is an emptyDir (0777): an env of the same image with a writable root
    must still learn that the image lacks the workdir (and mount one the user owns)."""
    proc = tmp_path / "proc"
    root = proc / "42" / "root"
    (root / "etc").mkdir(parents=True)
    (proc / "42" / "status").write_text("Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "work").mkdir()
    (root / "work").chmod(0o777)  # the read-only env's emptyDir
    (tmp_path / "cg").mkdir()
    rt = PodRuntime([0], api=FakeApi(), node="n1", namespace="ns", execd_image="x", agent="a",
                    cgroup_root=tmp_path / "cg", proc_root=proc)  # fmt: skip
    ro = EnvSpec(name="ro", image="img:1", pool="p", read_only_root=True)
    rw = EnvSpec(name="rw", image="img:1", pool="p")
    rt._learn_facts(ro, Reachable("k", tmp_path / "s", 42, "g", "/work"))
    (root / "work").rmdir()  # what the rw env's first pod shows: the image has none
    assert rt._learn_facts(rw, Reachable("k", tmp_path / "s", 42, "g", "/work"))  # remade
    assert rt._facts[rt._facts_key(rw)][1] is None  # its next pods get their own workdir


def test_a_sandbox_that_ends_as_it_starts_fails_its_open_naming_the_pod(tmp_path: Path) -> None:
    """The API may show the container running after its processes ended (killed, OOM at
    start): the open fails with the pod's name and a reason the pool's status counts,
    not a bare OSError or a hint at the agent's configuration alone."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "cg").mkdir()
    api = FakeApi()
    rt = PodRuntime([0], api=api, node="n1", namespace="ns", execd_image="x", agent="a",
                    cgroup_root=tmp_path / "cg", proc_root=tmp_path / "proc")  # fmt: skip
    with pytest.raises(ExecError) as e:
        rt.open("t-1", SPEC)
    assert e.value.reason == "SandboxStartFailed"
    assert str(e.value).startswith("pod ns/tangram-p-") and "ended as it started" in str(e.value)
    assert api.pods == {}  # the pod is deleted


def test_a_sandbox_whose_init_is_gone_once_its_server_is_up_fails_naming_the_pod(
    tmp_path: Path,
) -> None:
    """/proc/<pid>/stat gone after the cgroup and socket were seen: a start time of 0
    would read later as "alive whatever runs under that pid"; the open fails instead."""
    from tangram.node_agent.exec_server import IN_CONTAINER_RUN, SOCKET_NAME

    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "42" / "root" / IN_CONTAINER_RUN.lstrip("/")).mkdir(parents=True)
    (proc / "42" / "root" / IN_CONTAINER_RUN.lstrip("/") / SOCKET_NAME).touch()
    (proc / "42" / "cgroup").write_text("0::/pods/abc123\n")
    (proc / "42" / "status").write_text("NSpid:\t42\t1\n")  # no stat: the process is gone
    (cg / "pods" / "abc123").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu\n")
    (cg / "pods" / "abc123" / "cpuset.cpus").write_text("0\n")
    rt = PodRuntime([0], api=FakeApi(), node="n1", namespace="ns", execd_image="x", agent="a",
                    cgroup_root=cg, proc_root=proc)  # fmt: skip
    pod = {
        "metadata": {"name": "tangram-p-1"},
        "spec": {"containers": [{"name": SANDBOX}]},
        "status": {"containerStatuses": [
            {"name": SANDBOX, "containerID": "containerd://abc123", "state": {"running": {}}},
        ]},
    }  # fmt: skip
    with pytest.raises(ExecError) as e:
        rt._reach(pod, wait_s=0.1)
    assert e.value.reason == "SandboxStartFailed"
    assert str(e.value) == (
        "pod ns/tangram-p-1: its sandbox ended as it started (its init process is gone)"
    )


def test_a_failed_start_is_said_by_the_sandbox_container_not_the_completed_init() -> None:
    """The init container that copies the exec server in had done its work ("Completed"),
    and its state was what an open, the pool's status and its Events said of an image
    that could not be pulled."""
    from tangram.node_agent.pod_runtime import _why

    status = {
        "initContainerStatuses": [{"name": "tangram-execd", "state": {
            "terminated": {"exitCode": 0, "reason": "Completed"}}}],
        "containerStatuses": [{"name": "sandbox", "state": {"waiting": {
            "reason": "ErrImagePull", "message": "pull access denied for nowhere/absent"}}}],
    }  # fmt: skip
    assert _why(status) == "sandbox: ErrImagePull pull access denied for nowhere/absent"
    failed_init = {"initContainerStatuses": [{"name": "tangram-execd", "state": {
        "terminated": {"exitCode": 1, "reason": "Error", "message": "no space"}}}]}  # fmt: skip
    assert _why(failed_init) == "tangram-execd: Error no space"
