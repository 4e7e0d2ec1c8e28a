"""RewardService calls end to end: the real client, the scheduler over HTTP, a real agent
with the GPU role on CPU-backed devices (``--gpus cpu:N``), the PyTorch worker and a tiny
model built in code. The same path runs on CUDA devices with ``--gpus auto``."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import GPU_EXTRA

torch = pytest.importorskip("torch", reason=GPU_EXTRA)

from tangram.api.wire import ActionResult, ServiceDef  # noqa: E402
from tangram.client import ActionStatus, AsyncClient, Client, TangramError  # noqa: E402
from tangram.node_agent.agent import NodeAgent  # noqa: E402
from tangram.node_agent.gpu_service import GpuOptions  # noqa: E402
from tangram.service.auth import AGENT_TENANT, OPERATOR_TENANT, TokenStore  # noqa: E402
from tangram.service.config import PoolConfig, ServiceConfig  # noqa: E402
from tangram.service.embedded import Running  # noqa: E402
from tests.fixtures import tiny_reward  # noqa: E402
from tests.fixtures.tiny_reward import TinyReward, weights  # noqa: E402

from .service_harness import service, until  # noqa: E402

pytestmark = [pytest.mark.xdist_group("service"), pytest.mark.torch]
ENTRY = "tests.fixtures.tiny_reward:build"
SLOW_ENTRY = "tests.fixtures.tiny_reward:build_slow"
STAMPED_ENTRY = "tests.fixtures.tiny_reward:build_stamped"
INPUTS = [[float(i + j) / 10 for j in range(16)] for i in range(6)]


def _service(
    tmp: Path, name: str, mib: int, seed: int = 0, dops: tuple[int, ...] = (1,), **kw: object
) -> ServiceConfig:
    path = tmp / f"{name}.pt"
    weights(str(path), seed)
    spec = ServiceDef(name=name, entrypoint=ENTRY, weights=str(path), gpu_memory_gb=mib / 1024)
    return ServiceConfig(spec=spec, dop_choices=dops, **kw)  # type: ignore[arg-type]


def _expected(seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = TinyReward()
    with torch.inference_mode():
        return [float(v) for v in model(torch.tensor(INPUTS))]


USER, OPERATOR, AGENT = "u" * 24, "o" * 24, "g" * 24


@contextmanager
def _serving(
    tmp: Path,
    services: list[ServiceConfig],
    devices: int = 1,
    mib: int = 10,
    gpus: str = "cpu",
    *,
    agents: list[NodeAgent] | None = None,
) -> Iterator[tuple[Running, Client]]:
    """``gpus``: ``cpu`` (``devices`` CPU-backed devices), or a ``--gpus`` value for CUDA
    (``auto``: every device; ``cuda:0``: that one). ``agents``: the agent is added to it."""
    agent = NodeAgent.create(
        tmp / "agent",
        runtime="noop",  # no exec actions here: no cgroups, so no root needed
        cores_for_actions=1,
        gpus=GpuOptions.parse(f"cpu:{devices}" if gpus == "cpu" else gpus, mib),
    )
    if agents is not None:
        agents.append(agent)
    config = PoolConfig(services={s.spec.name: s for s in services})
    tokens = TokenStore({USER: "local", OPERATOR: OPERATOR_TENANT, AGENT: AGENT_TENANT})
    with (
        service(config, agent, tmp, tokens=tokens) as (running, _),
        Client(running.url, USER) as c,
    ):
        yield running, c


@contextmanager
def _running(
    tmp: Path, services: list[ServiceConfig], devices: int = 1, mib: int = 10
) -> Iterator[Client]:
    with _serving(tmp, services, devices, mib) as (_, client):
        yield client


def test_restore_then_resident_with_the_models_own_scores(tmp_path: Path) -> None:
    with _running(tmp_path, [_service(tmp_path, "judge", 4, seed=3)]) as client:
        first = client.score("judge", INPUTS)
        assert first.status is ActionStatus.OK, first.error
        assert first.kind == "service" and first.output == _expected(3)
        assert first.service is not None and not first.service.resident
        assert first.service.restored_bytes > 0 and first.timings.restore_s > 0
        assert first.allocation.gpus == [0] and first.allocation.dop == 1
        again = client.score("judge", INPUTS)
        assert again.service is not None and again.service.resident
        assert again.output == first.output and again.service.restore_s == 0.0


def test_the_scheduler_and_the_worker_evict_the_least_recently_used(tmp_path: Path) -> None:
    services = [_service(tmp_path, n, 6, seed=i) for i, n in enumerate(("judge", "critic"))]
    with _serving(tmp_path, services) as (running, client):  # 10 MiB: one model at a time
        client.score("judge", INPUTS)
        critic = client.score("critic", INPUTS)
        assert critic.service is not None and critic.service.evicted == ["judge@0"]
        judge = client.score("judge", INPUTS)
        assert judge.service is not None and not judge.service.resident
        assert judge.service.evicted == ["critic@0"] and judge.output == _expected(0)
        metrics = httpx_get(client, "/metrics")
        calls = 'tangram_service_calls_total{pool="default",resident="false",service="judge"}'
        assert f"{calls} 2.0" in metrics
        samples = {
            (m.name, tuple(sorted(m.labels.items()))): m.value
            for family in text_string_to_metric_families(metrics)
            for m in family.samples
        }

        def sample(name: str, **labels: str) -> float | None:
            return samples.get((name, tuple(sorted({"pool": "default", **labels}.items()))))

        # Restores and evictions are timed apart: judge restored twice, critic evicted once.
        assert sample("tangram_service_restore_seconds_count", service="judge") == 2
        assert sample("tangram_service_evict_seconds_count", service="critic") == 1
        # What is resident now, and what it holds of the device's memory.
        node = next(iter(running.engine.core.gpu.nodes))
        resident = "tangram_service_resident_instances"
        assert sample(resident, service="judge", node=node) == 1
        assert sample(resident, service="critic", node=node) is None
        assert sample("tangram_gpu_memory_resident_gb", node=node, gpu="0") == pytest.approx(
            6 / 1024
        )
        assert "tangram_units_capacity{node=" in metrics and 'resource="gpu"' in metrics


def test_a_call_restores_its_service_ahead_on_a_free_gpu(tmp_path: Path) -> None:
    """The round that starts a call restores its service ahead on the other, free GPU
    (the core's restore ahead, the agent's worker copying it without holding the GPU):
    then two calls at once both find it resident, one on each GPU."""
    slow = _service(tmp_path, "slow", 4, seed=3)
    slow = replace(slow, spec=slow.spec.model_copy(update={"entrypoint": SLOW_ENTRY}))
    tiny_reward.SLOW_GATE.set()
    with _serving(tmp_path, [slow], devices=2) as (running, client):
        first = client.score("slow", INPUTS)
        assert first.status is ActionStatus.OK and first.service is not None
        assert not first.service.resident
        core = running.engine.core
        until(lambda: len(core.gpu.resident) == 2 and not core.gpu.ahead, "the restore ahead")
        metrics = httpx_get(client, "/metrics")
        ahead = "tangram_service_restores_ahead_total"
        labels = '{pool="default",result="restored",service="slow"}'
        assert f"{ahead}{labels} 1.0" in metrics
        tiny_reward.SLOW_GATE.clear()  # calls now hold their GPUs until the gate opens
        box: list[ActionResult] = []
        calls = [
            threading.Thread(target=lambda: box.append(client.score("slow", INPUTS)))
            for _ in range(2)
        ]
        try:
            for t in calls:
                t.start()
            until(lambda: len(core.gpu.busy) == 2, "both calls on a GPU")
        finally:
            tiny_reward.SLOW_GATE.set()
            for t in calls:
                t.join(30)
        assert sorted(g for r in box for g in r.allocation.gpus) == [0, 1]
        assert all(r.service is not None and r.service.resident for r in box)
        assert all(r.output == first.output for r in box)


def test_a_call_may_span_a_chunk_of_gpus(tmp_path: Path) -> None:
    teacher = _service(
        tmp_path, "teacher", 4, seed=1, dops=(1, 2), profiles=((1, 2.0, None), (2, 1.1, None))
    )
    with _running(tmp_path, [teacher], devices=2) as client:
        r = client.score("teacher", INPUTS)  # alone: the faster DoP 2, one replica per device
        assert r.status is ActionStatus.OK and r.allocation.gpus == [0, 1]
        assert r.allocation.dop == 2 and r.output == pytest.approx(_expected(1), rel=1e-5)
        one = client.score("teacher", INPUTS, gpu=1)  # the caller narrowed it
        assert one.allocation.dop == 1 and len(one.allocation.gpus) == 1


def test_a_timed_out_call_keeps_its_gpu_until_it_ends(tmp_path: Path) -> None:
    slow = _service(tmp_path, "slow", 4)
    slow = replace(slow, spec=slow.spec.model_copy(update={"entrypoint": SLOW_ENTRY}))
    tiny_reward.SLOW_GATE.clear()
    tiny_reward.SLOW_SPANS.clear()
    try:
        with _serving(tmp_path, [slow]) as (running, client):  # one device
            late = client.score("slow", INPUTS, timeout_s=0.2)
            assert late.status is ActionStatus.TIMEOUT and late.output is None
            # Said so, and its time is its run's, not the service's overhead.
            assert late.error is not None and late.error.code == "timeout"
            assert late.error.message.startswith("no answer within 0.2 s (timeout_s)")
            assert late.timings.exec_s > 0 and late.timings.overhead_s == 0, late.timings
            # Its thread still holds device 0: the next call must wait for it.
            box: list[ActionResult] = []
            nxt = threading.Thread(target=lambda: box.append(client.score("slow", INPUTS)))
            nxt.start()
            engine = running.engine
            until(  # answered, or admitted and seen by a round since (then still queued)
                lambda: (
                    bool(box)
                    or (
                        any(r.kind == "service" for r in engine.state.actions.values())
                        and not engine.state.wake.is_set()
                    )
                ),
                "the second call was never scheduled",
            )
            tiny_reward.SLOW_GATE.set()
            nxt.join(30)
            (after,) = box
        assert after.status is ActionStatus.OK, after.error
        assert after.output == _expected(0) and after.timings.queued_s > 0
        (_, first_ended), (second_started, _) = sorted(tiny_reward.SLOW_SPANS)
        assert second_started >= first_ended  # never both on device 0
    finally:
        tiny_reward.SLOW_GATE.set()


def test_concurrent_calls_share_a_resident_instance_and_its_forward_passes(
    tmp_path: Path,
) -> None:
    """With ``batching.maxCalls``, calls that arrive while one runs join its instance: the
    scheduler puts them on its GPU, and the worker scores their inputs together in the
    next forward pass, while the first call's pass still holds the device."""
    slow = _service(tmp_path, "judge", 4, max_calls=4, batch_slowdown=0.1)
    slow = replace(slow, spec=slow.spec.model_copy(update={"entrypoint": SLOW_ENTRY}))
    tiny_reward.SLOW_GATE.clear()
    tiny_reward.SLOW_SPANS.clear()
    agents: list[NodeAgent] = []
    try:
        with _serving(tmp_path, [slow], agents=agents) as (running, client):
            (agent,) = agents
            assert agent.gpu is not None
            worker = agent.gpu.backend
            results: list[ActionResult] = []

            async def burst() -> None:
                async with AsyncClient(running.url, USER) as c:
                    calls = [c.score("judge", INPUTS[i : i + 1]) for i in range(4)]
                    results.extend(await asyncio.gather(*calls))

            caller = threading.Thread(target=lambda: asyncio.run(burst()), daemon=True)
            caller.start()

            def queued() -> int:
                resident = getattr(worker, "instances", {}).get(("judge", (0,)))
                return len(resident.passes[0]._queue) if resident else 0

            # The first call's pass waits at the gate; the three others queue behind it.
            until(lambda: queued() == 3, "the other calls never joined the instance")
            tiny_reward.SLOW_GATE.set()
            caller.join(30)
            metrics = httpx_get(client, "/metrics")
    finally:
        tiny_reward.SLOW_GATE.set()
    assert len(results) == 4 and all(r.status is ActionStatus.OK for r in results), results
    assert all(r.allocation.gpus == [0] for r in results)
    expected = _expected(0)
    assert sorted(r.output[0] for r in results) == pytest.approx(sorted(expected[:4]), rel=1e-5)
    assert len(tiny_reward.SLOW_SPANS) == 2  # one pass for the first, one for the three
    joined = 'tangram_service_calls_joined_total{pool="default",service="judge"} 3.0'
    assert joined in metrics


