"""Sandbox pods carry the trajectory's id as a label only when Kubernetes takes it as a
label value; any id the API accepts gives a value the API server accepts."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from tangram.api.wire import ID_PATTERN, EnvSpec
from tangram.node_agent.pod_runtime import TRAJECTORY, _opened
from tangram.node_agent.pod_template import label_value, sandbox_pod

# The API server's rule for label values (k8s.io/apimachinery validation.IsValidLabelValue).
K8S_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@given(st.from_regex(ID_PATTERN, fullmatch=True))
def test_every_trajectory_id_gives_a_valid_label_and_keeps_itself_as_an_annotation(
    tid: str,
) -> None:
    labels, annotations = _opened(tid)
    value = labels[TRAJECTORY]
    assert K8S_LABEL_VALUE.match(value) and len(value) <= 63
    assert annotations[TRAJECTORY] == tid
    if len(tid) <= 63 and K8S_LABEL_VALUE.match(tid):
        assert value == tid  # readable in `kubectl get -l` whenever it can be


def test_ids_a_label_cannot_hold_are_told_apart_by_their_digest() -> None:
    long = "t." + "x" * 100
    assert label_value(long) != label_value(long + "y")
    assert label_value("ends-in-a-dash-") != label_value("ends-in-a-dash_")
    assert label_value("t-1") == "t-1"


def test_the_pod_manifest_carries_the_annotations() -> None:
    spec = EnvSpec(name="swe", image="swe:1", pool="p")
    tid = "t-" + "y" * 120 + "-"
    labels, notes = _opened(tid)
    pod = sandbox_pod(spec, name="n", namespace="ns", node="x" * 70, execd_image="e",
                      execd_path="/e", extra_labels=labels, annotations=notes)  # fmt: skip
    meta = pod["metadata"]
    assert meta["annotations"] == {TRAJECTORY: tid}
    for key, value in meta["labels"].items():
        assert K8S_LABEL_VALUE.match(value) and len(value) <= 63, key
