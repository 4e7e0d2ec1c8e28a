"""Desired state of an ActionPool: pure functions from custom resources to manifests.

No I/O, no clock, no randomness: the same resources give identical dicts, so the operator
can diff desired against live objects. What needs the cluster or randomness (the pool's
uid, the agent token) is passed in.

Children of ``ActionPool <pool>`` in namespace ``<ns>``, all owned by the pool (deleting it
garbage-collects them; the two cluster-scoped ones excepted, below):

- ConfigMap ``tangram-<pool>-config``: ``pool.yaml``, the pool and its TrajectoryEnvs and
  RewardServices (never Secrets: credentials stay in their Secrets).
- Secret ``tangram-<pool>-tokens``: ``tokens``, the scheduler's ``TOKEN TENANT`` file (the
  node agents' token and the operator's), and ``agent``, the agents' own file with their
  token only (an agent never holds the operator's token, which may reload the config).
- ServiceAccounts ``tangram-<pool>-scheduler`` and ``tangram-<pool>-agent``.
- Role/RoleBinding ``tangram-<pool>-agent`` (pods of the namespace: the node agents' sandbox
  pods) and NetworkPolicy ``tangram-<pool>-sandboxes`` (no traffic for sandboxes of
  environments with ``network: none``), when the pool has agents.
- Role/RoleBinding ``tangram-<pool>-scheduler`` (read the three kinds, get only the Secrets
  of ``spec.apis[*].secretRef``), ClusterRole/ClusterRoleBinding
  ``tangram-<ns>.<pool>-tokenreview`` (create TokenReviews, to authenticate clients by
  their ServiceAccount tokens). These two are cluster-scoped and so carry no
  ownerReference (see :func:`cluster_metadata`).
- Deployment and Service ``tangram-<pool>-scheduler``.
- DaemonSets ``tangram-<pool>-cpu-agent`` (when ``spec.cpu``) and ``tangram-<pool>-gpu-agent``
  (when ``spec.gpu``); an API-only pool has none. The two selectors should pick disjoint
  nodes: a scheduler knows one agent per node name.

Config changes do not restart the scheduler: the pod template carries no checksum of the
config. Kubelet refreshes the mounted ConfigMap (a projected volume, never a subPath), and
the operator then tells the running scheduler to reload (``tangram serve`` re-reads its
files on SIGHUP), so open trajectories and queued actions survive an edit.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from tangram.api.resources import (
    API_VERSION,
    GROUP,
    PLURALS,
    ActionPool,
    RewardService,
    TrajectoryEnv,
)
from tangram.api.tokens import token_lines

Manifest = dict[str, Any]

CONFIG_DIR = "/etc/tangram"
POOL_FILE = f"{CONFIG_DIR}/pool.yaml"
TOKEN_FILE = f"{CONFIG_DIR}/tokens"
SCHEDULER_TOKENS_KEY = "tokens"  # keys of the tokens Secret
AGENT_TOKENS_KEY = "agent"
AGENT_ROLE = "tangram.dev/agent-role"  # cpu | gpu: which DaemonSet an agent pod is of
AGENT_TENANT = "system:agent"  # tangram.service.auth.AGENT_TENANT; the operator sits apart
OPERATOR_TENANT = "system:operator"  # tangram.service.auth.OPERATOR_TENANT
STATE_ROOT = "/var/lib/tangram"
CGROUP_ROOT = "/sys/fs/cgroup"
NONROOT_UID = 65532  # the distroless "nonroot" user; any non-zero uid works
MIN_TOKEN_CHARS = 16  # what TokenStore accepts
POOL_NAMESPACE_LABEL = "tangram.dev/pool-namespace"


@dataclass(frozen=True)
class Loopback:
    """Single-node test clusters whose pod network reaches nothing (the project's e2e on a
    bare kubelet): the pool's scheduler and node agents run on the node's network, the
    scheduler bound to 127.0.0.1, and they reach the API server at ``api_host:api_port``
    instead of through the ``kubernetes`` Service (whose ClusterIP nothing routes there).
    Never for a shared cluster: host-network pods share the node's ports, so every pool
    needs its own ``spec.scheduler.port``."""

    api_host: str
    api_port: int

    @classmethod
    def parse(cls, address: str) -> Loopback:
        """``HOST:PORT`` (``[::1]:PORT`` for IPv6) of an API server on the loopback."""
        host, sep, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            loopback = bool(sep) and ipaddress.ip_address(host).is_loopback
            number = int(port)
        except ValueError:
            loopback, number = False, 0
        if not loopback or not 0 < number < 65536:
            raise ValueError(
                f"{address!r}: give the API server as a loopback HOST:PORT, e.g. 127.0.0.1:6443"
            )
        return cls(host, number)

    def env(self) -> list[Manifest]:
        # The client libraries' in-cluster configuration reads these; a variable the pod
        # spec sets wins over the kubelet's own for the Service.
        return [
            {"name": "KUBERNETES_SERVICE_HOST", "value": self.api_host},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.api_port)},
        ]


LOOPBACK_HOST = "127.0.0.1"


def _host_network(loopback: Loopback | None) -> Manifest:
    if loopback is None:
        return {}
    return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


# --- names and metadata -----------------------------------------------------------------------


def child_name(pool: ActionPool, suffix: str) -> str:
    return f"tangram-{pool.metadata.name}-{suffix}"


def selector_labels(pool: ActionPool, component: str) -> dict[str, str]:
    """The labels a workload selects its pods by (selectors are immutable: keep them few)."""
    return {
        "app.kubernetes.io/name": "arl-tangram",
        "app.kubernetes.io/instance": pool.metadata.name,
        "app.kubernetes.io/component": component,
    }


def label_selector(labels: dict[str, str]) -> str:
    """``labels`` as a label selector (``k=v,...``)."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def cpu_agent_pods_selector(pool: ActionPool) -> str:
    """The pool's CPU node-agent pods: the ones that make and take back sandbox pods (a
    GPU agent serves RewardService calls alone)."""
    return label_selector({**selector_labels(pool, "node-agent"), AGENT_ROLE: "cpu"})


