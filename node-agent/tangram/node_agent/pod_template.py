"""The sandbox pod an environment runs in on Kubernetes (pure: EnvSpec in, manifest out).

The pod runs on any CRI runtime (containerd, CRI-O) with runc-like runtimes, whose
container processes the agent reaches through the host's /proc (``runtimeClassName`` is
passed through; gVisor and Kata sandboxes are not host processes and do not work yet).
Its init container copies the exec server out of the node agent's image into a volume;
the sandbox container runs it as PID 1 (the image's own entrypoint is not used, as with
Docker). Hardening is that of the Docker runtime: every capability
dropped, no privilege escalation, RuntimeDefault seccomp, no service-account token, no
service links, memory requested and limited to the environment's, the root file system
read-only where the environment allows.

CPU: the sandbox requests none. Its cores are the pool's: the node agent's pod requests
them, and the agent gives each action its cores by writing the container's cgroup only
while the action runs (idle, the container has the idle cores at a small quota).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from tangram.api.resources import RESERVED_DIR
from tangram.api.wire import EnvSpec
from tangram.node_agent.env_template import User, digest
from tangram.node_agent.exec_server import IN_CONTAINER_RUN, SOCKET_NAME

SANDBOX = "sandbox"  # the container's name
EXECD_DIR = f"{RESERVED_DIR}/bin"
EXECD = f"{EXECD_DIR}/execd"
RUN_SIZE = "64Ki"  # the exec server's socket directory: one inode, no data
LABEL = "tangram.dev"
MANAGED_BY = "tangram-node-agent"
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def label_value(text: str) -> str:
    """``text`` as a label value: itself when Kubernetes takes it (at most 63 characters,
    alphanumeric at both ends), else a digest of it. Whoever needs the text back reads it
    from an annotation (trajectory ids hold 128 characters and may end in ``-``)."""
    if _LABEL_VALUE.match(text):
        return text
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def labels(template: EnvSpec, node: str) -> dict[str, str]:
    """What identifies an agent's sandboxes: the pool, the node and the template."""
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{LABEL}/sandbox": "true",
        f"{LABEL}/pool": template.pool,
        f"{LABEL}/env": template.name,
        f"{LABEL}/template": digest(template),
        f"{LABEL}/node": label_value(node),
        # The pool's NetworkPolicy denies every sandbox labelled so all traffic.
        f"{LABEL}/network": "none" if template.network == "none" else "allowed",
    }


def sandbox_pod(
    template: EnvSpec,
    *,
    name: str,
    namespace: str,
    node: str,
    execd_image: str,
    execd_path: str,
    extra_labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
    owner: Mapping[str, Any] | None = None,
    user: User | None = None,
    own_workdir: bool = False,
) -> dict[str, Any]:
    """The Pod manifest, bound to ``node`` (the scheduler chose it, not kube-scheduler).

    ``user``: the uid:gid commands run as (None: the image's). ``own_workdir``: the image
    lacks the workdir, so an emptyDir is mounted there (writable by any user).
    """
    memory = f"{round(template.memory_gb * 1024)}Mi"
    restricted: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    mounts = [
        {"name": "tangram-bin", "mountPath": EXECD_DIR, "readOnly": True},
        {"name": "tangram-run", "mountPath": IN_CONTAINER_RUN},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tangram-bin", "emptyDir": {"sizeLimit": "16Mi"}},
        # The socket's directory, which the sandbox's user can write: a tmpfs of RUN_SIZE
        # (the kubelet mounts a memory emptyDir with its sizeLimit as its size), so what a
        # command puts there fails at that size and is charged to the sandbox's memory. On
        # the node's disk it would be evicted only once the kubelet measured it (every
        # volume stats period, a minute by default), for a reason not the env's disk limit.
        {"name": "tangram-run", "emptyDir": {"medium": "Memory", "sizeLimit": RUN_SIZE}},
    ]
    if own_workdir or template.read_only_root:
        mounts.append({"name": "workdir", "mountPath": template.workdir})
        volumes.append({"name": "workdir", "emptyDir": {}})
    if template.read_only_root and PurePosixPath(template.workdir) != PurePosixPath("/tmp"):
        # (a workdir at /tmp is that writable emptyDir already: a second mount there is
        # a pod the API server refuses)
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
        volumes.append({"name": "tmp", "emptyDir": {}})
    sandbox: dict[str, Any] = {
        "name": SANDBOX,
        "image": template.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [EXECD, f"{IN_CONTAINER_RUN}/{SOCKET_NAME}"],
        "args": [],
        "workingDir": template.workdir,
        "env": [{"name": k, "value": v} for k, v in sorted(template.env.items())],
        "resources": {"requests": {"memory": memory}, "limits": {"memory": memory}},
        "securityContext": {**restricted, "readOnlyRootFilesystem": template.read_only_root},
        "volumeMounts": mounts,
    }
    if template.disk_gb is not None:
        # The kubelet evicts a pod over it: its writable layer, logs and emptyDirs (the
        # workdir, when the image lacks it) count.
        disk = f"{round(template.disk_gb * 1024)}Mi"
        sandbox["resources"]["requests"]["ephemeral-storage"] = disk
        sandbox["resources"]["limits"]["ephemeral-storage"] = disk
    if user is not None:
        sandbox["securityContext"].update(runAsUser=user.uid, runAsGroup=user.gid)
    spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",  # a sandbox that died lost its processes: report it
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [
            {
                "name": "tangram-execd",
                "image": execd_image,
                "imagePullPolicy": "IfNotPresent",
                "command": [execd_path, "--install", EXECD],
                "securityContext": {**restricted, "readOnlyRootFilesystem": True},
                "resources": {"requests": {"memory": "16Mi"}, "limits": {"memory": "16Mi"}},
                "volumeMounts": [{"name": "tangram-bin", "mountPath": EXECD_DIR}],
            }
        ],
        "containers": [sandbox],
        "volumes": volumes,
    }
    if template.runtime_class_name:
        spec["runtimeClassName"] = template.runtime_class_name
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {**labels(template, node), **extra_labels},
    }
    if annotations:
        metadata["annotations"] = dict(annotations)
    if owner:  # the ActionPool: deleting the pool deletes its sandboxes
        metadata["ownerReferences"] = [dict(owner)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
