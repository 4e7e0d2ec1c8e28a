"""docs/simulator.md's "Trace and cluster files" names every field of the trace and
cluster models, and its examples are files the replay reads: neither can drift from
tangram.api.trace, tangram.api.action and tangram.api.cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tangram.api.action import ActionSpec
from tangram.api.cluster import ApiSpec, ClusterSpec, NodeSpec, ServiceSpec
from tangram.api.demand import AmdahlEfficiency, ChoicesDemand, RangeDemand, TableEfficiency
from tangram.api.trace import Step, TrajectoryTrace

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
MODELS: list[type[BaseModel]] = [
    TrajectoryTrace, Step, ActionSpec, RangeDemand, ChoicesDemand, AmdahlEfficiency,
    TableEfficiency, ClusterSpec, NodeSpec, ServiceSpec, ApiSpec,
]  # fmt: skip


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## Trace and cluster files\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_is_named(model: type[BaseModel]) -> None:
    section = _section()
    missing = [f for f in model.model_fields if f"`{f}`" not in section]
    assert not missing, f"{model.__name__}: docs/simulator.md names no {missing}"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), flags=re.S)


def test_the_examples_are_what_the_replay_reads() -> None:
    trajectory, steps = _blocks("json")
    TrajectoryTrace.model_validate_json(trajectory)  # (wrapped: JSON reads it all the same)
    for line in steps.splitlines():
        Step.model_validate(json.loads(line))
    (cluster,) = _blocks("yaml")
    parsed = ClusterSpec.model_validate(yaml.safe_load(cluster))
    assert parsed.nodes and parsed.services and parsed.apis
