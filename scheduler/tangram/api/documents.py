"""Sets of custom-resource documents: validated together, with every problem collected.

The readers of one set (``tangram up -f`` and the builders' tests) get a :class:`Resources`;
an invalid set raises one :class:`ResourceError` whose lines name each document and the
field, in YAML spelling (:func:`yaml_path`). Pure: reading files and parsing YAML happen in
``tangram.cli.manifests``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tangram.api.demand import DEMAND_TAGS, EFFICIENCY_TAGS
from tangram.api.field_errors import error_message
from tangram.api.resources import (
    API_VERSION,
    GROUP,
    KINDS,
    ActionPool,
    ObjectKey,
    RewardService,
    SecretRef,
    TrajectoryEnv,
    reference_problem,
)


class ResourceError(ValueError):
    """One or more documents are invalid; each line of the message is one problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Document:
    """One parsed YAML document and where it came from (``index`` is 1-based)."""

    file: str
    index: int
    content: object

    @property
    def where(self) -> str:
        return f"{self.file}: document {self.index}"


@dataclass(frozen=True)
class Resources:
    """The resources of a set of documents, keyed by (namespace, name).

    A later declaration of the same kind and key replaces an earlier one, as with
    ``kubectl apply``; :meth:`check_references` reports it. ``other`` holds the documents
    of other API groups (Secrets, ConfigMaps, ...) as they were.
    """

    pools: Mapping[ObjectKey, ActionPool] = field(default_factory=dict)
    envs: Mapping[ObjectKey, TrajectoryEnv] = field(default_factory=dict)
    services: Mapping[ObjectKey, RewardService] = field(default_factory=dict)
    other: list[dict[str, Any]] = field(default_factory=list)
    declared: Mapping[tuple[str, str, str], tuple[str, ...]] = field(default_factory=dict)
    """(kind, namespace, name) -> where each declaration came from, in order."""

    def __len__(self) -> int:
        return len(self.pools) + len(self.envs) + len(self.services)

    def _where(self, kind: str, key: ObjectKey) -> str:
        places = self.declared.get((kind, *key), ())
        return f" ({places[-1]})" if places else ""

    def check_references(self) -> list[str]:
        """Problems between documents: duplicates, dangling or unusable pool references."""
        problems: list[str] = []
        for (kind, ns, name), places in self.declared.items():
            if len(places) > 1:
                problems.append(
                    f"{kind} {ns}/{name} is declared {len(places)} times: {', '.join(places)}"
                )
        users: list[TrajectoryEnv | RewardService] = [*self.envs.values(), *self.services.values()]
        for obj in users:
            ns, name = obj.key
            who = f"{obj.kind} {ns}/{name}{self._where(obj.kind, obj.key)}: spec.poolRef"
            problem = reference_problem(obj, self.pools.get(obj.pool_key()))
            if problem is not None:
                problems.append(f"{who}: {problem[1]}")
        # Clients name a pool's environments and services by name alone: two of one name
        # (from two namespaces the pool admits) would leave one of them unserved.
        served: dict[tuple[str, tuple[str, str], str], list[str]] = {}
        for obj in users:
            ns, name = obj.key
            place = f"{ns}/{name}{self._where(obj.kind, obj.key)}"
            served.setdefault((obj.kind, obj.pool_key(), name), []).append(place)
        for (kind, (pool_ns, pool), name), same in served.items():
            if len(same) > 1:
                problems.append(
                    f"{kind}s of one name, {name!r}, in ActionPool {pool_ns}/{pool}, which "
                    f"its clients name by name alone: {', '.join(same)}; rename all but one"
                )
        return problems

    def secret_value(self, namespace: str, ref: SecretRef) -> str | None:
        """The value of a Secret key among ``other`` (stringData, else base64 data), if there."""
        for doc in reversed(self.other):
            meta = doc.get("metadata") or {}
            if (
                doc.get("apiVersion") == "v1"
                and doc.get("kind") == "Secret"
                and meta.get("name") == ref.name
                and meta.get("namespace", "default") == namespace
            ):
                plain = (doc.get("stringData") or {}).get(ref.key)
                if plain is not None:
                    return str(plain)
                encoded = (doc.get("data") or {}).get(ref.key)
                if encoded is None:
                    return None
                try:
                    return base64.b64decode(str(encoded), validate=True).decode("utf-8")
                except (binascii.Error, UnicodeDecodeError):
                    raise ValueError(
                        f"Secret {namespace}/{ref.name}: data.{ref.key} is not base64 UTF-8"
                    ) from None
        return None


