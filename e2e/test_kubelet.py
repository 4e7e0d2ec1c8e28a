"""The real node itself: a kubelet + containerd joined to the control plane runs pods of
images made here, the API server reaches it (exec, logs), and a pod container's cgroup
written from the host takes effect inside the pod, which is what the pod runtime's
allocate-on-execution rests on."""

from __future__ import annotations

import json
import os

import pytest
from harness.controlplane import ControlPlane
from harness.kubelet import RealNode
from harness.pods import wait_for

pytestmark = pytest.mark.e2e

NS = "node-check"


def _pod(name: str, image: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "nodeName": "",  # filled below: bound by the scheduler otherwise
                "containers": [
                    {
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "command": ["sleep", "3600"],
                    }
                ],
                "terminationGracePeriodSeconds": 0,
            },
        }
    )


def test_a_pod_runs_on_the_real_node_and_its_cpuset_follows_the_host(
    control_plane: ControlPlane, real_node: RealNode, busybox_on_node: str
) -> None:
    cp = control_plane
    cp.kubectl("create", "namespace", NS)
    pod = json.loads(_pod("probe", busybox_on_node))
    pod["spec"]["nodeName"] = real_node.name
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(pod))

    def running() -> dict[str, object] | None:
        obj = json.loads(cp.kubectl("get", "pod", "probe", "-n", NS, "-o", "json").stdout)
        return obj if obj["status"].get("phase") == "Running" else None

    obj = wait_for("the probe pod Running", running, 120)
    node = json.loads(cp.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.34.10"
    done = cp.kubectl("exec", "probe", "-n", NS, "--", "sh", "-c", "echo hello; id -u")
    assert done.stdout == "hello\n0\n"

    # The container's cgroup, from its id in the pod's status; one core written from the
    # host is what the container sees at its next command.
    status = obj["status"]["containerStatuses"][0]
    container_id = status["containerID"].removeprefix("containerd://")
    group = real_node.cgroup_dir("cpuset", obj["metadata"]["uid"], container_id)
    assert group is not None
    core = max(os.sched_getaffinity(0))
    (group / "cpuset.cpus").write_text(str(core))
    seen = cp.kubectl("exec", "probe", "-n", NS, "--", "grep", "Cpus_allowed_list",
                      "/proc/self/status").stdout  # fmt: skip
    assert seen.split() == ["Cpus_allowed_list:", str(core)]

    cp.kubectl("delete", "namespace", NS, "--wait=true", timeout=120)
    wait_for("the kubelet to remove the container's cgroup", lambda: not group.exists(), 60)