def sandbox_pods_selector(pool: ActionPool) -> str:
    """The sandbox pods the pool's node agents made (as ``pod_template.labels`` labels
    them; pool names are DNS labels, so the name is its own label value)."""
    return label_selector({"tangram.dev/sandbox": "true", "tangram.dev/pool": pool.metadata.name})


def labels(pool: ActionPool, component: str) -> dict[str, str]:
    return {**selector_labels(pool, component), "app.kubernetes.io/managed-by": "tangram-operator"}


def owner_reference(pool: ActionPool, uid: str) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": "ActionPool",
        "name": pool.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(pool: ActionPool, name: str, component: str, uid: str) -> Manifest:
    return {
        "name": name,
        "namespace": pool.metadata.namespace,
        "labels": labels(pool, component),
        "ownerReferences": [owner_reference(pool, uid)],
    }


def cluster_metadata(pool: ActionPool, name: str, component: str) -> Manifest:
    """Metadata of a cluster-scoped child. It has no ownerReference: the garbage collector
    treats a namespaced owner of a cluster-scoped object as unresolvable and never collects
    it. The pool's finalizer deletes these by their labels instead."""
    return {
        "name": name,
        "labels": {**labels(pool, component), POOL_NAMESPACE_LABEL: pool.metadata.namespace},
    }


# --- the pool's documents ---------------------------------------------------------------------


def _document(obj: ActionPool | TrajectoryEnv | RewardService) -> Manifest:
    return obj.model_dump(by_alias=True, exclude_none=True, exclude={"status"}, mode="json")


def pool_documents(
    pool: ActionPool, envs: Iterable[TrajectoryEnv], services: Iterable[RewardService]
) -> str:
    """``pool.yaml``: the pool, then its envs and services sorted by key (input order must
    not change the ConfigMap)."""
    docs = [_document(pool)]
    docs += [_document(e) for e in sorted(envs, key=lambda e: e.key)]
    docs += [_document(s) for s in sorted(services, key=lambda s: s.key)]
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def config_map(
    pool: ActionPool,
    envs: Iterable[TrajectoryEnv],
    services: Iterable[RewardService],
    uid: str,
) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pool, child_name(pool, "config"), "scheduler", uid),
        "data": {"pool.yaml": pool_documents(pool, envs, services)},
    }


