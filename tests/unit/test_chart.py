"""The Helm chart, the plain install YAML and the image recipe, checked without helm.

CI's unit stage has no helm, so these read the chart's files directly, and
``manifests/install.yaml`` (the chart rendered by helm with its defaults) stands in for a
render. The CRD templates' drift is checked in ``test_crds.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram.api.crd import crd
from tangram.api.resources import KINDS, PLURALS
from tangram.cli.manifests import load_documents
from tangram.node_agent.exec_server import SOURCES
from tangram.operator.builders import NONROOT_UID, build_pool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "arl-tangram"
TEMPLATES = CHART / "templates"
INSTALL = ROOT / "manifests" / "install.yaml"
EXAMPLES = ROOT / "manifests" / "examples"
LIVENESS_PORT = 8080

Rule = dict[str, Any]

# What the operator needs (issue #5), as (apiGroup, resource) -> verbs.
RW = {"get", "list", "watch", "create", "update", "patch", "delete"}
NEEDED: dict[tuple[str, str], set[str]] = {
    **{("tangram.dev", p): {"get", "list", "watch", "patch", "update"} for p in PLURALS.values()},
    **{("tangram.dev", f"{p}/status"): {"get", "patch", "update"} for p in PLURALS.values()},
    ("tangram.dev", "actionpools/finalizers"): {"update"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    **{("", r): RW for r in ("configmaps", "secrets", "serviceaccounts", "services")},
    ("", "namespaces"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch", "list"},  # list: granted on to the node agents
    ("events.k8s.io", "events"): {"create", "patch"},
    ("apps", "deployments"): RW,
    ("apps", "daemonsets"): RW,
    **{
        ("rbac.authorization.k8s.io", r): RW
        for r in ("roles", "rolebindings", "clusterroles", "clusterrolebindings")
    },
    ("authentication.k8s.io", "tokenreviews"): {"create"},
    ("networking.k8s.io", "networkpolicies"): RW,
    # Granted on to the node agents (their sandbox pods); the operator makes no pod.
    ("", "pods"): {"get", "list", "watch", "create", "patch", "delete"},
}


def _values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def _leaves(node: Any, path: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of values.yaml (an empty map or a list is a leaf)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, sub in node.items():
            out.update(_leaves(sub, f"{path}.{key}" if path else key))
        return out
    return {path: node}


def _install_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def _template_rules() -> list[Rule]:
    """The ClusterRole's rules as written in the template (plain YAML after ``rules:``)."""
    text = (TEMPLATES / "clusterrole.yaml").read_text()
    role = text.split("\n---\n")[0]
    block = role[role.index("\nrules:\n") :]
    assert "{{" not in block, "the rules must be plain YAML (no template actions)"
    rules: list[Rule] = yaml.safe_load(block)["rules"]
    return rules


