"""`tangram up` on a machine smaller than the pool: it says what does not fit — the cores
of spec.cpu, a profile's cores, an environment's memory, RewardServices with no GPU —
naming the field and this machine's figure, and the banner lists the RewardServices."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tangram.api.documents import Resources
from tangram.api.resources import ActionPool
from tangram.api.wire import GpuWorkerInfo
from tangram.cli.manifests import load_documents, load_text
from tangram.cli.up import cluster_only_warnings, fit_warnings, gpu_warnings
from tangram.service.config import PoolConfig
from tangram.service.embedded import free_port
from tangram.service.from_resources import choose_pool, pool_config

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "manifests" / "examples" / "local"
MOPD = ROOT / "manifests" / "examples" / "mopd"

BIG = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: big}
spec:
  cpu: {coresPerNode: 60, idleCores: 2}
---
apiVersion: tangram.dev/v1alpha1
kind: TrajectoryEnv
metadata: {name: box}
spec:
  poolRef: big
  image: busybox
  memoryGiB: 5000
  actions:
    - {name: tests, command: [pytest], cpu: {min: 4, max: 8}}
"""


def _config(text: str) -> PoolConfig:
    resources = load_text(text, "pool.yaml")
    return pool_config(resources, choose_pool(resources, None))


def test_what_a_small_machine_cannot_give_is_named_with_its_figure() -> None:
    said = fit_warnings(
        _config(BIG), host_cores=2, memory_gb=7.8, action_cores=[0, 1], idle_cores=[0, 1]
    )
    assert said == [
        "spec.cpu.idleCores 2: this machine has 2 cores, so idle sandboxes share cores with "
        "actions (action cores [0, 1], idle [0, 1])",
        "TrajectoryEnv box: spec.actions[tests].cpu needs at least 4 cores; actions here get "
        "2 ([0, 1]): those actions cannot run",
        "TrajectoryEnv box: spec.memoryGiB 5000 is more than this machine's 7.8 GiB: its "
        "trajectories cannot open",
    ]
    # Enough cores for the idle set, not for coresPerNode (or --cores) beside it.
    said = fit_warnings(
        _config(BIG), host_cores=8, memory_gb=8000, action_cores=[2, 3, 4, 5, 6, 7],
        idle_cores=[0, 1],
    )  # fmt: skip
    assert said == [
        "spec.cpu.coresPerNode 60 and spec.cpu.idleCores 2 need 62 cores; this machine has "
        "8: actions get 6 (action cores [2, 3, 4, 5, 6, 7], idle [0, 1])"
    ]
    said = fit_warnings(
        _config(BIG), host_cores=4, memory_gb=8000, action_cores=[0, 1, 2, 3],
        idle_cores=[0, 1], cores_flag=100,
    )  # fmt: skip
    assert said[0].startswith("--cores 100 and spec.cpu.idleCores 2 need 102 cores; this")
    assert said[0].endswith("[0, 1] are both)")


def test_a_pool_that_fits_says_nothing_and_virtual_cores_are_not_counted() -> None:
    local = pool_config(*_local())
    assert fit_warnings(local, host_cores=64, memory_gb=256, action_cores=list(range(1, 64)),
                        idle_cores=[0]) == []  # fmt: skip
    big = fit_warnings(_config(BIG), host_cores=None, memory_gb=8000,
                       action_cores=list(range(1024)), idle_cores=[0])  # fmt: skip
    assert big == []


def _local() -> tuple[Resources, ActionPool]:
    resources = load_documents([LOCAL])
    return resources, choose_pool(resources, None)


