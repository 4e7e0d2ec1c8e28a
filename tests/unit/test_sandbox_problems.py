"""Sandbox failures, from what the kubelet writes to what the pool's status says: the pod
runtime's reading of pod statuses and Events, the kubelet's CPU manager policy read
through its process, the scheduler's window of causes, and the SandboxesHealthy
condition the operator makes of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tangram.api.wire import PoolFigures, ProblemFigure
from tangram.node_agent.kubelet_state import cpu_manager_policy
from tangram.node_agent.pod_runtime import (
    _sandbox_event,
    ending,
    evicted_by_event,
    not_starting,
)
from tangram.operator.status import SANDBOXES_HEALTHY, PoolObservation, pool_status
from tangram.service.problems import ProblemLog

WHERE = "rl/tangram-coding-1"
NOW = "2026-11-24T08:00:00Z"


def _pod(
    phase: str = "Running",
    *,
    reason: str = "",
    message: str = "",
    state: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the kubelet reports it (the fields the runtime reads)."""
    meta: dict[str, Any] = {"name": "tangram-coding-1"}
    if deleting:
        meta["deletionTimestamp"] = NOW
    status: dict[str, Any] = {"phase": phase, "reason": reason, "message": message}
    if state is not None:
        status["containerStatuses"] = [{"name": "sandbox", "state": state}]
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "sandbox", "image": "ghcr.io/x/env:1"}]}}  # fmt: skip


# ---- a pod that will not start ------------------------------------------------------------
@pytest.mark.parametrize(
    ("waiting", "reason"),
    [
        ("ErrImageNeverPull", "ImageUnavailable"),
        ("ImagePullBackOff", "ImageUnavailable"),
        ("InvalidImageName", "ImageUnavailable"),
        ("CreateContainerConfigError", "SandboxStartFailed"),
        ("RunContainerError", "SandboxStartFailed"),
    ],
)
def test_a_container_that_will_not_start_fails_at_once_not_retryable(
    waiting: str, reason: str
) -> None:
    pod = _pod("Pending", state={"waiting": {"reason": waiting, "message": "said the kubelet"}})
    failed = not_starting(pod, WHERE)
    assert failed is not None and failed.reason == reason and not failed.retryable
    assert waiting in str(failed) and "said the kubelet" in str(failed)


def test_a_pod_that_may_still_start_is_waited_for() -> None:
    creating = _pod("Pending", state={"waiting": {"reason": "ContainerCreating"}})
    assert not_starting(creating, WHERE) is None
    assert not_starting(_pod("Pending"), WHERE) is None


def test_an_eviction_at_start_is_worth_retrying_elsewhere() -> None:
    evicted = _pod("Failed", reason="Evicted", message="The node was low on resource: memory.")
    failed = not_starting(evicted, WHERE)
    assert failed is not None and failed.reason == "SandboxEvicted" and failed.retryable


def test_a_missing_runtime_handler_is_read_from_the_pods_events() -> None:
    events = [
        {"type": "Normal", "reason": "Scheduled", "message": "assigned"},
        {
            "type": "Warning",
            "reason": "FailedCreatePodSandBox",
            "lastTimestamp": NOW,
            "message": 'Failed to create pod sandbox: rpc error: code = Unknown desc = failed '
            'to get sandbox runtime: no runtime for "gvisor" is configured',
        },
    ]  # fmt: skip
    said, failed = _sandbox_event(events, WHERE)
    assert failed is not None and failed.reason == "RuntimeClassUnavailable"
    assert 'no runtime for "gvisor"' in str(failed) and said.startswith("FailedCreatePodSandBox")
    other = [{"type": "Warning", "reason": "FailedMount", "message": "no volume"}]
    assert _sandbox_event(other, WHERE) == ("FailedMount: no volume", None)
    assert _sandbox_event([], WHERE) == ("", None)