def _grants(rules: list[Rule]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _example_children() -> list[dict[str, Any]]:
    objects = []
    for path in sorted(EXAMPLES.glob("*/pool.yaml")):
        resources = load_documents([path])
        for pool in resources.pools.values():
            objects += build_pool(
                pool,
                image="arl-tangram/operator:0.1.0",
                envs=[e for e in resources.envs.values() if e.pool_key() == pool.key],
                services=[s for s in resources.services.values() if s.pool_key() == pool.key],
                uid="00000000-0000-4000-8000-000000000000",
                agent_token="agent-token-0123456789abcdef",
                operator_token="operator-token-0123456789abcdef",
            )
    return objects


# --- Chart.yaml and the versions ------------------------------------------------------------


def test_chart_versions_follow_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert project is not None
    # images/build.sh tags the images with the project's version; the chart's default
    # image tag is its appVersion: they must agree or a default install pulls nothing.
    assert chart["apiVersion"] == "v2" and chart["name"] == "arl-tangram"
    assert chart["appVersion"] == project.group(1)
    assert chart["version"] == "0.1.0"
    assert not (CHART / "crds").exists(), "CRDs are templates: Helm never upgrades crds/"


# --- values: documented, in the README, validated by the schema -----------------------------


def test_every_key_of_values_yaml_has_a_comment_above_it() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*([A-Za-z][\w.-]*):", line)
        if m and not lines[i - 1].lstrip().startswith("#"):
            undocumented.append(f"line {i + 1}: {m.group(1)}")
    assert undocumented == []
    # and the check sees keys at all: every leaf and every map of values.yaml is a line
    keys = sum(bool(re.match(r"^\s*[A-Za-z][\w.-]*:", line)) for line in lines)
    assert keys >= len(_leaves(_values())) >= 30


def test_readme_documents_every_value_with_its_default() -> None:
    rows = {}
    for line in (CHART / "README.md").read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| (\w+) \| `(.*)` \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), json.loads(m.group(3)), m.group(4))
    leaves = _leaves(_values())
    assert sorted(set(leaves) - set(rows)) == [], "values missing from README.md"
    assert sorted(set(rows) - set(leaves)) == [], "README.md documents values that are gone"
    for key, value in leaves.items():
        _, default, description = rows[key]
        assert default == value, f"README.md: default of {key}"
        assert len(description) > 10, key


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].removeprefix("#/definitions/")
        node = schema["definitions"][name]
    return node


def test_schema_covers_exactly_the_values() -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        node = _resolve(schema, node)
        assert node["type"] == "object", path
        props = node.get("properties")
        if props is None:  # a free-form map (labels, affinity, ...)
            return
        assert node.get("additionalProperties") is False, f"{path}: typos must fail"
        assert sorted(set(values) - set(props)) == [], f"{path}: values without a schema"
        assert sorted(set(props) - set(values) - {"global"}) == [], f"{path}: stale schema"
        for key, value in values.items():
            sub = _resolve(schema, props[key])
            if isinstance(value, dict):
                walk(value, sub, f"{path}.{key}")
            else:
                types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
                expected = {bool: "boolean", str: "string", int: "integer", list: "array"}
                assert expected[type(value)] in types, f"{path}.{key}"

    walk(_values(), schema, "values")
    image = schema["properties"]["image"]["properties"]
    assert image["pullPolicy"]["enum"] == ["IfNotPresent", "Always", "Never"]


@pytest.mark.parametrize(
    "change,valid",
    [
        ({}, True),
        ({"watchNamespaces": ["rl", "rl-eval"], "serviceMonitor": {"enabled": True}}, True),
        ({"image": {"pullPolicy": "Sometimes"}}, False),
        ({"watchNamespace": ["rl"]}, False),  # a typo
        ({"watchNamespaces": ["Not_A_Namespace"]}, False),
        ({"crds": {"install": "yes"}}, False),
        ({"resources": {"limits": {"memory": "lots"}}}, False),
        ({"podAnnotations": {"a": True}}, False),  # `a: y` in YAML 1.1 is a bool
        ({"serviceMonitor": {"interval": "30"}}, False),
    ],
)
def test_schema_accepts_and_rejects(change: dict[str, Any], valid: bool) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = _schema()
    assert jsonschema_rs.meta.is_valid(schema)

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and k in base else v
        return out

    assert jsonschema_rs.Draft7Validator(schema).is_valid(merge(_values(), change)) is valid


# --- RBAC -----------------------------------------------------------------------------------


def test_cluster_role_grants_exactly_what_the_operator_needs() -> None:
    rules = _template_rules()
    assert _grants(rules) == NEEDED
    text = yaml.safe_dump(rules)
    assert "'*'" not in text and "resourceNames" not in text
    assert not {"escalate", "bind", "impersonate"} & set().union(*_grants(rules).values())