def test_reward_services_without_a_gpu_to_run_on_say_what_to_pass() -> None:
    resources = load_documents([MOPD])
    mopd = pool_config(resources, choose_pool(resources, None))
    (said,) = gpu_warnings(mopd, None, "auto")
    assert said.startswith(
        "the pool's RewardServices (code-teacher, judge, math-teacher) have no GPU here: "
        "--gpus auto found no CUDA device"
    )
    assert "Pass --gpus cpu:N" in said
    two = GpuWorkerInfo(backend="cpu", devices=[0, 1], memory_bytes=[64 << 30] * 2, h2d_gbps=1)
    said_two = gpu_warnings(mopd, two, "cpu:2")
    assert [s.split(":")[0] for s in said_two] == ["RewardService code-teacher"]
    assert "fit none of this machine's 2 cpu devices of 64.0 GiB" in said_two[0]
    assert gpu_warnings(pool_config(*_local()), None, "auto") == []


def _up_warnings(pool: Path, tmp_path: Path) -> str:
    """What `tangram up -f pool` (noop runtime, no GPU) says up to its first warning."""
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "tokens")}
    up = subprocess.Popen(
        [sys.executable, "-m", "tangram.cli.main", "up", "-f", str(pool), "--runtime", "noop",
         "--gpus", "none", "--port", str(free_port()), "--state-dir", str(tmp_path / "state"),
         "--learned-file", ""],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    lines = []
    guard = threading.Timer(120, up.send_signal, (signal.SIGINT,))  # no warning: no hang
    guard.start()
    try:
        for line in up.stdout:
            lines.append(line)
            if "warning" in line or "Traceback" in line:
                break
    finally:
        guard.cancel()
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    text = "".join(lines) + rest
    assert up.returncode == 0, text
    return text


CLUSTER_ONLY = """
apiVersion: tangram.dev/v1alpha1
kind: ActionPool
metadata: {name: p}
spec:
  cpu: {nodeSelector: {tier: sandbox}}
  scheduler: {port: 9000, drainSeconds: 5, agentGraceSeconds: 3}
---
apiVersion: tangram.dev/v1alpha1
kind: TrajectoryEnv
metadata: {name: box}
spec: {poolRef: p, image: busybox, runtimeClassName: runc-hardened}
"""


def test_what_only_a_cluster_uses_is_named_and_what_both_use_is_not() -> None:
    resources = load_text(CLUSTER_ONLY, "pool.yaml")
    pool = choose_pool(resources, None)
    said = cluster_only_warnings(pool, pool_config(resources, pool), 8080)
    assert said == [
        "spec.cpu.nodeSelector: chooses a cluster's nodes; here this machine is the pool's "
        "one node",
        "spec.scheduler.drainSeconds: the operator's scheduler pod's setting; not used here",
        "spec.scheduler.port: the operator's scheduler pod's setting; this process serves on "
        "--port 8080",
        "TrajectoryEnv box: spec.runtimeClassName runc-hardened: the sandbox pods' "
        "RuntimeClass on a cluster; not used here",
    ]  # (agentGraceSeconds is used here too: not named)
    local = load_documents([str(LOCAL)])
    pool = choose_pool(local, None)
    assert cluster_only_warnings(pool, pool_config(local, pool), 8080) == []


def test_up_lists_the_reward_services_and_warns_when_no_gpu_can_run_them(
    tmp_path: Path,
) -> None:
    text = _up_warnings(MOPD, tmp_path)
    assert "RewardServices: code-teacher, judge, math-teacher;" in text
    assert "warning: the pool's RewardServices (code-teacher, judge, math-teacher) have no " in text
    assert "--gpus none serves none" in text and "--gpus cpu:N" in text


def test_up_warns_of_an_environment_bigger_than_this_machine(tmp_path: Path) -> None:
    pool = (LOCAL / "pool.yaml").read_text()
    assert "memoryGiB: 0.5 " in pool
    (tmp_path / "pool.yaml").write_text(pool.replace("memoryGiB: 0.5 ", "memoryGiB: 99999 "))
    text = _up_warnings(tmp_path / "pool.yaml", tmp_path)
    assert (
        "warning: TrajectoryEnv sandbox: spec.memoryGiB 99999 is more than this machine's" in text
    )