_UNION_TAGS = DEMAND_TAGS | EFFICIENCY_TAGS
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def yaml_path(loc: Sequence[int | str], data: object) -> str:
    """A pydantic error location in YAML spelling, e.g. ``spec.apis[0].rate``.

    Walks the input alongside the location, so that the tags of tagged unions (a Demand's
    ``range``, an Efficiency's ``amdahl``), which are not keys in the YAML, are left out.
    """
    out = ""
    node: object = data
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out += f"[{part}]"
            node = node[part]
            continue
        elif isinstance(part, str) and part in _UNION_TAGS:
            continue
        else:
            node = None
        if isinstance(part, str) and _PLAIN_KEY.match(part):
            out += f".{part}"
        else:
            out += f"[{part!r}]"
    return out.lstrip(".") or "(document)"


def _message(err: Mapping[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field (misspelt? keys are camelCase)"
    return error_message(err)


# A check across a spec's fields names the one it found wrong ("actions[0].cpu: ...").
_NAMES_FIELD = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*): (.+)", re.S)


def problem(err: Mapping[str, Any], body: object) -> str:
    """One validation error of a document as ``path: what is wrong``, the path in YAML
    spelling down to the field a check across fields named (``spec.actions[0].timeoutSeconds``,
    not ``spec``)."""
    path, message = yaml_path(err["loc"], body), _message(err)
    if err["type"] == "value_error" and (named := _NAMES_FIELD.fullmatch(message)):
        head, _, last = path.rpartition(".")
        if re.match(rf"{re.escape(last)}\b", named[1]):  # (a list's check: "actions[0]...")
            path = head
        path = f"{path}.{named[1]}" if path and path != "(document)" else named[1]
        message = named[2]
    return f"{path}: {message}"


def _describe(body: Mapping[str, Any]) -> str:
    kind, meta = body.get("kind"), body.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if isinstance(kind, str) and isinstance(name, str):
        return f" ({kind}/{name})"
    return f" ({kind})" if isinstance(kind, str) else ""


def parse_documents(documents: Iterable[Document]) -> Resources:
    """Validate parsed documents into :class:`Resources`.

    Empty documents are skipped and those of other API groups go to ``other`` (a ``v1``
    ``List`` is unpacked first). Every problem of every document is collected into one
    :class:`ResourceError`; references between documents are checked separately
    (:meth:`Resources.check_references`).
    """
    problems: list[str] = []
    found: dict[str, dict[ObjectKey, Any]] = {kind: {} for kind in KINDS}
    other: list[dict[str, Any]] = []
    declared: dict[tuple[str, str, str], tuple[str, ...]] = {}

    def one(where: str, body: object) -> None:
        if body is None:
            return
        if not isinstance(body, dict):
            problems.append(f"{where}: a manifest must be a mapping, not {type(body).__name__}")
            return
        label = where + _describe(body)
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if not isinstance(api_version, str) or not api_version:
            problems.append(f"{label}: apiVersion: required (a string)")
            return
        if not isinstance(kind, str) or not kind:
            problems.append(f"{label}: kind: required (a string)")
            return
        if api_version.split("/")[0] != GROUP:
            if api_version == "v1" and kind == "List" and isinstance(body.get("items"), list):
                for i, item in enumerate(body["items"]):
                    one(f"{where} items[{i}]", item)
            elif kind in KINDS:  # ours by its kind: a misspelt group, not another API's
                problems.append(
                    f"{label}: apiVersion: {api_version!r} is not {GROUP}'s; use {API_VERSION}"
                )
            else:
                other.append(body)
            return
        if api_version != API_VERSION:
            problems.append(
                f"{label}: apiVersion: {api_version!r} is not served; use {API_VERSION}"
            )
            return
        cls = KINDS.get(kind)
        if cls is None:
            problems.append(
                f"{label}: kind: {kind!r} is not a kind of {GROUP} (expected one of "
                f"{', '.join(KINDS)})"
            )
            return
        try:
            obj = cls.model_validate(body, by_alias=True, by_name=False)
        except ValidationError as e:
            problems.extend(f"{label}: {problem(err, body)}" for err in e.errors())
            return
        found[kind][obj.key] = obj
        decl = (kind, *obj.key)
        declared[decl] = (*declared.get(decl, ()), where)

    for doc in documents:
        one(doc.where, doc.content)
    if problems:
        raise ResourceError(problems)
    return Resources(
        pools=found["ActionPool"],
        envs=found["TrajectoryEnv"],
        services=found["RewardService"],
        other=other,
        declared=declared,
    )