# ---- a sandbox that ended ---------------------------------------------------------------
def test_why_a_sandbox_ended_is_read_from_its_pod() -> None:
    assert ending(None, WHERE) == ("SandboxDeleted", f"pod {WHERE} was deleted")
    evicted = _pod("Failed", reason="Evicted", message="low on memory",
                   state={"terminated": {"exitCode": 137}})  # fmt: skip
    assert ending(evicted, WHERE) == ("SandboxEvicted", f"pod {WHERE} was evicted: low on memory")
    for said in (  # the kubelet's words (pkg/kubelet/eviction/helpers.go)
        "Pod ephemeral local storage usage exceeds the total limit of containers 64Mi. ",
        'Container sandbox exceeded its local ephemeral storage limit "64Mi". ',
    ):
        full = _pod("Failed", reason="Evicted", message=said,
                    state={"terminated": {"exitCode": 137}})  # fmt: skip
        reason, message = ending(full, WHERE) or ("", "")
        assert reason == "DiskLimitExceeded" and said.strip() in message and "diskGiB" in message
    # A sandbox that ends at SIGTERM leaves a Succeeded pod with no reason: the kubelet's
    # Event tells the eviction.
    events = [{"type": "Normal", "reason": "Pulled"},
              {"type": "Warning", "reason": "Evicted",
               "message": "Pod ephemeral local storage usage exceeds the total limit of "
                          "containers 31Mi. "}]  # fmt: skip
    assert (evicted_by_event(events, WHERE) or ("",))[0] == "DiskLimitExceeded"
    assert evicted_by_event(events[:1], WHERE) is None
    memory = [{"reason": "Evicted", "message": "The node was low on resource: memory. "}]
    assert (evicted_by_event(memory, WHERE) or ("",))[0] == "SandboxEvicted"
    oom = _pod("Failed", state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})
    reason, message = ending(oom, WHERE) or ("", "")
    assert reason == "SandboxOOMKilled" and "memoryGB" in message
    killed = _pod("Failed", state={"terminated": {"exitCode": 137, "reason": "Error"}})
    assert ending(killed, WHERE) == (
        "SandboxExited", f"pod {WHERE}: the sandbox ended with exit code 137 (Error)"
    )  # fmt: skip
    assert ending(_pod(deleting=True, state={"running": {}}), WHERE) == (
        "SandboxDeleted", f"pod {WHERE} was deleted"
    )  # fmt: skip


def test_a_pod_still_shown_running_is_not_judged_yet() -> None:
    assert ending(_pod(state={"running": {"startedAt": NOW}}), WHERE) is None


# ---- the kubelet's CPU manager ------------------------------------------------------------
def _kubelet(
    proc: Path, pid: int, argv: list[str], files: dict[str, str], comm: str = "kubelet"
) -> None:
    """A kubelet process as /proc shows it, its files under its root."""
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "comm").write_text(f"{comm}\n")
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    for path, text in files.items():
        target = entry / "root" / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _checkpoint(policy: str) -> str:
    return json.dumps({"policyName": policy, "defaultCpuSet": "0-3", "checksum": 1})


def test_the_policy_comes_from_the_kubelets_checkpoint_under_its_own_root_dir(
    tmp_path: Path,
) -> None:
    other = tmp_path / "1"
    other.mkdir()
    (other / "comm").write_text("containerd\n")
    _kubelet(tmp_path, 40, ["/usr/bin/kubelet", "--root-dir=/srv/kubelet", "--v=1"],
             {"/srv/kubelet/cpu_manager_state": _checkpoint("static"),
              "/var/lib/kubelet/cpu_manager_state": _checkpoint("none")})  # fmt: skip
    assert cpu_manager_policy(tmp_path) == "static"


def test_without_a_checkpoint_the_flag_then_the_config_file_then_the_default(
    tmp_path: Path,
) -> None:
    _kubelet(tmp_path / "a", 7, ["kubelet", "--cpu-manager-policy", "static"], {})
    assert cpu_manager_policy(tmp_path / "a") == "static"
    config = "kind: KubeletConfiguration\ncpuManagerPolicy: static\n"
    _kubelet(tmp_path / "b", 7, ["kubelet", "--config=/etc/kubelet.yaml"],
             {"/etc/kubelet.yaml": config})  # fmt: skip
    assert cpu_manager_policy(tmp_path / "b") == "static"
    _kubelet(tmp_path / "c", 7, ["kubelet", "--config", "/etc/kubelet.yaml"],
             {"/etc/kubelet.yaml": "kind: KubeletConfiguration\n"})  # fmt: skip
    assert cpu_manager_policy(tmp_path / "c") == "none"
    _kubelet(tmp_path / "d", 7, ["kubelet"], {})
    assert cpu_manager_policy(tmp_path / "d") == "none"


