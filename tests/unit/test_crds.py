"""The CRDs in crds/ are generated from the pydantic models, structural, and current."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tangram.api.crd import (
    LIST_TYPES,
    NAME_RULES,
    RULES,
    CrdError,
    crd,
    crds,
    openapi_schema,
    structural,
)
from tangram.api.resources import KINDS, PLURALS, SHORT_NAMES
from tangram.api.status import STATUS_MODELS
from tangram.cli.crds import (
    CHART_CRDS,
    escape_template,
    file_name,
    render,
    render_template,
    rendered,
    rendered_templates,
    stale,
)
from tangram.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "arl-tangram"
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*/*.yaml"))

# Keys of a JSONSchemaProps that the generator may emit.
ALLOWED = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "multipleOf",
    "required",
    "nullable",
    "properties",
    "items",
    "additionalProperties",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def _schema(kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path or "(root)", node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


# --- drift -----------------------------------------------------------------------------------


def test_crds_are_current() -> None:
    out = ROOT / "crds"
    stale = []
    for name, text in rendered().items():
        path = out / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    extra = sorted(p.name for p in out.glob("*.tangram.dev.yaml") if p.name not in rendered())
    assert not stale and not extra, (
        f"crds/ is out of date with tangram.api.resources (stale: {stale}, not generated: "
        f"{extra}): run `tangram crds` (or `.venv/bin/tangram crds`) and commit the result"
    )


def test_chart_crd_templates_are_current() -> None:
    templates = CHART / CHART_CRDS
    assert stale(ROOT / "crds", CHART) == [], (
        f"{templates.relative_to(ROOT)} (or crds/) is out of date with tangram.api.resources: "
        "run `tangram crds` (or `.venv/bin/tangram crds`) and commit the result"
    )
    assert sorted(p.name for p in templates.iterdir()) == sorted(rendered_templates())


def test_generation_is_deterministic() -> None:
    assert crds() == crds()
    assert [render(k) for k in KINDS] == [render(k) for k in KINDS]
    assert [render_template(k) for k in KINDS] == [render_template(k) for k in KINDS]


def test_cli_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "crds"
    assert main(["crds", "--check", "--no-chart", "--out", str(out)]) == 1
    assert main(["crds", "--no-chart", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(file_name(k) for k in KINDS)
    assert main(["crds", "--check", "--no-chart", "--out", str(out)]) == 0
    victim = out / file_name("TrajectoryEnv")
    victim.write_text(victim.read_text(encoding="utf-8") + "# edited\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["crds", "--check", "--no-chart", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(victim) in err and "tangram crds" in err
    assert file_name("ActionPool") not in err


def test_cli_writes_and_checks_the_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, chart = tmp_path / "crds", tmp_path / "chart"
    chart.mkdir()
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: x\nversion: 0.1.0\n")
    args = ["crds", "--out", str(out), "--chart", str(chart)]
    assert main(args) == 0
    templates = chart / CHART_CRDS
    assert sorted(p.name for p in templates.iterdir()) == sorted(file_name(k) for k in KINDS)
    assert main([*args, "--check"]) == 0
    # crds/ current, a chart template edited: the check names only that template
    victim = templates / file_name("RewardService")
    victim.write_text(victim.read_text(encoding="utf-8").replace("keep", "delete"))
    capsys.readouterr()
    assert main([*args, "--check"]) == 1
    err = capsys.readouterr().err
    assert str(victim) in err and f"--chart {chart}" in err
    assert not any(str(out / file_name(k)) in err for k in KINDS)
    # a template no kind generates any more (a removed kind) is stale, and writing drops it
    ghost = templates / "ghosts.tangram.dev.yaml"
    ghost.write_text("{{- if .Values.crds.install }}\n{{- end }}\n")
    assert main(args) == 0
    assert not ghost.exists() and victim.read_text() == render_template("RewardService")
    ghost.write_text("")
    capsys.readouterr()
    assert main([*args, "--check"]) == 1
    assert str(ghost) in capsys.readouterr().err
    # the chart is left alone on request, and a directory without Chart.yaml is refused
    ghost.unlink()
    victim.unlink()
    assert main([*args[:3], "--no-chart", "--check"]) == 0
    assert main(["crds", "--out", str(out), "--chart", str(out), "--check"]) == 2
    assert "not a Helm chart" in capsys.readouterr().err


def test_cli_skips_the_default_chart_when_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["crds"]) == 0
    assert sorted(p.name for p in (tmp_path / "crds").iterdir()) == sorted(rendered())
    assert not (tmp_path / "charts").exists()
    assert "no chart at charts/arl-tangram; skipped" in capsys.readouterr().err


def test_chart_templates_hold_the_same_crds() -> None:
    """With its conditionals taken and its include dropped, a chart template is the CRD of
    crds/ plus the keep annotation; with crds.install false it renders nothing."""
    for kind in KINDS:
        text = render_template(kind)
        lines = text.splitlines()
        assert lines[0] == "{{- if .Values.crds.install }}" and lines[-1] == "{{- end }}"
        assert "# generated by `tangram crds`; do not edit" in lines
        body = [
            line
            for line in lines
            if not re.fullmatch(r"\s*\{\{- (if \.Values\.crds\.(install|keep)|end) \}\}", line)
            and 'include "arl-tangram.labels"' not in line
        ]
        assert not any("{{" in line for line in body), kind
        expected = crd(kind)
        expected["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
        assert yaml.safe_load("\n".join(body)) == expected


def test_template_escaping() -> None:
    assert escape_template("a {{dop}} b }} c") == 'a {{ "{{" }}dop}} b }} c'
    assert escape_template("{min, max} | {choices}") == "{min, max} | {choices}"


def test_files_are_plain_yaml_with_a_header() -> None:
    for kind in KINDS:
        text = render(kind)
        assert text.startswith("# generated by `tangram crds`; do not edit\n")
        assert yaml.safe_load(text) == crd(kind)


# --- the CRD around the schema ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_names_versions_and_subresources(kind: str) -> None:
    c = crd(kind)
    assert c["apiVersion"] == "apiextensions.k8s.io/v1"
    assert c["kind"] == "CustomResourceDefinition"
    assert c["metadata"]["name"] == f"{PLURALS[kind]}.tangram.dev"
    spec = c["spec"]
    assert spec["group"] == "tangram.dev" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": kind,
        "listKind": f"{kind}List",
        "plural": PLURALS[kind],
        "singular": kind.lower(),
        "shortNames": [SHORT_NAMES[kind]],
        "categories": ["tangram"],
    }
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {col["name"]: col for col in version["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    for col in columns.values():
        assert col["type"] in {"string", "integer", "number", "boolean", "date"}
        assert col["jsonPath"].startswith(".")


def test_printer_columns() -> None:
    def cols(kind: str) -> list[tuple[str, str]]:
        version = crd(kind)["spec"]["versions"][0]
        return [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]

    ready = '.status.conditions[?(@.type=="Ready")].status'
    age = ".metadata.creationTimestamp"
    sandboxes = '.status.conditions[?(@.type=="SandboxesHealthy")].reason'
    assert cols("ActionPool") == [
        ("Ready", ready),
        ("Nodes", ".status.nodes"),
        ("Cores", ".status.cores"),
        ("GPUs", ".status.gpus"),
        ("Queue", ".status.queueDepth"),
        ("Sandboxes", sandboxes),
        ("Age", age),
    ]
    assert cols("TrajectoryEnv") == [
        ("Pool", ".spec.poolRef"),
        ("Image", ".spec.image"),
        ("Ready", ready),
        ("Sandboxes", sandboxes),
        ("Age", age),
    ]
    assert cols("RewardService") == [
        ("Pool", ".spec.poolRef"),
        ("GPU memory", ".spec.gpuMemoryGiB"),
        ("Ready", ready),
        ("Age", age),
    ]


# --- structural schema -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_schema_is_structural(kind: str) -> None:
    schema = _schema(kind)
    assert schema["properties"]["metadata"] == {"type": "object"}
    status = schema["properties"]["status"]
    assert status["type"] == "object" and "observedGeneration" in status["properties"]
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert schema["required"] == ["spec"]
    for path, node in _nodes(schema):
        assert set(node) <= ALLOWED, f"{kind} {path}: keys {sorted(set(node) - ALLOWED)}"
        assert (
            "type" in node
            or node.get("x-kubernetes-preserve-unknown-fields") is True
            or node.get("x-kubernetes-int-or-string") is True
        ), f"{kind} {path}: no type"
        if "type" in node:
            assert node["type"] in {"object", "array", "string", "integer", "number", "boolean"}
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "exclusiveMaximum" in node:
            assert node["exclusiveMaximum"] is True and "maximum" in node, path
        if "default" in node:
            assert node["default"] is not None, path
            assert not _errors(node["default"], node, path), f"{path}: default is invalid"
        for required in node.get("required", []):
            assert required in node.get("properties", {}), f"{path}: required {required}"
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"]["required"]), path
    text = yaml.safe_dump(schema)
    for forbidden in (
        "$ref",
        "$defs",
        "anyOf",
        "oneOf",
        "allOf",
        "title",
        "const",
        "discriminator",
    ):
        assert f"{forbidden}:" not in text, f"{kind}: {forbidden}"


def test_unions_become_preserved_fields_with_their_shapes() -> None:
    env = _schema("TrajectoryEnv")["properties"]["spec"]["properties"]
    cpu = env["cpu"]
    assert cpu["x-kubernetes-preserve-unknown-fields"] is True and "type" not in cpu
    assert "x-kubernetes-int-or-string" not in cpu
    assert "integer | {min, max} | {choices}" in cpu["description"]
    assert cpu["default"] == {"min": 1, "max": 1}
    action = env["actions"]["items"]["properties"]
    assert action["cpu"]["nullable"] is True
    assert "{amdahl} | {table}" in action["efficiency"]["description"]
    assert action["t1Seconds"] == {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "nullable": True,
        "description": "run time with one core, seconds, if known",
    }


def test_unit_conversions() -> None:
    assert structural({"anyOf": [{"type": "integer"}, {"type": "string"}]}, {}) == {
        "x-kubernetes-int-or-string": True
    }
    assert structural({"anyOf": [{"type": "integer"}, {"type": "number"}]}, {}) == {
        "type": "number"
    }
    assert structural({"const": "x", "title": "X"}, {}) == {"type": "string", "enum": ["x"]}
    assert structural({"type": "number", "exclusiveMaximum": 1.5}, {}) == {
        "type": "number",
        "maximum": 1.5,
        "exclusiveMaximum": True,
    }
    assert structural(
        {"$ref": "#/$defs/A", "description": "field"},
        {"A": {"type": "object", "description": "class", "additionalProperties": True}},
    ) == {"type": "object", "description": "field", "x-kubernetes-preserve-unknown-fields": True}
    with pytest.raises(CrdError, match="without a type"):
        structural({"description": "anything"}, {})
    with pytest.raises(CrdError, match="no structural equivalent"):
        structural({"type": "string", "contentEncoding": "base64"}, {})
    with pytest.raises(CrdError, match="unresolvable"):
        structural({"$ref": "#/$defs/Missing"}, {})
    with pytest.raises(CrdError, match="one bound"):
        structural({"type": "integer", "minimum": 5, "exclusiveMinimum": 0}, {})
    with pytest.raises(CrdError, match="uniqueItems"):
        structural({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, {})


# --- CEL rules and list types ----------------------------------------------------------------


def _rules(node: dict[str, Any]) -> list[str]:
    return [r["rule"] for r in node.get("x-kubernetes-validations", [])]


def test_cel_rules() -> None:
    for kind in ("TrajectoryEnv", "RewardService"):
        pool_ref = _schema(kind)["properties"]["spec"]["properties"]["poolRef"]
        assert _rules(pool_ref) == ["self == oldSelf"]
    pool = _schema("ActionPool")["properties"]["spec"]
    assert "has(self.concurrency) || has(self.rate)" in _rules(pool["properties"]["apis"]["items"])
    assert _rules(pool) == [
        "has(self.cpu) || has(self.gpu) || (has(self.apis) && size(self.apis) > 0)"
    ]
    profile = _schema("RewardService")["properties"]["spec"]["properties"]["profiles"]["items"]
    assert _rules(profile["properties"]["inputSize"]) == ["self.min <= self.max"]


def test_every_rule_and_list_type_names_a_real_field() -> None:
    defs: dict[str, Any] = {}
    for cls in [*KINDS.values(), *STATUS_MODELS.values()]:
        schema = cls.model_json_schema(by_alias=True, mode="validation")
        defs.update(schema.get("$defs", {}), **{cls.__name__: schema})
    for name, prop in [*RULES, *LIST_TYPES]:
        assert name in defs, name
        if prop is not None:
            assert prop in defs[name]["properties"], (name, prop)
    found = sum(
        "x-kubernetes-validations" in node for kind in KINDS for _, node in _nodes(_schema(kind))
    )
    assert found == len(RULES) + len(NAME_RULES)  # and each kind's own, on its name


def test_unique_lists_are_list_types() -> None:
    pool = _schema("ActionPool")["properties"]["spec"]["properties"]
    assert pool["apis"]["x-kubernetes-list-type"] == "map"
    assert pool["apis"]["x-kubernetes-list-map-keys"] == ["name"]
    env = _schema("TrajectoryEnv")["properties"]["spec"]["properties"]
    assert env["actions"]["x-kubernetes-list-map-keys"] == ["name"]
    dop = _schema("RewardService")["properties"]["spec"]["properties"]["dopChoices"]
    assert dop["x-kubernetes-list-type"] == "set"
    assert dop["items"]["enum"] == [1, 2, 4, 8]


# --- the examples against the generated schema -----------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _errors(value: Any, node: dict[str, Any], path: str) -> list[str]:
    """A minimal structural validator: what the API server checks besides CEL and formats.

    Unknown keys are errors here (the API server would prune them, or reject them with
    strict field validation).
    """
    if value is None:
        return [] if node.get("nullable") else [f"{path}: null"]
    if node.get("x-kubernetes-preserve-unknown-fields") and "type" not in node:
        return []
    if node.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: not an int or string"]
    t = node["type"]
    if not isinstance(value, _TYPES[t]) or (isinstance(value, bool) and t != "boolean"):
        return [f"{path}: {value!r} is not {t}"]
    errors: list[str] = []
    if "enum" in node and value not in node["enum"]:
        errors.append(f"{path}: {value!r} not in {node['enum']}")
    if "minimum" in node and value < node["minimum"]:
        errors.append(f"{path}: below minimum")
    if node.get("exclusiveMinimum") and value == node["minimum"]:
        errors.append(f"{path}: at the exclusive minimum")
    if "maximum" in node and value > node["maximum"]:
        errors.append(f"{path}: above maximum")
    if isinstance(value, str):
        if len(value) < node.get("minLength", 0) or len(value) > node.get("maxLength", 1 << 30):
            errors.append(f"{path}: length")
        if "pattern" in node and not re.search(node["pattern"], value):
            errors.append(f"{path}: does not match {node['pattern']}")
    if isinstance(value, list):
        if len(value) < node.get("minItems", 0) or len(value) > node.get("maxItems", 1 << 30):
            errors.append(f"{path}: item count")
        for i, item in enumerate(value):
            errors += _errors(item, node["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        props = node.get("properties", {})
        errors += [f"{path}.{r}: required" for r in node.get("required", []) if r not in value]
        for key, sub in value.items():
            if key in props:
                errors += _errors(sub, props[key], f"{path}.{key}")
            elif "additionalProperties" in node:
                errors += _errors(sub, node["additionalProperties"], f"{path}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{key}: unknown field")
    return errors


def _documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLES:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("tangram.dev/"):
                yield f"{path.relative_to(ROOT)}#{i}", doc


def test_there_are_examples_of_every_kind() -> None:
    assert {doc["kind"] for _, doc in _documents()} == set(KINDS)


@pytest.mark.parametrize(
    "where,doc", list(_documents()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_examples_validate_against_the_generated_schema(where: str, doc: dict[str, Any]) -> None:
    schema = _schema(doc["kind"])
    assert _errors(doc["spec"], schema["properties"]["spec"], "spec") == [], where


def test_the_validator_catches_what_the_api_server_would() -> None:
    spec = _schema("ActionPool")["properties"]["spec"]
    assert _errors({"cpu": {"idleCores": 1}}, spec, "spec") == []
    assert _errors({"cpu": {"idleCore": 1}}, spec, "spec") == ["spec.cpu.idleCore: unknown field"]
    assert _errors({"scheduling": {"ordering": "lifo"}}, spec, "spec") != []
    assert _errors({"apis": [{"name": "x", "periodSeconds": 0}]}, spec, "spec") != []
    env = _schema("TrajectoryEnv")["properties"]["spec"]
    assert _errors({"image": "x"}, env, "spec") == ["spec.poolRef: required"]


def test_schema_of_a_model_matches_crd() -> None:
    for kind, cls in KINDS.items():
        schema = openapi_schema(cls, STATUS_MODELS[kind])
        assert {**schema, "x-kubernetes-validations": NAME_RULES[kind]} == _schema(kind)