@pytest.mark.parametrize(
    "gpus",
    [
        "cpu",
        pytest.param("auto", marks=pytest.mark.gpu),
        pytest.param("cuda:0", marks=pytest.mark.gpu),
    ],
)
def test_calls_of_two_services_never_share_a_gpu(tmp_path: Path, gpus: str) -> None:
    if gpus != "cpu" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    stamped = [
        replace(s, spec=s.spec.model_copy(update={"entrypoint": STAMPED_ENTRY}))
        for s in (_service(tmp_path, "judge", 6, seed=0), _service(tmp_path, "critic", 6, 1))
    ]
    # One device that holds one of the two at a time: every switch is an eviction.
    with _serving(tmp_path, stamped, gpus=gpus) as (running, _):

        async def burst() -> list[ActionResult]:
            async with AsyncClient(running.url, USER) as c:
                calls = [c.score(n, INPUTS[:1]) for n in ("judge", "critic") * 4]
                return list(await asyncio.gather(*calls))

        results = asyncio.run(burst())
    assert all(r.status is ActionStatus.OK for r in results), [r.error for r in results]
    assert {tuple(r.allocation.gpus) for r in results} == {(0,)}
    spans = sorted(tuple(r.output[0]) for r in results)
    for (_, ended), (started, _) in itertools.pairwise(spans):
        assert started >= ended  # one call at a time on the device
    assert sum(len(r.service.evicted) for r in results if r.service) >= 1