def learned_config_map(pool: ActionPool, uid: str) -> Manifest:
    """Where the scheduler keeps what it learned (its key ``learned.json``, written by the
    scheduler alone: applied without data, the operator never owns or resets it). Owned
    by the pool: it outlives the scheduler's pods, and goes with the pool."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pool, child_name(pool, "learned"), "scheduler", uid),
    }


def token_secret(pool: ActionPool, agent_token: str, operator_token: str, uid: str) -> Manifest:
    for name, token in (("agent_token", agent_token), ("operator_token", operator_token)):
        if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ValueError(f"{name}: at least {MIN_TOKEN_CHARS} characters, no whitespace")
    if agent_token == operator_token:
        raise ValueError("agent_token and operator_token must differ")
    agent = f"{agent_token} {AGENT_TENANT}\n"
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(pool, child_name(pool, "tokens"), "scheduler", uid),
        "type": "Opaque",
        "stringData": {
            SCHEDULER_TOKENS_KEY: agent + f"{operator_token} {OPERATOR_TENANT}\n",
            AGENT_TOKENS_KEY: agent,
        },
    }


def parse_tokens(text: str) -> dict[str, str]:
    """tenant -> token of a ``TOKEN TENANT`` file (the live Secret's, to keep its tokens)."""
    return {fields[1]: fields[0] for _, fields in token_lines(text) if len(fields) == 2}


# --- identities and RBAC ----------------------------------------------------------------------


def service_account(pool: ActionPool, component: str, suffix: str, uid: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(pool, child_name(pool, suffix), component, uid),
        # The scheduler (TokenReview, Secrets, its CRs) and the node agents (their sandbox
        # pods) talk to the API server; their pods say so themselves.
        "automountServiceAccountToken": False,
    }


def secret_names(pool: ActionPool) -> list[str]:
    """The Secrets named by ``spec.apis[*].secretRef``, sorted, each once."""
    return sorted({q.secret_ref.name for q in pool.spec.apis if q.secret_ref is not None})


def scheduler_role(pool: ActionPool, uid: str) -> Manifest:
    rules: list[Manifest] = [
        {
            "apiGroups": [GROUP],
            "resources": sorted(PLURALS.values()),
            "verbs": ["get", "list", "watch"],
        }
    ]
    # Its learned state: this one ConfigMap, read and patched (never created: the
    # operator makes it, so no rule grants every ConfigMap of the namespace).
    learned = child_name(pool, "learned")
    rules.append(
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [learned],
         "verbs": ["get", "patch"]}
    )  # fmt: skip
    names = secret_names(pool)
    if names:  # a rule without resourceNames would grant every Secret of the namespace
        rules.append(
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get"]}
        )
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(pool, child_name(pool, "scheduler"), "scheduler", uid),
        "rules": rules,
    }


def _scheduler_subject(pool: ActionPool) -> Manifest:
    return {
        "kind": "ServiceAccount",
        "name": child_name(pool, "scheduler"),
        "namespace": pool.metadata.namespace,
    }


def role_binding(pool: ActionPool, suffix: str, component: str, uid: str) -> Manifest:
    """Binds Role ``tangram-<pool>-<suffix>`` to the ServiceAccount of the same name."""
    name = child_name(pool, suffix)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(pool, name, component, uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": name, "namespace": pool.metadata.namespace}
        ],
    }


def tokenreview_name(pool: ActionPool) -> str:
    # Cluster-scoped: pools of the same name in two namespaces must not collide, nor may
    # namespace "a-b" with pool "c" and namespace "a" with pool "b-c". Neither name holds
    # a ".", so it tells them apart.
    return f"tangram-{pool.metadata.namespace}.{pool.metadata.name}-tokenreview"


def tokenreview_cluster_role(pool: ActionPool) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": cluster_metadata(pool, tokenreview_name(pool), "scheduler"),
        "rules": [
            {
                "apiGroups": ["authentication.k8s.io"],
                "resources": ["tokenreviews"],
                "verbs": ["create"],
            }
        ],
    }


def tokenreview_cluster_role_binding(pool: ActionPool) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": cluster_metadata(pool, tokenreview_name(pool), "scheduler"),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": tokenreview_name(pool),
        },
        "subjects": [_scheduler_subject(pool)],
    }


