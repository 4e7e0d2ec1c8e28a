"""The chart's label values (podLabels, serviceMonitor.labels) cannot name a label the chart
sets itself. Read from the templates, without helm (CI's unit stage has none; see
test_chart.py): a duplicate key renders twice, and a changed selector label leaves the
operator's Deployment selecting no pod, so every such value goes through the check."""

from __future__ import annotations

import re
from pathlib import Path

CHART = Path(__file__).resolve().parents[2] / "charts" / "arl-tangram"
TEMPLATES = CHART / "templates"
CHECK = "arl-tangram.checkExtraLabels"


def _define(name: str) -> str:
    text = (TEMPLATES / "_helpers.tpl").read_text()
    start = text.index(f'{{{{- define "{name}" -}}}}')
    return text[start : text.index("{{- end }}\n\n", start)]


def test_every_label_value_is_checked_before_it_is_rendered() -> None:
    checked = []
    for path in sorted(TEMPLATES.glob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.fullmatch(r"\s*\{\{- with \.Values\.([\w.]*[lL]abels) \}\}", line)
            if m is None:
                continue
            value = m.group(1)
            checked.append(value)
            call = f'{{{{- include "{CHECK}" (dict "root" $ "labels" . "from" "{value}") }}}}'
            assert lines[i + 1].strip() == call, f"{path.name}:{i + 2}: {value} unchecked"
            assert re.fullmatch(r"\s*\{\{- toYaml \. \| nindent \d+ \}\}", lines[i + 2])
            # What the chart sets just above: the labels the check knows of.
            above = "\n".join(lines[i - 2 : i])
            assert 'include "arl-tangram.labels" .' in above, path.name
            assert above.rstrip().endswith("app.kubernetes.io/component: operator"), path.name
    assert sorted(checked) == ["podLabels", "serviceMonitor.labels"]


def test_the_check_fails_on_any_label_the_chart_sets() -> None:
    body = _define(CHECK)
    # the release's labels and the operator's selector labels (component among them)
    assert 'include "arl-tangram.labels" .root' in body
    assert 'include "arl-tangram.operatorSelectorLabels" .root' in body
    assert "range $key := keys .labels" in body and "hasKey $own $key" in body
    assert "{{- fail (printf" in body and "leave it out" in body
    selector = _define("arl-tangram.operatorSelectorLabels")
    assert "app.kubernetes.io/component: operator" in selector
