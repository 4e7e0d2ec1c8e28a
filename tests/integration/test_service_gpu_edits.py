"""RewardServices edited, removed, unloadable or partly profiled, end to end: the real
client, the scheduler over HTTP, a real agent with the GPU role on CPU-backed devices and
the PyTorch worker (as in ``test_service_gpu``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import GPU_EXTRA

torch = pytest.importorskip("torch", reason=GPU_EXTRA)

from tangram.api.wire import ActionResult, ServiceDef  # noqa: E402
from tangram.client import ActionStatus, Client, TangramError  # noqa: E402
from tangram.node_agent.agent import NodeAgent  # noqa: E402
from tangram.node_agent.gpu_service import GpuOptions  # noqa: E402
from tangram.service.auth import AGENT_TENANT, OPERATOR_TENANT, TokenStore  # noqa: E402
from tangram.service.config import PoolConfig, ServiceConfig  # noqa: E402
from tangram.service.embedded import Running  # noqa: E402
from tests.fixtures import gated_load, tiny_reward  # noqa: E402
from tests.fixtures.tiny_reward import TinyReward, weights  # noqa: E402

from .service_harness import service, until  # noqa: E402

pytestmark = [pytest.mark.xdist_group("service"), pytest.mark.torch]
USER, OPERATOR, AGENT = "u" * 24, "o" * 24, "g" * 24
INPUTS = [[float(i + j) / 10 for j in range(16)] for i in range(6)]


def _service(
    tmp: Path,
    name: str,
    mib: float,
    seed: int = 0,
    entry: str = "tests.fixtures.tiny_reward:build",
    **kw: Any,
) -> ServiceConfig:
    path = tmp / f"{name}.pt"
    weights(str(path), seed)
    spec = ServiceDef(name=name, entrypoint=entry, weights=str(path), gpu_memory_gb=mib / 1024)
    return ServiceConfig(spec=spec, **kw)


def _expected(seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = TinyReward()
    with torch.inference_mode():
        return [float(v) for v in model(torch.tensor(INPUTS))]


@contextmanager
def _serving(
    tmp: Path, services: list[ServiceConfig], devices: int = 1
) -> Iterator[tuple[Running, Client]]:
    agent = NodeAgent.create(
        tmp / "agent",
        runtime="noop",
        cores_for_actions=1,
        gpus=GpuOptions.parse(f"cpu:{devices}", 10),  # 10 MiB per device
    )
    config = PoolConfig(services={s.spec.name: s for s in services})
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    with (
        service(config, agent, tmp, tokens=tokens) as (running, _),
        Client(running.url, USER) as c,
    ):
        until(lambda: bool(running.engine.gpu.loads), "the agent's services")
        yield running, c


def _reload(running: Running, services: list[ServiceConfig]) -> None:
    config = PoolConfig(services={s.spec.name: s for s in services})
    running.engine.reloader = lambda _text: config
    answer = httpx.post(
        f"{running.url}/v1/admin/reload",
        headers={"Authorization": f"Bearer {OPERATOR}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


def _in_thread(call: Any) -> tuple[threading.Thread, list[ActionResult]]:
    box: list[ActionResult] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    return thread, box


def test_a_call_sent_while_an_edited_service_reloads_runs_on_the_new_one(
    tmp_path: Path,
) -> None:
    """The agent drops the old weights, then loads the new ones, refusing calls of the
    service meanwhile: a call sent then waits for the load instead of failing."""
    judge = _service(tmp_path, "judge", 4, seed=0, entry="tests.fixtures.gated_load:build")
    path = tmp_path / "judge-v2.pt"
    weights(str(path), 5)
    edited = replace(judge, spec=judge.spec.model_copy(update={"weights": str(path)}))
    for event in (gated_load.ARMED, gated_load.BUILDING, gated_load.GATE):
        event.clear()
    try:
        with _serving(tmp_path, [judge]) as (running, client):
            assert client.score("judge", INPUTS).output == _expected(0)
            gated_load.ARMED.set()
            _reload(running, [edited])
            assert gated_load.BUILDING.wait(30)  # the new weights are being loaded
            caller, box = _in_thread(lambda: client.score("judge", INPUTS, timeout_s=30))
            core = running.engine.core
            until(lambda: bool(box) or bool(core.stranded), "the call waits for the load")
            assert not box, box[0].error  # not answered while the agent loads
            gated_load.ARMED.clear()
            gated_load.GATE.set()
            caller.join(30)
        (result,) = box
        assert result.status is ActionStatus.OK, result.error
        assert result.output == pytest.approx(_expected(5), rel=1e-5)
    finally:
        gated_load.ARMED.clear()
        gated_load.GATE.set()


def test_a_removed_service_fails_its_queued_calls_and_leaves_nothing_resident(
    tmp_path: Path,
) -> None:
    slow = _service(tmp_path, "slow", 4, entry="tests.fixtures.tiny_reward:build_slow")
    other = _service(tmp_path, "ok", 4, seed=1)
    tiny_reward.SLOW_GATE.clear()
    try:
        with _serving(tmp_path, [slow, other]) as (running, client):
            core = running.engine.core
            first, ran = _in_thread(lambda: client.score("slow", INPUTS, timeout_s=30))
            until(lambda: len(core.gpu.busy) == 1, "the first call runs")
            second, refused = _in_thread(lambda: client.score("slow", INPUTS, timeout_s=30))
            until(lambda: len(core.actions) == 1, "the second call is queued")
            _reload(running, [other])
            second.join(30)  # answered at once, though the first call still runs
            (queued,) = refused
            assert queued.status is ActionStatus.REJECTED and queued.error is not None
            assert "RewardService slow was removed from the pool" in queued.error.message
            assert not queued.error.retryable
            assert len(core.gpu.busy) == 1  # the first call goes on
            tiny_reward.SLOW_GATE.set()
            first.join(30)
            assert ran[0].status is ActionStatus.OK and ran[0].output == _expected(0)
            until(lambda: "slow" not in core.services, "slow dropped after its last call")
            assert all(i.service != "slow" for i in core.gpu.resident)
            metrics = httpx.get(f"{running.url}/metrics", timeout=10).text
            assert 'service="slow"' not in "".join(
                line for line in metrics.splitlines() if "resident_instances" in line
            )
            assert client.score("ok", INPUTS).output == _expected(1)
    finally:
        tiny_reward.SLOW_GATE.set()


def test_a_service_no_gpu_node_can_load_is_refused_without_retries(tmp_path: Path) -> None:
    big = _service(tmp_path, "big", 40)  # more than a 10 MiB device
    entry = _service(tmp_path, "nowhere", 4, entry="tests.fixtures.tiny_reward:no_such_build")
    with _serving(tmp_path, [big, entry, _service(tmp_path, "judge", 4)]) as (_, client):
        for name, text in (("big", "gpuMemoryGiB"), ("nowhere", "no_such_build")):
            with pytest.raises(TangramError) as e:
                client.score(name, INPUTS)
            assert e.value.status == 409 and not e.value.retryable, e.value
            assert "cannot load on any GPU node" in str(e.value) and text in str(e.value)
        assert client.score("judge", INPUTS).status is ActionStatus.OK


def test_a_call_gets_the_dop_that_fits_though_only_another_is_profiled(tmp_path: Path) -> None:
    teacher = _service(tmp_path, "teacher", 4, dop_choices=(1, 2), profiles=((2, 0.5, None),))
    with _serving(tmp_path, [teacher]) as (_, client):  # one device: DoP 2 cannot fit
        r = client.score("teacher", INPUTS)
        assert r.status is ActionStatus.OK and r.allocation.gpus == [0], r.error
        assert r.output == pytest.approx(_expected(0), rel=1e-5)