def agent_role(pool: ActionPool, uid: str) -> Manifest:
    """The node agents may manage pods in the pool's namespace, nothing else: the sandbox
    pods they create, claim (relabel), list after a restart and delete; and read the
    Events of a sandbox pod that does not start (they name the kubelet's reason)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(pool, child_name(pool, "agent"), "node-agent", uid),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["pods"],
                "verbs": ["create", "delete", "get", "list", "patch", "watch"],
            },
            {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
        ],
    }


def sandbox_network_policy(pool: ActionPool, uid: str) -> Manifest:
    """Sandboxes of environments with ``network: none`` get no traffic in or out (the pod
    runtime labels them ``tangram.dev/network=none``); enforced where the cluster's network
    plugin implements NetworkPolicy."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(pool, child_name(pool, "sandboxes"), "node-agent", uid),
        "spec": {
            "podSelector": {
                "matchLabels": {
                    "tangram.dev/pool": pool.metadata.name,
                    "tangram.dev/network": "none",
                }
            },
            "policyTypes": ["Ingress", "Egress"],
        },
    }


# --- the scheduler ----------------------------------------------------------------------------


def scheduler_address(pool: ActionPool, loopback: bool = False) -> str:
    """``host:port`` of the pool's scheduler: its Service's cluster DNS name (on a loopback
    test cluster, the scheduler's port on the node)."""
    ns, port = pool.metadata.namespace, pool.spec.scheduler.port
    host = LOOPBACK_HOST if loopback else f"{child_name(pool, 'scheduler')}.{ns}.svc"
    return f"{host}:{port}"


def scheduler_url(pool: ActionPool, loopback: Loopback | None = None) -> str:
    """Where node agents connect."""
    return f"ws://{scheduler_address(pool, loopback is not None)}/v1/agents"


def _restricted_security_context() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _scratch_volume() -> Manifest:
    # The root filesystem is read-only; Python and libraries may still want a /tmp.
    return {"name": "tmp", "emptyDir": {}}


def scheduler_container(pool: ActionPool, image: str, loopback: Loopback | None) -> Manifest:
    port = pool.spec.scheduler.port
    # Probes go through the named port, so a port change in the spec needs no probe edit.
    return {
        "name": "scheduler",
        "image": image,
        "command": [
            "tangram",
            "serve",
            "-f",
            POOL_FILE,
            "--token-file",
            TOKEN_FILE,
            "--host",
            LOOPBACK_HOST if loopback else "0.0.0.0",
            "--port",
            str(port),
            "--kubernetes",  # TokenReview for clients, secretRefs from the API server
            "--learned-configmap",
            f"{pool.metadata.namespace}/{child_name(pool, 'learned')}",
            "--log-json",
        ],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        **({"env": loopback.env()} if loopback else {}),
        "resources": {k: dict(v) for k, v in sorted(pool.spec.scheduler.resources.items())},
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "securityContext": _restricted_security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def scheduler_deployment(
    pool: ActionPool, image: str, uid: str, loopback: Loopback | None = None
) -> Manifest:
    name = child_name(pool, "scheduler")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(pool, name, "scheduler", uid),
        "spec": {
            "replicas": pool.spec.scheduler.replicas,
            # One scheduler owns the pool's units: never two at once, even mid-rollout.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(pool, "scheduler")},
            "template": {
                # No config checksum here on purpose: a config change must not restart
                # the scheduler (the operator has it reload instead).
                "metadata": {"labels": labels(pool, "scheduler")},
                "spec": {
                    "serviceAccountName": name,
                    "automountServiceAccountToken": True,  # TokenReview, Secrets, its CRs
                    **_host_network(loopback),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": NONROOT_UID,
                        "runAsGroup": NONROOT_UID,
                        "fsGroup": NONROOT_UID,  # lets the non-root user read the tokens
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [scheduler_container(pool, image, loopback)],
                    "volumes": [
                        {
                            # Projected, not subPath: kubelet refreshes it in place.
                            "name": "config",
                            "projected": {
                                "defaultMode": 0o440,
                                "sources": [
                                    {"configMap": {"name": child_name(pool, "config")}},
                                    {
                                        "secret": {
                                            "name": child_name(pool, "tokens"),
                                            "items": [
                                                {"key": SCHEDULER_TOKENS_KEY, "path": "tokens"}
                                            ],
                                        }
                                    },
                                ],
                            },
                        },
                        _scratch_volume(),
                    ],
                },
            },
        },
    }