def test_every_rule_says_why() -> None:
    lines = (TEMPLATES / "clusterrole.yaml").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("  - apiGroups:")]
    assert len(starts) == len(_template_rules())
    for i in starts:
        assert lines[i - 1].lstrip().startswith("#"), f"no comment above line {i + 1}"


def _kind_resource(manifest: dict[str, Any]) -> tuple[str, str]:
    group = manifest["apiVersion"].rpartition("/")[0]
    kind = manifest["kind"].lower()
    return group, kind[:-1] + "ies" if kind.endswith("y") else kind + "s"


def test_the_operator_may_manage_every_child_the_builders_make() -> None:
    grants = _grants(_template_rules())
    children = _example_children()
    kinds = {m["kind"] for m in children}
    assert {"ConfigMap", "Deployment", "DaemonSet", "ClusterRole", "Service"} <= kinds
    for manifest in children:
        key = _kind_resource(manifest)
        assert {"get", "create", "patch", "delete"} <= grants.get(key, set()), key


def test_the_operator_holds_every_permission_it_grants() -> None:
    """RBAC refuses to create a (Cluster)Role granting what its creator does not hold."""
    grants = _grants(_template_rules())
    granted = [m for m in _example_children() if m["kind"] in ("Role", "ClusterRole")]
    assert {m["kind"] for m in granted} == {"Role", "ClusterRole"}
    for role in granted:
        for (group, resource), verbs in _grants(role["rules"]).items():
            assert verbs <= grants.get((group, resource), set()), (role["kind"], resource)


# --- the other templates --------------------------------------------------------------------


def test_service_monitor_selects_the_schedulers_services() -> None:
    text = (TEMPLATES / "servicemonitor.yaml").read_text()
    condition = (
        '.Values.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")'
    )
    assert f"\n{{{{- if and {condition} }}}}\n" in text  # (after the values' check)
    spec_text = text[text.index("\nspec:\n") : text.rindex("{{- end }}")]
    for key, value in _values()["serviceMonitor"].items():
        spec_text = spec_text.replace(f"{{{{ .Values.serviceMonitor.{key} }}}}", str(value))
    assert "{{" not in spec_text
    spec = yaml.safe_load(spec_text)["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics"

    services = [m for m in _example_children() if m["kind"] == "Service"]
    assert services
    for service in services:
        labels = service["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # and nothing else the operator makes carries those labels with a port of that name
    assert all(
        m["kind"] != "Service" or m in services
        for m in _example_children()
        if spec["selector"]["matchLabels"].items() <= m["metadata"]["labels"].items()
    )


def test_network_policy_admits_only_the_liveness_port() -> None:
    text = (TEMPLATES / "networkpolicy.yaml").read_text()
    spec = yaml.safe_load(
        text[text.index("\nspec:\n") : text.rindex("{{- end }}")]
        .replace('{{- include "arl-tangram.operatorSelectorLabels" . | nindent 6 }}', "{}")
        .replace('{{ include "arl-tangram.livenessPort" . }}', str(LIVENESS_PORT))
    )["spec"]
    # The one the deployment's probe uses, in loopback mode too (it was 8080 always).
    deployment = (TEMPLATES / "deployment.yaml").read_text()
    assert 'containerPort: {{ include "arl-tangram.livenessPort" . }}' in deployment
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"ports": [{"port": LIVENESS_PORT, "protocol": "TCP"}]}]
    assert spec["egress"] == [{}]


def test_watch_namespaces_become_namespace_flags() -> None:
    text = (TEMPLATES / "deployment.yaml").read_text()
    assert re.search(
        r"\{\{- range \.Values\.watchNamespaces \}\}\n\s+- --namespace\n"
        r"\s+- \{\{ \. \| quote \}\}\n\s+\{\{- end \}\}",
        text,
    )


