"""The operator's desired-state builders, fed with the example manifests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram.api.documents import Document, Resources, parse_documents
from tangram.api.resources import ActionPool
from tangram.cli.manifests import load_documents
from tangram.operator.builders import Loopback, build_pool, parse_tokens, token_secret

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "manifests" / "examples"
UID = "0f1e2d3c-0000-4000-8000-000000000001"
TOKEN = "agent-token-0123456789abcdef"
OP_TOKEN = "operator-token-0123456789abcdef"
IMAGE = "ghcr.io/example/arl-tangram:0.1.0"
NAMESPACED = {"ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding", "Deployment",
              "Service", "DaemonSet", "NetworkPolicy"}  # fmt: skip


def _resources(example: str) -> Resources:
    return load_documents([EXAMPLES / example / "pool.yaml"])


def _build(resources: Resources, pool_name: str) -> list[dict[str, Any]]:
    pool = next(p for p in resources.pools.values() if p.metadata.name == pool_name)
    envs = [e for e in resources.envs.values() if e.pool_key() == pool.key]
    services = [s for s in resources.services.values() if s.pool_key() == pool.key]
    return _pool_objects(pool, envs=envs, services=services)


def _pool_objects(pool: ActionPool, **given: Any) -> list[dict[str, Any]]:
    """build_pool with the test's image, uid and tokens unless ``given``."""
    kw: dict[str, Any] = dict(image=IMAGE, envs=[], services=[], uid=UID, agent_token=TOKEN,
                              operator_token=OP_TOKEN)  # fmt: skip
    return build_pool(pool, **{**kw, **given})


def _one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


@pytest.fixture(scope="module")
def coding() -> list[dict[str, Any]]:
    return _build(_resources("coding"), "coding")


@pytest.fixture(scope="module")
def deepsearch() -> list[dict[str, Any]]:
    return _build(_resources("deepsearch"), "deepsearch")