def scheduler_service(pool: ActionPool, uid: str) -> Manifest:
    port = pool.spec.scheduler.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pool, child_name(pool, "scheduler"), "scheduler", uid),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(pool, "scheduler"),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
            # The scheduler is Ready only once an agent is connected, and agents connect
            # through this Service: without this neither would ever happen. Clients that
            # come early get 503 with Retry-After, which tangram.client honours.
            "publishNotReadyAddresses": True,
        },
    }


# --- the node agents --------------------------------------------------------------------------


def state_dir(pool: ActionPool, role: str) -> str:
    # Per pool: two pools' agents on one node keep their environments and key journals
    # apart, pools of one name in two namespaces too.
    base = f"{STATE_ROOT}/{pool.metadata.namespace}/{pool.metadata.name}"
    return base if role == "cpu" else f"{base}-{role}"


def agent_command(
    pool: ActionPool, role: str, image: str, uid: str, loopback: Loopback | None = None
) -> list[str]:
    cpu = pool.spec.cpu if role == "cpu" else None
    idle = cpu.idle_cores if cpu is not None else 1
    command = [
        "tangram", "agent", "--scheduler", scheduler_url(pool, loopback),
        "--token-file", TOKEN_FILE, "--node", "$(NODE_NAME)", "--state-dir", state_dir(pool, role),
        "--idle-cores", str(idle), "--log-json",
        # Sandboxes are pods the kubelet runs on the node's CRI runtime; never "auto",
        # which means Docker (a node of a current cluster has no Docker Engine).
        "--runtime", "pod", "--namespace", "$(POD_NAMESPACE)",
        # The init container of each sandbox copies the exec server out of this image.
        "--execd-image", image, "--pool-name", pool.metadata.name, "--pool-uid", uid,
        # GPU agents serve RewardService calls on the node's CUDA devices; CPU agents never
        # load PyTorch.
        "--gpus", "auto" if role == "gpu" else "none",
    ]  # fmt: skip
    if cpu is not None and cpu.cores_per_node is not None:
        command += ["--cores", str(cpu.cores_per_node)]
    return command


