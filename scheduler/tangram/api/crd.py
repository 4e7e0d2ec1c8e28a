"""CustomResourceDefinitions of ``tangram.dev/v1alpha1``, generated from the pydantic models.

:func:`crd` turns one kind of :mod:`tangram.api.resources` into an ``apiextensions.k8s.io/v1``
CustomResourceDefinition (a plain dict). The OpenAPI schema is the model's own JSON schema
(``by_alias=True``, ``mode="validation"``) converted into a Kubernetes *structural* schema:

- every ``$ref`` is inlined and every node has a ``type``;
- ``Optional[X]`` (``anyOf [X, null]``) becomes ``X`` with ``nullable: true``;
- ``const`` becomes a one-value ``enum``; ``exclusiveMinimum: n`` (JSON Schema 2020-12)
  becomes ``minimum: n`` plus ``exclusiveMinimum: true`` (OpenAPI v3.0), likewise for maximum;
- keys Kubernetes rejects or ignores (``title``, ``$schema``, ``examples``, ``discriminator``)
  are dropped, and so is ``additionalProperties: false``, which v1 CRDs forbid: unknown
  fields are pruned by the API server, or rejected with strict field validation;
- unions a structural schema cannot express (``int | {min, max} | {choices}``, ``{amdahl} |
  {table}``, ``int | float | str``) become ``x-kubernetes-preserve-unknown-fields: true``
  with a description naming the accepted shapes: the operator validates them with the
  pydantic model. ``int | str`` alone is ``x-kubernetes-int-or-string``;
- cross-field rules of the models' validators that CEL can state cheaply are added as
  ``x-kubernetes-validations`` (:data:`RULES`), and name-keyed lists whose names the models
  keep unique become ``x-kubernetes-list-type: map`` (:data:`LIST_TYPES`).

Anything in a model's schema that this module does not know raises :class:`CrdError`, so a
new pydantic construct fails the generation instead of producing a schema the API server
refuses. The module is pure (models in, dicts out); ``tangram crds`` writes the YAML files.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from tangram.api.resources import GROUP, KINDS, PLURALS, POOL_NAME_MAX, SHORT_NAMES, VERSION
from tangram.api.spec_base import DNS_LABEL
from tangram.api.status import STATUS_MODELS

CRD_API_VERSION = "apiextensions.k8s.io/v1"
CATEGORIES = ["tangram"]

Schema = dict[str, Any]


class CrdError(ValueError):
    """A model's JSON schema has something a structural schema cannot take."""


# Keys copied as they are (after their values are converted where they hold schemas).
_KEEP = frozenset(
    {
        "type",
        "description",
        "default",
        "enum",
        "format",
        "minimum",
        "maximum",
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
    }
)
# Keys dropped: Kubernetes rejects them, or they only document the JSON schema itself.
_DROP = frozenset({"title", "$schema", "examples", "discriminator", "readOnly", "writeOnly"})
_SCALARS = frozenset({"string", "integer", "number", "boolean"})

# CEL rules: ($defs name, property alias or None for the object itself) -> rules. They mirror
# validators of tangram.api.resources; the operator still validates with the models.
RULES: dict[tuple[str, str | None], list[dict[str, str]]] = {
    ("ApiQuota", None): [
        {
            "rule": "has(self.concurrency) || has(self.rate)",
            "message": "set concurrency, rate or both: a quota needs a limit",
        },
        {"rule": "!has(self.burst) || has(self.rate)", "message": "burst: only a rate has a burst"},
    ],
    ("ActionPoolSpec", None): [
        {
            "rule": "has(self.cpu) || has(self.gpu) || (has(self.apis) && size(self.apis) > 0)",
            "message": "a pool needs cpu, gpu or apis",
        },
    ],
    ("InputSizeRange", None): [
        {"rule": "self.min <= self.max", "message": "min is greater than max"},
    ],
    ("TrajectoryEnvSpec", "poolRef"): [
        {"rule": "self == oldSelf", "message": "poolRef is immutable"},
    ],
    ("RewardServiceSpec", "poolRef"): [
        {"rule": "self == oldSelf", "message": "poolRef is immutable"},
    ],
}

# Rules on the object itself, by kind: its name as the models take it (CEL sees
# metadata.name; the API server alone would take a DNS subdomain of 253 characters).
_DNS_LABEL_NAME = {
    "rule": f"self.metadata.name.matches('{DNS_LABEL}')",
    "message": "metadata.name: lower-case letters, digits and '-' (a DNS label)",
}
_MEMBER_NAME = [
    _DNS_LABEL_NAME,
    {"rule": "size(self.metadata.name) <= 63", "message": "metadata.name: at most 63 characters"},
]
NAME_RULES: dict[str, list[dict[str, str]]] = {
    "ActionPool": [
        _DNS_LABEL_NAME,
        {
            "rule": f"size(self.metadata.name) <= {POOL_NAME_MAX}",
            "message": f"metadata.name: at most {POOL_NAME_MAX} characters for a pool (its "
            "scheduler's Service, tangram-<name>-scheduler, is a DNS label of at most 63)",
        },
    ],
    "TrajectoryEnv": _MEMBER_NAME,
    "RewardService": _MEMBER_NAME,
}