def test_a_batch_takes_service_calls_all_or_none(tmp_path: Path) -> None:
    services = [_service(tmp_path, n, 4, seed=i) for i, n in enumerate(("judge", "critic"))]
    with _running(tmp_path, services, devices=2) as client:
        items = [{"service": n, "score": {"inputs": INPUTS}} for n in ("critic", "judge")]
        critic, judge = client.batch(items)
        assert (critic.kind, critic.service and critic.service.service) == ("service", "critic")
        assert critic.output == _expected(1) and judge.output == _expected(0)
        with pytest.raises(TangramError) as e:
            client.batch([items[0], {"service": "nope", "score": {"inputs": INPUTS}}])
        assert e.value.status == 404 and "unknown RewardService 'nope'" in str(e.value)
        calls = httpx_get(client, "/metrics")
        ran = 'tangram_service_calls_total{pool="default",resident="false",service="critic"}'
        # the withdrawn critic call never ran, resident or not
        assert f"{ran} 1.0" in calls and 'resident="true",service="critic"' not in calls


def test_bad_calls_and_bad_services_are_named(tmp_path: Path) -> None:
    broken = ServiceConfig(
        spec=ServiceDef(
            name="broken", entrypoint=ENTRY, weights=str(tmp_path / "none.pt"), gpu_memory_gb=0.001
        )
    )
    with _running(tmp_path, [_service(tmp_path, "judge", 4), broken]) as client:
        cases: list[tuple[str, dict[str, int], int, str]] = [
            ("nope", {}, 404, "unknown RewardService 'nope'"),
            ("judge", {"gpu": 2}, 400, "dopChoices"),
            ("broken", {}, 409, "none.pt"),  # every node failed to load it: no retry
        ]
        for name, options, status, text in cases:
            with pytest.raises(TangramError) as e:
                client.score(name, INPUTS, **options)
            assert e.value.status == status and text in str(e.value)
        assert client.score("judge", INPUTS).status is ActionStatus.OK