def _host_path(name: str, path: str, kind: str) -> Manifest:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def agent_container(
    pool: ActionPool, role: str, image: str, uid: str, loopback: Loopback | None = None
) -> Manifest:
    state = state_dir(pool, role)
    env: list[Manifest] = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *(loopback.env() if loopback else []),
    ]
    extra: Manifest = {}
    cpu = pool.spec.cpu if role == "cpu" else None
    if cpu is not None and cpu.cores_per_node is not None:
        # The pool's cores are accounted here, once: sandbox pods request none, and get
        # their action's cores from the agent only while the action runs.
        extra["resources"] = {"requests": {"cpu": str(cpu.cores_per_node + cpu.idle_cores)}}
    if role == "gpu":
        gpus = pool.spec.gpu.gpus_per_node if pool.spec.gpu is not None else None
        if gpus is not None:  # the device plugin hands exactly these to the agent
            extra["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        else:  # every GPU of the node, through the NVIDIA container runtime
            env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"})
        env.append({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})
    return {
        "name": "agent",
        "image": image,
        "command": agent_command(pool, role, image, uid, loopback),
        "env": env,
        **extra,
        # Privileged, and only the agent container: on cgroup v2 it is the one way to get
        # the host cgroup namespace (Kubernetes has no field for it, and containerd and
        # CRI-O give every unprivileged container a private one, where the
        # /proc/<pid>/cgroup paths of the sandboxes no longer name their directories under
        # /sys/fs/cgroup); and the agent reaches each sandbox's exec server through
        # /proc/<pid>/root, which takes ptrace rights over processes of other users.
        # Capabilities alone cannot change a namespace. What stays confined is what is not
        # needed: an API token that may only manage pods of its namespace, no host
        # network (but on a loopback test cluster), a read-only root, two host paths
        # (docs/install.md).
        "securityContext": {
            "privileged": True,
            "runAsUser": 0,  # cgroupfs files and the Docker socket belong to root
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [
            {"name": "tokens", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "cgroup", "mountPath": CGROUP_ROOT},
            # The trajectories' metadata, kept across agent restarts with their pods.
            {"name": "state", "mountPath": state},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def agent_daemon_set(
    pool: ActionPool, role: str, image: str, uid: str, loopback: Loopback | None = None
) -> Manifest:
    """The node agents of one section (``cpu`` or ``gpu``) of the pool.

    The agent creates the sandbox pods of its node through the API server (its own
    ServiceAccount, allowed pods in the pool's namespace only), finds their exec servers in
    the host's ``/proc`` (host PID namespace), writes their cgroups (cpuset, CPU quota) and
    keeps the trajectories' metadata in a host directory. It needs no container runtime
    socket: the kubelet runs the sandboxes on whatever CRI runtime the node has.
    """
    section = pool.spec.cpu if role == "cpu" else pool.spec.gpu
    if section is None:
        raise ValueError(f"ActionPool {pool.metadata.name}: no spec.{role}, so no {role} agents")
    name = child_name(pool, f"{role}-agent")
    match = {**selector_labels(pool, "node-agent"), AGENT_ROLE: role}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": metadata(pool, name, "node-agent", uid),
        "spec": {
            "selector": {"matchLabels": match},
            "template": {
                "metadata": {"labels": {**labels(pool, "node-agent"), **match}},
                "spec": {
                    "serviceAccountName": child_name(pool, "agent"),
                    "automountServiceAccountToken": True,  # it manages its sandbox pods
                    "hostPID": True,
                    **_host_network(loopback),
                    "nodeSelector": dict(sorted(section.node_selector.items())),
                    "containers": [agent_container(pool, role, image, uid, loopback)],
                    "volumes": [
                        {
                            "name": "tokens",
                            "secret": {
                                "secretName": child_name(pool, "tokens"),
                                "defaultMode": 0o400,
                                # Only the agents' own token, never the operator's.
                                "items": [{"key": AGENT_TOKENS_KEY, "path": "tokens"}],
                            },
                        },
                        _host_path("cgroup", CGROUP_ROOT, "Directory"),
                        _host_path("state", state_dir(pool, role), "DirectoryOrCreate"),
                        _scratch_volume(),
                    ],
                },
            },
        },
    }


# --- everything -------------------------------------------------------------------------------


def build_pool(
    pool: ActionPool,
    *,
    image: str,
    envs: list[TrajectoryEnv],
    services: list[RewardService],
    uid: str,
    agent_token: str,
    operator_token: str,
    gpu_image: str | None = None,
    loopback: Loopback | None = None,
) -> list[Manifest]:
    """Every object the pool needs, in an order that can be applied first to last.

    ``gpu_image``: the GPU agents' image (one with the ``gpu`` extra: PyTorch); default
    ``image``.

    ``uid``: the ActionPool's metadata.uid (the model's metadata does not keep it).
    ``agent_token``, ``operator_token``: what node agents and the operator present to the
    scheduler (≥ 16 characters each); the operator creates them once and passes the live
    Secret's values on later reconciles.
    ``envs``/``services``: the pool's members, already checked to reference it.
    ``loopback``: a single-node test cluster's host network (:class:`Loopback`).
    """
    objects = [
        config_map(pool, envs, services, uid),
        learned_config_map(pool, uid),
        token_secret(pool, agent_token, operator_token, uid),
        service_account(pool, "scheduler", "scheduler", uid),
        service_account(pool, "node-agent", "agent", uid),
        scheduler_role(pool, uid),
        role_binding(pool, "scheduler", "scheduler", uid),
        tokenreview_cluster_role(pool),
        tokenreview_cluster_role_binding(pool),
        scheduler_deployment(pool, image, uid, loopback),
        scheduler_service(pool, uid),
    ]
    roles = [r for r, section in (("cpu", pool.spec.cpu), ("gpu", pool.spec.gpu)) if section]
    if roles:
        objects += [
            agent_role(pool, uid),
            role_binding(pool, "agent", "node-agent", uid),
            sandbox_network_policy(pool, uid),
        ]
    objects += [
        agent_daemon_set(pool, role, gpu_image or image if role == "gpu" else image, uid, loopback)
        for role in roles
    ]
    return objects


__all__ = [
    "LOOPBACK_HOST",
    "Loopback",
    "Manifest",
    "build_pool",
    "parse_tokens",
    "scheduler_address",
    "scheduler_url",
]