# Lists whose items the models keep unique: by name (map) or by value (set).
LIST_TYPES: dict[tuple[str, str], Schema] = {
    ("ActionPoolSpec", "apis"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
    ("TrajectoryEnvSpec", "actions"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
    ("Access", "tenants"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
    # One condition per type, as kubectl wait --for=condition=Ready expects.
    ("PoolStatus", "conditions"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
    ("MemberStatus", "conditions"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
    # Distinct values of {1, 2, 4, 8}: never more than four.
    ("RewardServiceSpec", "dopChoices"): {"x-kubernetes-list-type": "set", "maxItems": 4},
}


_READY = {
    "name": "Ready",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
}
# The latest cause of recent sandbox failures, or NoRecentFailures.
_SANDBOXES = {
    "name": "Sandboxes",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="SandboxesHealthy")].reason',
}
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_POOL = {"name": "Pool", "type": "string", "jsonPath": ".spec.poolRef"}
PRINTER_COLUMNS: dict[str, list[dict[str, str]]] = {
    "ActionPool": [
        _READY,
        {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes"},
        {"name": "Cores", "type": "integer", "jsonPath": ".status.cores"},
        {"name": "GPUs", "type": "integer", "jsonPath": ".status.gpus"},
        {"name": "Queue", "type": "integer", "jsonPath": ".status.queueDepth"},
        _SANDBOXES,
        _AGE,
    ],
    "TrajectoryEnv": [
        _POOL,
        {"name": "Image", "type": "string", "jsonPath": ".spec.image"},
        _READY,
        _SANDBOXES,
        _AGE,
    ],
    "RewardService": [
        _POOL,
        {"name": "GPU memory", "type": "number", "jsonPath": ".spec.gpuMemoryGiB"},
        _READY,
        _AGE,
    ],
}


def crd_name(kind: str) -> str:
    """``<plural>.<group>``, the name of the CRD of ``kind``."""
    return f"{PLURALS[_known(kind)]}.{GROUP}"


def crd(kind: str) -> dict[str, Any]:
    """The ``apiextensions.k8s.io/v1`` CustomResourceDefinition of ``kind``."""
    kind = _known(kind)
    return {
        "apiVersion": CRD_API_VERSION,
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": crd_name(kind),
            "labels": {"app.kubernetes.io/part-of": "arl-tangram"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": PLURALS[kind],
                "singular": kind.lower(),
                "shortNames": [SHORT_NAMES[kind]],
                "categories": list(CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _object_schema(kind)},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS[kind]),
                }
            ],
        },
    }


def _object_schema(kind: str) -> Schema:
    schema = openapi_schema(KINDS[kind], STATUS_MODELS[kind])
    schema["x-kubernetes-validations"] = copy.deepcopy(NAME_RULES[kind])
    return schema


def crds() -> dict[str, dict[str, Any]]:
    """Every kind's CRD, by kind."""
    return {kind: crd(kind) for kind in KINDS}


def openapi_schema(model: type[BaseModel], status: type[BaseModel]) -> Schema:
    """The structural ``openAPIV3Schema`` of a resource model (apiVersion, kind, metadata, spec)
    and its status model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Schema] = copy.deepcopy(raw.get("$defs", {}))
    _annotate(defs)
    spec = structural(raw["properties"]["spec"], defs)
    status_raw = status.model_json_schema(by_alias=True, mode="validation")
    status_defs = {**status_raw.pop("$defs", {}), status.__name__: status_raw}
    _annotate(status_defs)  # the status model itself is a $defs entry for RULES/LIST_TYPES
    status_schema = structural(status_defs[status.__name__], status_defs)
    status_schema["description"] = "written by the operator; " + status_schema["description"]
    return {
        "type": "object",
        "description": _text(raw.get("description")),
        "properties": {
            "apiVersion": {"type": "string", "description": "API group/version"},
            "kind": {"type": "string", "description": "kind of the resource"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status_schema,
        },
        "required": ["spec"],
    }


def structural(node: Mapping[str, Any], defs: Mapping[str, Schema]) -> Schema:
    """A JSON schema node (from pydantic) as a Kubernetes structural schema node."""
    node = _resolve(node, defs)
    out: Schema = {}
    branches = node.get("anyOf", node.get("oneOf"))
    if branches is not None:
        return _union(node, branches, defs)
    if "const" in node:
        node = {**node, "enum": [node["const"]]}
        node.pop("const")
        if "type" not in node:
            node["type"] = _json_type(node["enum"][0])
    if "type" not in node:
        raise CrdError(f"a schema node without a type: {sorted(node)}")
    if isinstance(node["type"], list):
        raise CrdError(f"a node of several types: {node['type']}")
    for bound in ("minimum", "maximum"):
        strict = "exclusiveM" + bound[1:]
        if bound in node and strict in node and not isinstance(node[strict], bool):
            raise CrdError(f"both {bound} and {strict}: OpenAPI v3.0 takes one bound")
    for key, value in node.items():
        if key in _DROP:
            continue
        if key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:  # false: forbidden in v1 CRDs; unknown keys are pruned
                out[key] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(value, bool):
                out[key] = value
            else:  # JSON Schema 2020-12 number -> OpenAPI v3.0 bound + flag
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
        elif key == "default":
            if value is not None:
                out[key] = _without_nulls(value)
        elif key == "description":
            out[key] = _text(value)
        elif key in _KEEP:
            out[key] = copy.deepcopy(value)
        elif key == "uniqueItems":
            if value:
                raise CrdError("uniqueItems: true is forbidden in CRDs; use a list type")
        else:
            raise CrdError(f"schema key {key!r} has no structural equivalent")
    return out


def _known(kind: str) -> str:
    if kind not in KINDS:
        raise KeyError(f"{kind!r} is not a kind of {GROUP} (expected one of {', '.join(KINDS)})")
    return kind


def _annotate(defs: dict[str, Schema]) -> None:
    """Put the CEL rules and list types into the models' ``$defs`` before conversion."""
    # A model's $defs hold only the classes it uses; the tests check that every entry of
    # RULES and LIST_TYPES names a class and property of some kind.
    for (name, prop), rules in RULES.items():
        if name in defs:
            target = defs[name] if prop is None else defs[name]["properties"][prop]
            target["x-kubernetes-validations"] = copy.deepcopy(rules)
    for (name, prop), extra in LIST_TYPES.items():
        if name in defs:
            defs[name]["properties"][prop].update(copy.deepcopy(extra))


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Schema]) -> Schema:
    """``node`` with its ``$ref`` inlined; the referring node's own keys (description,
    default, ...) win over the definition's."""
    out = dict(node)
    while "$ref" in out:
        ref = out.pop("$ref")
        prefix = "#/$defs/"
        if not isinstance(ref, str) or not ref.startswith(prefix) or ref[len(prefix) :] not in defs:
            raise CrdError(f"unresolvable $ref {ref!r}")
        out = {**defs[ref[len(prefix) :]], **out}
    return out