def test_a_kubelet_embedded_in_k3s_is_read_from_its_checkpoint_or_kubelet_args(
    tmp_path: Path,
) -> None:
    _kubelet(tmp_path / "a", 9, ["/usr/local/bin/k3s", "server"],
             {"/var/lib/kubelet/cpu_manager_state": _checkpoint("static")},
             comm="k3s-server")  # fmt: skip
    assert cpu_manager_policy(tmp_path / "a") == "static"
    argv = ["k3s", "agent", "--kubelet-arg=root-dir=/srv/k", "--kubelet-arg",
            "cpu-manager-policy=static", "--node-label", "x=y"]  # fmt: skip
    _kubelet(tmp_path / "b", 9, argv, {}, comm="k3s-agent")
    assert cpu_manager_policy(tmp_path / "b") == "static"
    _kubelet(tmp_path / "c", 9, argv[:3], {"/srv/k/cpu_manager_state": _checkpoint("none")},
             comm="k3s-agent")  # fmt: skip
    assert cpu_manager_policy(tmp_path / "c") == "none"
    _kubelet(tmp_path / "d", 9, ["k3s", "server", "--node-label", "cpu-manager-policy=static"],
             {}, comm="k3s-server")  # fmt: skip
    assert cpu_manager_policy(tmp_path / "d") == "none"  # not a kubelet's flag


def test_no_visible_kubelet_is_no_policy(tmp_path: Path) -> None:
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "comm").write_text("bash\n")
    (tmp_path / "self").mkdir()
    assert cpu_manager_policy(tmp_path) is None


# ---- the scheduler's window of causes -----------------------------------------------------
def test_causes_are_counted_per_subject_latest_first_and_forgotten_after_the_window() -> None:
    log = ProblemLog(window_s=600)
    log.note("ImageUnavailable", "TrajectoryEnv ghost", "first", now=0)
    log.note("ImageUnavailable", "TrajectoryEnv ghost", "second", now=100)
    log.note("SandboxEvicted", "TrajectoryEnv box", "evicted", now=50)
    seen = log.recent(now=120)
    assert [(p.reason, p.subject, p.count, p.message) for p in seen] == [
        ("ImageUnavailable", "TrajectoryEnv ghost", 2, "second"),
        ("SandboxEvicted", "TrajectoryEnv box", 1, "evicted"),
    ]
    assert seen[0].last_s == 20
    assert [p.reason for p in log.recent(now=651)] == ["ImageUnavailable"]
    assert log.recent(now=701) == []
    log.note("ImageUnavailable", "TrajectoryEnv ghost", "again", now=800)
    assert log.recent(now=800)[0].count == 1  # a new run of failures counts afresh


def test_the_log_stays_bounded_whatever_agents_report() -> None:
    log = ProblemLog()
    for i in range(1000):
        log.note("SandboxExited", f"TrajectoryEnv e{i}", "x", now=float(i))
    kept = log.recent(now=1000.0)
    assert len(kept) == 256 and kept[0].subject == "TrajectoryEnv e999"


# ---- the condition --------------------------------------------------------------------
def _status(problems: list[ProblemFigure], previous: Any = ()) -> Any:
    figures = PoolFigures(pool="coding", epoch="e", accepting=True, draining=False, nodes=1,
                          cores=4, cores_in_use=0, gpus=0, gpus_in_use=0, queue_depth=0,
                          running=0, trajectories=0, apis={}, environments=1,
                          problems=problems)  # fmt: skip
    seen = PoolObservation(generation=1, previous=list(previous), endpoint="http://x",
                           scheduler_available=True, figures=figures)  # fmt: skip
    status = pool_status(None, seen, NOW)
    return status, next(c for c in status.conditions if c.type == SANDBOXES_HEALTHY)


def test_sandboxes_healthy_names_the_latest_cause_and_clears_by_itself() -> None:
    problems = [
        ProblemFigure(reason="ImageUnavailable", subject="TrajectoryEnv ghost", count=3,
                      message="image ghcr.io/x:1 is not on node n1", last_s=2),
        ProblemFigure(reason="SandboxEvicted", subject="TrajectoryEnv box", count=1,
                      message="evicted", last_s=40),
    ]  # fmt: skip
    status, cond = _status(problems)
    assert (cond.status, cond.reason) == ("False", "ImageUnavailable")
    assert cond.message == (
        "ImageUnavailable (TrajectoryEnv ghost, 3×): image ghcr.io/x:1 is not on node n1; "
        "SandboxEvicted (TrajectoryEnv box, 1×): evicted"
    )
    _, healthy = _status([], previous=status.conditions)
    assert (healthy.status, healthy.reason) == ("True", "NoRecentFailures")


