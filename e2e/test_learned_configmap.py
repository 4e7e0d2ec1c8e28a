"""The scheduler's learned state in a ConfigMap, on a real kube-apiserver, with exactly the
rights the operator's Role gives it: get and patch of that one ConfigMap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.controlplane import ControlPlane

from tangram.api.learned import LearnedFit, LearnedMean, LearnedState
from tangram.service.kube import LearnedConfigMap, api_client
from tangram.service.learned_file import read_state, write_state

pytestmark = pytest.mark.e2e

NS, NAME = "learning", "pool-learned"
STATE = LearnedState(
    profiles={"suite": LearnedFit(n=2, sx=1.5, sy=9.0, sxx=1.25, sxy=6.0, syy=41.0, counts=[1, 2])},
    lengths=[3, 5, 8],
    think_s=LearnedMean(mean=4.5, seen=12),
)


def test_the_scheduler_keeps_its_state_in_its_configmap_and_nowhere_else(
    control_plane: ControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cp = control_plane
    cp.kubectl("create", "namespace", NS)
    cp.kubectl("create", "serviceaccount", "scheduler", "-n", NS)
    for name in (NAME, "other"):
        cp.kubectl("create", "configmap", name, "-n", NS)
    cp.kubectl("create", "role", "scheduler", "-n", NS, "--verb=get,patch",
               "--resource=configmaps", f"--resource-name={NAME}")  # fmt: skip
    cp.kubectl("create", "rolebinding", "scheduler", "-n", NS, "--role=scheduler",
               f"--serviceaccount={NS}:scheduler")  # fmt: skip
    api = api_client(str(cp.service_account_kubeconfig(NS, "scheduler", tmp_path / "kc")))
    store = LearnedConfigMap(api, NS, NAME)

    assert store.read() is None  # made by the operator, with no state yet
    write_state(store, STATE)
    assert read_state(store) == STATE
    written = cp.kubectl("get", "configmap", NAME, "-n", NS, "-o", "json").stdout
    assert LearnedState.model_validate_json(json.loads(written)["data"]["learned.json"]) == STATE

    # A document that cannot be read is set aside under its own key; the next save writes
    # beside it.
    bad = json.dumps({"data": {"learned.json": '{"lengths": [-1]}'}})
    cp.kubectl("patch", "configmap", NAME, "-n", NS, "-p", bad)
    assert read_state(store) is None
    assert f"ConfigMap {NS}/{NAME}" in caplog.text and "lengths.0" in caplog.text
    data = json.loads(cp.kubectl("get", "configmap", NAME, "-n", NS, "-o", "json").stdout)["data"]
    assert data == {"learned.json.bad": '{"lengths": [-1]}'}
    write_state(store, STATE)
    assert read_state(store) == STATE

    # The Role names its ConfigMap alone; and one the operator has not made is named so.
    with pytest.raises(OSError, match=f"ConfigMap {NS}/other: forbidden"):
        LearnedConfigMap(api, NS, "other").read()
    cp.kubectl("delete", "configmap", NAME, "-n", NS)
    with pytest.raises(OSError, match="not found \\(the operator makes it with the pool\\)"):
        store.read()
    with pytest.raises(OSError, match="not found"):
        write_state(store, STATE)