@pytest.mark.parametrize(
    ("example", "pool"),
    [("coding", "coding"), ("deepsearch", "deepsearch"), ("mopd", "mopd"), ("local", "local")],
)
def test_every_child_is_labelled_named_and_owned(example: str, pool: str) -> None:
    resources = _resources(example)
    namespace = next(
        p for p in resources.pools.values() if p.metadata.name == pool
    ).metadata.namespace
    objects = _build(resources, pool)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["name"].startswith(f"tangram-{pool}-") or meta["name"].startswith(
            f"tangram-{namespace}.{pool}-"
        )
        assert meta["labels"]["app.kubernetes.io/name"] == "arl-tangram"
        assert meta["labels"]["app.kubernetes.io/instance"] == pool
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "tangram-operator"
        assert meta["labels"]["app.kubernetes.io/component"] in ("scheduler", "node-agent")
        if obj["kind"] in NAMESPACED:
            assert meta["namespace"] == namespace
            assert meta["ownerReferences"] == [
                {
                    "apiVersion": "tangram.dev/v1alpha1",
                    "kind": "ActionPool",
                    "name": pool,
                    "uid": UID,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        else:  # cluster-scoped: a namespaced owner would never be collected
            assert obj["kind"] in ("ClusterRole", "ClusterRoleBinding")
            assert "namespace" not in meta and "ownerReferences" not in meta
            assert meta["labels"]["tangram.dev/pool-namespace"] == namespace


def test_config_map_holds_the_pool_and_its_members_without_status(
    coding: list[dict[str, Any]],
) -> None:
    text = _one(coding, "ConfigMap", "tangram-coding-config")["data"]["pool.yaml"]
    docs = [Document("pool.yaml", i + 1, d) for i, d in enumerate(yaml.safe_load_all(text))]
    parsed = parse_documents(docs)  # the scheduler can read back what it is given
    assert [p.metadata.name for p in parsed.pools.values()] == ["coding"]
    assert [e.metadata.name for e in parsed.envs.values()] == ["swe"]
    assert parsed.pools[("rl", "coding")].spec == _resources("coding").pools[("rl", "coding")].spec
    assert "status" not in text


def test_scheduler_deployment_service_and_probes(coding: list[dict[str, Any]]) -> None:
    deploy = _one(coding, "Deployment", "tangram-coding-scheduler")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    # No config checksum: an edited TrajectoryEnv must not restart the scheduler.
    assert "annotations" not in spec["template"]["metadata"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["command"] == [
        "tangram", "serve", "-f", "/etc/tangram/pool.yaml", "--token-file", "/etc/tangram/tokens",
        "--host", "0.0.0.0", "--port", "8080", "--kubernetes",
        "--learned-configmap", "rl/tangram-coding-learned", "--log-json",
    ]  # fmt: skip
    # What it learned outlives its pods: a ConfigMap of the pool's, which the operator
    # applies without data (the scheduler's key is never reset), and the Role names alone.
    learned = _one(coding, "ConfigMap", "tangram-coding-learned")
    assert "data" not in learned
    assert learned["metadata"]["ownerReferences"][0]["kind"] == "ActionPool"
    role = _one(coding, "Role", "tangram-coding-scheduler")
    rule = {"apiGroups": [""], "resources": ["configmaps"],
            "resourceNames": ["tangram-coding-learned"], "verbs": ["get", "patch"]}  # fmt: skip
    assert rule in role["rules"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["resources"] == {
        "limits": {"memory": "4Gi"},
        "requests": {"cpu": "2", "memory": "2Gi"},
    }
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and not sc["allowPrivilegeEscalation"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    (config,) = [v for v in pod["volumes"] if v["name"] == "config"]
    sources = config["projected"]["sources"]
    assert {"configMap": {"name": "tangram-coding-config"}} in sources
    assert {
        "secret": {"name": "tangram-coding-tokens", "items": [{"key": "tokens", "path": "tokens"}]}
    } in sources
    assert pod["serviceAccountName"] == "tangram-coding-scheduler"

    service = _one(coding, "Service", "tangram-coding-scheduler")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    # Agents must reach the scheduler before it is Ready (Ready = an agent connected).
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_tokens_secret_gives_agents_only_their_own_token(coding: list[dict[str, Any]]) -> None:
    secret = _one(coding, "Secret", "tangram-coding-tokens")
    assert secret["stringData"] == {
        "tokens": f"{TOKEN} system:agent\n{OP_TOKEN} system:operator\n",
        "agent": f"{TOKEN} system:agent\n",
    }
    assert parse_tokens(secret["stringData"]["tokens"]) == {
        "system:agent": TOKEN,
        "system:operator": OP_TOKEN,
    }
    ds = _one(coding, "DaemonSet")
    (volume,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["items"] == [{"key": "agent", "path": "tokens"}]
    deployment = _one(coding, "Deployment")
    (projected,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if "projected" in v
    ]
    secret_source = projected["projected"]["sources"][1]["secret"]
    assert secret_source["items"] == [{"key": "tokens", "path": "tokens"}]


def test_tokens_must_be_long_and_distinct() -> None:
    pool = next(iter(_resources("coding").pools.values()))
    with pytest.raises(ValueError, match="operator_token"):
        token_secret(pool, TOKEN, "short", UID)
    with pytest.raises(ValueError, match="differ"):
        token_secret(pool, TOKEN, TOKEN, UID)


def test_cpu_agent_daemon_set(coding: list[dict[str, Any]]) -> None:
    ds = _one(coding, "DaemonSet")
    assert ds["metadata"]["name"] == "tangram-coding-cpu-agent"
    spec = ds["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "node-agent"
    pod = spec["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"tangram.dev/role": "sandbox"}
    assert pod["automountServiceAccountToken"] is True  # it creates its sandbox pods
    assert "tolerations" not in pod
    (container,) = pod["containers"]
    assert container["command"] == [
        "tangram", "agent",
        "--scheduler", "ws://tangram-coding-scheduler.rl.svc:8080/v1/agents",
        "--token-file", "/etc/tangram/tokens",
        "--node", "$(NODE_NAME)", "--state-dir", "/var/lib/tangram/rl/coding",
        "--idle-cores", "2", "--log-json",
        "--runtime", "pod", "--namespace", "$(POD_NAMESPACE)",
        "--execd-image", IMAGE, "--pool-name", "coding", "--pool-uid", UID,
        "--gpus", "none", "--cores", "60",
    ]  # fmt: skip
    assert container["env"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    # No container runtime socket: the kubelet runs the sandboxes on the node's CRI runtime.
    assert not any("sock" in str(v) for v in pod["volumes"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "cgroup": {"path": "/sys/fs/cgroup", "type": "Directory"},
        "state": {"path": "/var/lib/tangram/rl/coding", "type": "DirectoryOrCreate"},
    }
    for name, host in host_paths.items():  # bind-mounted into containers: same path
        assert mounts[name] == host["path"]
    assert container["securityContext"]["privileged"] is True  # host cgroupns: see builders
    # The pool's cores (60 for actions + 2 idle) are requested by the agent, once.
    assert container["resources"] == {"requests": {"cpu": "62"}}


def test_a_loopback_test_cluster_runs_the_pool_on_the_nodes_127_0_0_1() -> None:
    resources = _resources("coding")
    pool = next(iter(resources.pools.values()))
    objects = _pool_objects(pool, loopback=Loopback.parse("127.0.0.1:6443"))
    api = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
           {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}]  # fmt: skip
    scheduler = _one(objects, "Deployment")["spec"]["template"]["spec"]
    agent = _one(objects, "DaemonSet")["spec"]["template"]["spec"]
    for pod in (scheduler, agent):
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        env = pod["containers"][0]["env"]
        assert all(v in env for v in api), env
    command = scheduler["containers"][0]["command"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    command = agent["containers"][0]["command"]
    assert command[command.index("--scheduler") + 1] == "ws://127.0.0.1:8080/v1/agents"
    # Without it, nothing of the kind.
    plain = _pool_objects(pool)
    assert "hostNetwork" not in _one(plain, "DaemonSet")["spec"]["template"]["spec"]


@pytest.mark.parametrize("address", ["10.0.0.1:443", "localhost:6443", "127.0.0.1", "::1:x", ""])
def test_a_loopback_api_server_must_be_a_loopback_host_and_port(address: str) -> None:
    with pytest.raises(ValueError, match="loopback HOST:PORT"):
        Loopback.parse(address)
    assert Loopback.parse("[::1]:6443") == Loopback("::1", 6443)


def test_api_only_pool_has_no_agents(deepsearch: list[dict[str, Any]]) -> None:
    kinds = [o["kind"] for o in deepsearch]
    assert "DaemonSet" not in kinds
    assert "Deployment" in kinds and "Service" in kinds


def test_gpu_pool_gets_a_gpu_agent() -> None:
    objects = _build(_resources("mopd"), "mopd")
    ds = _one(objects, "DaemonSet")
    assert ds["metadata"]["name"] == "tangram-mopd-gpu-agent"
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    agent = pod["containers"][0]
    assert "--cores" not in agent["command"]
    flag = agent["command"].index("--gpus")
    assert agent["command"][flag + 1] == "auto"  # serves RewardService calls on its GPUs
    assert agent["resources"] == {"limits": {"nvidia.com/gpu": 8}}  # gpusPerNode
    assert {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"} in agent["env"]


def test_rbac_is_least_privilege(deepsearch: list[dict[str, Any]]) -> None:
    role = _one(deepsearch, "Role", "tangram-deepsearch-scheduler")
    crs = {"actionpools", "trajectoryenvs", "rewardservices"}
    tangram_rules = [r for r in role["rules"] if r["apiGroups"] == ["tangram.dev"]]
    assert [set(r["resources"]) for r in tangram_rules] == [crs]
    assert tangram_rules[0]["verbs"] == ["get", "list", "watch"]
    (secrets,) = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets["resourceNames"] == ["search-api-keys"]  # the secretRefs, once
    assert secrets["verbs"] == ["get"]
    binding = _one(deepsearch, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tangram-deepsearch-scheduler", "namespace": "rl"}
    ]
    cluster_role = _one(deepsearch, "ClusterRole")
    assert cluster_role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    assert _one(deepsearch, "ClusterRoleBinding")["subjects"] == binding["subjects"]


def test_pool_without_secret_refs_gets_no_secret_access(coding: list[dict[str, Any]]) -> None:
    role = _one(coding, "Role", "tangram-coding-scheduler")
    assert all("secrets" not in r["resources"] for r in role["rules"])


def test_service_accounts(coding: list[dict[str, Any]]) -> None:
    agent = _one(coding, "ServiceAccount", "tangram-coding-agent")
    scheduler = _one(coding, "ServiceAccount", "tangram-coding-scheduler")
    # Neither account mounts its token by default; the two pods that need one ask for it.
    assert agent["automountServiceAccountToken"] is False
    assert scheduler["automountServiceAccountToken"] is False


def test_agents_may_manage_pods_of_their_namespace_only(coding: list[dict[str, Any]]) -> None:
    role = _one(coding, "Role", "tangram-coding-agent")
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["create", "delete", "get", "list", "patch", "watch"],
        },
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
    ]
    binding = _one(coding, "RoleBinding", "tangram-coding-agent")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tangram-coding-agent", "namespace": "rl"}
    ]


def test_sandboxes_without_network_get_none(coding: list[dict[str, Any]]) -> None:
    policy = _one(coding, "NetworkPolicy", "tangram-coding-sandboxes")
    assert policy["spec"] == {
        "podSelector": {
            "matchLabels": {"tangram.dev/pool": "coding", "tangram.dev/network": "none"}
        },
        "policyTypes": ["Ingress", "Egress"],  # and no rule: nothing in, nothing out
    }


def test_api_only_pool_has_no_agent_rbac(deepsearch: list[dict[str, Any]]) -> None:
    assert not [o for o in deepsearch if o["metadata"]["name"] == "tangram-deepsearch-agent"
                and o["kind"] in ("Role", "RoleBinding")]  # fmt: skip


def test_output_is_deterministic_whatever_the_member_order() -> None:
    resources = _resources("mopd")
    pool: ActionPool = resources.pools[("rl", "mopd")]
    services = list(resources.services.values())
    first = _pool_objects(pool, services=list(services))
    random.Random(7).shuffle(services)
    again = _pool_objects(pool, services=services)
    assert first == again
    assert yaml.safe_dump_all(first) == yaml.safe_dump_all(again)


def test_short_agent_token_is_refused() -> None:
    pool = _resources("coding").pools[("rl", "coding")]
    with pytest.raises(ValueError, match="agent_token"):
        _pool_objects(pool, agent_token="short")


def _named(namespace: str, name: str) -> ActionPool:
    return ActionPool.model_validate({
        "apiVersion": "tangram.dev/v1alpha1", "kind": "ActionPool",
        "metadata": {"name": name, "namespace": namespace}, "spec": {"cpu": {}},
    })  # fmt: skip


def _host_state(objects: list[dict[str, Any]]) -> str:
    volumes = _one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    path: str = next(
        v["hostPath"]["path"] for v in volumes if "hostPath" in v and v["name"] == "state"
    )
    return path


def test_pools_in_two_namespaces_share_no_cluster_object_and_no_host_directory() -> None:
    # "a-b"/"c" and "a"/"b-c" would both be tangram-a-b-c if joined by "-"; "coding" in two
    # namespaces on one node would share its agents' key journal.
    pairs = [
        (_named("a-b", "c"), _named("a", "b-c")),
        (_named("team-a", "x"), _named("team-b", "x")),
    ]
    for one, other in pairs:
        mine, theirs = _pool_objects(one), _pool_objects(other)
        cluster_names = [
            {o["metadata"]["name"] for o in objs if o["kind"] not in NAMESPACED}
            for objs in (mine, theirs)
        ]
        assert cluster_names[0] and not cluster_names[0] & cluster_names[1]
        assert _host_state(mine) != _host_state(theirs)


def test_the_longest_pool_name_still_makes_a_valid_service_name() -> None:
    from tangram.api.resources import POOL_NAME_MAX
    from tangram.api.spec_base import DNS_LABEL_RE

    objects = _pool_objects(_named("rl", "p" * POOL_NAME_MAX))
    for obj in objects:
        if obj["kind"] == "Service":
            name = obj["metadata"]["name"]
            assert len(name) <= 63 and DNS_LABEL_RE.match(name), name
    with pytest.raises(ValueError, match="at most 45"):
        _named("rl", "p" * (POOL_NAME_MAX + 1))