def _flatten(branches: list[Any], defs: Mapping[str, Schema]) -> list[Schema]:
    flat: list[Schema] = []
    for branch in branches:
        b = _resolve(branch, defs)
        inner = b.get("anyOf", b.get("oneOf"))
        flat.extend(_flatten(inner, defs) if inner is not None else [b])
    return flat


def _union(node: Mapping[str, Any], branches: list[Any], defs: Mapping[str, Schema]) -> Schema:
    others = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
    flat = _flatten(branches, defs)
    nullable = any(b.get("type") == "null" for b in flat)
    rest = [b for b in flat if b.get("type") != "null"]
    if not rest:
        raise CrdError("a union of null only")
    if len(rest) == 1:
        out = structural({**rest[0], **others}, defs)
    else:
        types = {str(b.get("type")) for b in rest}
        if types == {"integer", "number"} and all(len(b) == 1 for b in rest):
            out = structural({**others, "type": "number"}, defs)
        else:
            out = {
                k: v
                for k, v in structural({**others, "type": "object"}, defs).items()
                if k != "type"
            }
            if types == {"integer", "string"} and all(len(b) == 1 for b in rest):
                out["x-kubernetes-int-or-string"] = True
            else:
                shapes = " | ".join(_shape(b) for b in rest)
                described = out.get("description", "")
                out["description"] = (
                    f"{described} (one of: {shapes}; checked by the operator)".strip()
                )
                out["x-kubernetes-preserve-unknown-fields"] = True
    if nullable:
        out["nullable"] = True
    return out


def _shape(branch: Mapping[str, Any]) -> str:
    """A short spelling of one union branch for a description: ``integer``, ``{min, max}``."""
    if branch.get("type") == "object" and "properties" in branch:
        return "{" + ", ".join(branch["properties"]) + "}"
    if branch.get("type") == "object" and "additionalProperties" in branch:
        return "{key: value}"
    return str(branch.get("type", "any"))


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise CrdError(f"a const of unsupported type {type(value).__name__}")


def _without_nulls(value: Any) -> Any:
    """A default without its null members: unset and null mean the same in the models, and
    Kubernetes would have to keep a null."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _text(value: object) -> str:
    """A description on one line (docstrings may wrap)."""
    return " ".join(str(value or "").split())


__all__ = [
    "CATEGORIES",
    "CRD_API_VERSION",
    "LIST_TYPES",
    "PRINTER_COLUMNS",
    "RULES",
    "CrdError",
    "crd",
    "crd_name",
    "crds",
    "openapi_schema",
    "structural",
]