def test_without_the_schedulers_figures_the_last_sandbox_condition_stands() -> None:
    status, cond = _status([ProblemFigure(reason="SandboxExited", subject="TrajectoryEnv b",
                                          count=1, message="m", last_s=0)])  # fmt: skip
    seen = PoolObservation(generation=1, previous=status.conditions, endpoint="http://x",
                           scheduler_available=True, unreachable="refused")  # fmt: skip
    kept = next(c for c in pool_status(None, seen, NOW).conditions if c.type == SANDBOXES_HEALTHY)
    assert kept == cond


# ---- cgroups the agent cannot write -------------------------------------------------------
def test_an_unwritable_cgroup_of_a_live_sandbox_is_the_nodes_problem(tmp_path: Path) -> None:
    """A sandbox whose cgroup write fails while its exec server lives: CgroupsUnwritable
    (the agent's mounts); once the sandbox is gone, the same failure names no cause (its
    end is reported as such)."""
    import os

    from tangram.node_agent.cgroups import CgroupError
    from tangram.node_agent.execution import ExecError
    from tangram.node_agent.fast_path import FastPath, Reachable, start_time

    class ReadOnly:
        version = 2

        def limit(self, group: str, cores: Any, quota_cores: Any) -> None:
            raise CgroupError(f"writing '3' to /sys/fs/cgroup/{group}/cpuset.cpus: Read-only")

    fast = FastPath(ReadOnly(), [0])  # type: ignore[arg-type]
    me = os.getpid()
    live = Reachable("k", tmp_path / "s", me, "kubepods/pod1/c1", "/", start_time(me))
    with pytest.raises(ExecError) as e:
        fast.group_enter(live, [3])
    assert e.value.reason == "CgroupsUnwritable" and "Read-only" in str(e.value)
    ended = Reachable("k", tmp_path / "s", me, "kubepods/pod1/c1", "/", start_time(me) + 1)
    with pytest.raises(ExecError) as e:
        fast.group_enter(ended, [3])
    assert e.value.reason == ""


def test_giving_back_the_cores_of_an_environment_that_went_is_no_error(tmp_path: Path) -> None:
    """A container removed under its command takes its cgroup along; the write that gives
    the command's cores back failed, and its error (``writing '0' to .../cpuset.cpus``)
    replaced the command's own ending, which looks for why the environment ended
    (SandboxDeleted). A live environment's failed write is still an error."""
    import os

    from tangram.node_agent.cgroups import CgroupError
    from tangram.node_agent.execution import ExecError
    from tangram.node_agent.fast_path import FastPath, Reachable, start_time

    class GoneAfterEnter:
        version = 1
        entered = False

        def limit(self, group: str, cores: Any, quota_cores: Any) -> None:
            if self.entered:
                raise CgroupError(f"writing '0' to /sys/fs/cgroup/cpuset/{group}: No such file")
            self.entered = True

    me = os.getpid()
    fast = FastPath(GoneAfterEnter(), [0])  # type: ignore[arg-type]
    ended = Reachable("k", tmp_path / "s", me, "docker/c1", "/", start_time(me) + 1)
    fast.group_enter(ended, [3])
    fast.group_leave(ended, [3])  # no error: the group went with the environment
    fast = FastPath(GoneAfterEnter(), [0])  # type: ignore[arg-type]
    live = Reachable("k", tmp_path / "s", me, "docker/c1", "/", start_time(me))
    fast.group_enter(live, [3])
    with pytest.raises(ExecError, match="No such file"):
        fast.group_leave(live, [3])


def test_cores_of_an_action_whose_cgroup_write_failed_are_not_kept_for_the_next(
    tmp_path: Path,
) -> None:
    import os

    from tangram.node_agent.cgroups import CgroupError
    from tangram.node_agent.execution import ExecError
    from tangram.node_agent.fast_path import FastPath, Reachable, start_time

    class FailsOnce:
        version = 2
        written: list[list[int]] = []  # noqa: RUF012
        failed = False

        def limit(self, group: str, cores: Any, quota_cores: Any) -> None:
            if not self.failed:
                self.failed = True
                raise CgroupError("writing cpuset.cpus: Device or resource busy")
            self.written.append(list(cores))

    cgroups = FailsOnce()
    fast = FastPath(cgroups, [0])  # type: ignore[arg-type]
    me = os.getpid()
    env = Reachable("k", tmp_path / "s", me, "g", "/", start_time(me))
    with pytest.raises(ExecError):
        fast.group_enter(env, [3])
    fast.group_enter(env, [5])
    assert cgroups.written == [[5]]  # not [3, 5]: the failed action holds nothing