def test_install_yaml_says_how_it_was_made() -> None:
    text = INSTALL.read_text()
    assert text.startswith("# ARL-Tangram install manifests")
    assert (
        "helm template arl-tangram charts/arl-tangram --namespace tangram-system --include-crds"
        in text
    )
    assert "charts/render-install.sh" in text
    docs = _install_docs()
    assert docs[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": "tangram-system",
            "labels": {
                "app.kubernetes.io/part-of": "arl-tangram",
                "pod-security.kubernetes.io/enforce": "restricted",
            },
        },
    }
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"]
        + ["CustomResourceDefinition"] * len(KINDS)
    )
    for doc in docs[1:]:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert doc["metadata"]["namespace"] == "tangram-system", doc["kind"]


def test_install_yaml_crds_are_the_models() -> None:
    """Fails when a CRD changed but install.yaml was not rendered again."""
    found = {
        d["spec"]["names"]["kind"]: d
        for d in _install_docs()
        if d["kind"] == "CustomResourceDefinition"
    }
    assert set(found) == set(KINDS)
    for kind, doc in found.items():
        assert doc["spec"] == crd(kind)["spec"], (
            f"manifests/install.yaml has a stale {kind} CRD: run `tangram crds`, then "
            "`HELM=... charts/render-install.sh`"
        )
        assert doc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "arl-tangram"


def test_install_yaml_rbac_is_the_charts() -> None:
    docs = _install_docs()
    assert _one(docs, "ClusterRole")["rules"] == _template_rules()
    binding = _one(docs, "ClusterRoleBinding")
    account = _one(docs, "ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == _one(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


def test_install_yaml_operator_deployment() -> None:
    docs = _install_docs()
    deployment = _one(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == _one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = pod["containers"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    image = f"arl-tangram/operator:{version}"
    assert container["image"] == image
    assert container["command"] == [
        "tangram", "operator", "--image", image, "--liveness-port", str(LIVENESS_PORT),
        "--log-json",
    ]  # fmt: skip
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == "/healthz" and ports[probe["port"]] == LIVENESS_PORT
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "operator"


# --- the image recipe -----------------------------------------------------------------------


def _stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.match(r"^FROM\s+\S+\s+AS\s+(\S+)", line)
        if m:
            current = stages.setdefault(m.group(1), [])
        elif line and not line.startswith("#"):
            current.append(line)
    return stages


def test_dockerfile_targets() -> None:
    stages = _stages()
    assert {"operator", "scheduler", "node-agent"} <= set(stages)
    users = {t: [line for line in stages[t] if line.startswith("USER ")] for t in stages}
    assert users["operator"] == users["scheduler"] == [f"USER {NONROOT_UID}:{NONROOT_UID}"]
    assert users["node-agent"] == ["USER 0:0"]
    assert _values()["podSecurityContext"]["runAsUser"] == NONROOT_UID
    # The exec server: compiled statically as exec_server.build does, installed where
    # TANGRAM_EXECD points, in the stage every target starts from.
    execd = " ".join(stages["execd"])
    assert "gcc -static -O2 -o /tangram-execd /src/exec_server.c" in execd
    for source in SOURCES:  # what exec_server.c includes is copied beside it
        assert f"node-agent/tangram/node_agent/{source.name}" in execd
    runtime = " ".join(stages["runtime"])
    m = re.search(r"TANGRAM_EXECD=(\S+)", runtime)
    assert m is not None
    assert f"COPY --from=execd /tangram-execd {m.group(1)}" in runtime
    for target in ("operator", "scheduler", "node-agent"):
        assert re.search(rf"^FROM runtime AS {target}$", (ROOT / "Dockerfile").read_text(), re.M)


def test_dockerignore_lets_in_only_what_the_dockerfile_copies() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*", "an allow list: .venv, .git and caches never reach the daemon"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in _stages().values():
        for line in stage:
            m = re.match(r"^COPY\s+(?!--from)(\S+)\s+\S+$", line)
            if m:
                copied.add(m.group(1).split("/")[0])
    assert copied and copied <= allowed, copied - allowed
    assert not {".venv", ".git", "tests"} & allowed