def test_outputs_json_cannot_carry_fail_the_call_not_the_gpu(tmp_path: Path) -> None:
    """A score that returns its tensor (not ``.tolist()``) gets an error reply that says
    so, and its GPU is free again: the next call, of another service, runs there."""
    tensor = _service(tmp_path, "tensor", 4)
    tensor = replace(
        tensor,
        spec=tensor.spec.model_copy(
            update={"entrypoint": "tests.fixtures.odd_reward:build_tensor"}
        ),
    )
    with _running(tmp_path, [tensor, _service(tmp_path, "judge", 4)]) as client:
        bad = client.score("tensor", INPUTS, timeout_s=20)
        assert bad.status is ActionStatus.ERROR and bad.error is not None, bad
        assert "score returned a torch.Tensor at outputs[0]" in bad.error.message
        good = client.score("judge", INPUTS, timeout_s=20)
        assert good.status is ActionStatus.OK and good.allocation.gpus == [0]
        assert good.output == _expected(0)


def test_reloaded_services_are_loaded_and_edited_ones_reloaded(tmp_path: Path) -> None:
    judge = _service(tmp_path, "judge", 4, seed=0)
    with _serving(tmp_path, [judge], devices=2) as (running, client):
        assert client.score("judge", INPUTS).output == _expected(0)
        weights(str(tmp_path / "judge.pt"), 5)  # new weights, and a new size: an edit
        edited = _service(tmp_path, "judge", 5, seed=5)
        critic = _service(tmp_path, "critic", 4, seed=2)
        reloaded = PoolConfig(services={"judge": edited, "critic": critic})
        running.engine.reloader = lambda _text: reloaded
        answer = httpx.post(
            f"{running.url}/v1/admin/reload",
            headers={"Authorization": f"Bearer {OPERATOR}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["changes"] == [
            "RewardService critic added",
            "RewardService judge changed (spec.gpu_memory_gb)",
        ]
        assert _eventually(lambda: client.score("critic", INPUTS).output == _expected(2))
        assert _eventually(lambda: client.score("judge", INPUTS).output == _expected(5))
        figures = httpx.get(
            f"{running.url}/v1/admin/status",
            headers={"Authorization": f"Bearer {OPERATOR}"},
            timeout=10,
        ).json()
        assert figures["gpus"] == 2 and figures["gpus_in_use"] == 0


def test_new_weights_of_the_same_size_leave_nothing_resident(tmp_path: Path) -> None:
    judge = _service(tmp_path, "judge", 4, seed=0)
    with _serving(tmp_path, [judge]) as (running, client):
        assert client.score("judge", INPUTS).output == _expected(0)
        pool = running.engine.core.gpu
        assert [i.service for i in pool.resident] == ["judge"]
        path = tmp_path / "judge-v2.pt"
        weights(str(path), 5)
        edited = replace(judge, spec=judge.spec.model_copy(update={"weights": str(path)}))
        running.engine.reloader = lambda _text: PoolConfig(services={"judge": edited})
        answer = httpx.post(
            f"{running.url}/v1/admin/reload",
            headers={"Authorization": f"Bearer {OPERATOR}"},
            timeout=30,
        )
        assert answer.status_code == 200
        # The worker reloads judge, so the scheduler no longer counts on a warm instance
        # (its estimate of the next call includes the restore).
        assert list(pool.resident) == []
        assert _eventually(lambda: client.score("judge", INPUTS).output == _expected(5))


def test_a_reload_of_unchanged_documents_loads_a_weights_file_renamed_over(
    tmp_path: Path,
) -> None:
    """The RewardService is as it was; its weights file is new (written beside it and
    renamed over it, as gpu.md advises): SIGHUP, or a reload, loads it again."""
    judge = _service(tmp_path, "judge", 4, seed=0)
    with _serving(tmp_path, [judge]) as (running, client):
        assert client.score("judge", INPUTS).output == _expected(0)
        weights(str(tmp_path / "next.pt"), 5)
        (tmp_path / "next.pt").replace(tmp_path / "judge.pt")
        same = PoolConfig(services={"judge": judge})
        running.engine.reloader = lambda _text: same
        answer = httpx.post(
            f"{running.url}/v1/admin/reload",
            headers={"Authorization": f"Bearer {OPERATOR}"},
            timeout=30,
        )
        assert answer.status_code == 200
        assert _eventually(lambda: client.score("judge", INPUTS).output == _expected(5))


def test_a_restarted_scheduler_learns_what_the_worker_holds(tmp_path: Path) -> None:
    judge = _service(tmp_path, "judge", 4, seed=0)
    agent = NodeAgent.create(
        tmp_path / "agent", runtime="noop", cores_for_actions=1, gpus=GpuOptions.parse("cpu:1")
    )
    config = PoolConfig(services={"judge": judge})
    tokens = TokenStore({USER: "local", AGENT: AGENT_TENANT})
    with (
        service(config, agent, tmp_path, tokens=tokens, close_on_exit=False) as (running, _),
        Client(running.url, USER) as client,
    ):
        assert not client.score("judge", INPUTS).service.resident  # type: ignore[union-attr]
    with service(config, agent, tmp_path, tokens=tokens) as (running, _):
        pool = running.engine.core.gpu
        until(lambda: list(pool.resident) != [], "the worker's report of judge")
        (instance,) = pool.resident
        assert instance.service == "judge" and instance.chunk.gpus == range(1)
        # The restarted scheduler counts on it (no restore in its estimate): so does the worker.
        assert pool.warm_at("judge", 1) == 0.0
        with Client(running.url, USER) as client:
            assert client.score("judge", INPUTS).service.resident  # type: ignore[union-attr]


def _eventually(check: Callable[[], bool], timeout_s: float = 20) -> bool:
    """The agent loads reloaded services in the background: a call may race it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return True
        except TangramError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def httpx_get(client: Client, path: str) -> str:
    return httpx.get(client._async.url + path, timeout=10).text
