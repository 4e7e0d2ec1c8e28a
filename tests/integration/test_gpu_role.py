"""The agent's GPU role over the real PyTorch worker on CPU-backed devices (``--gpus
cpu:N``): what a call's outputs may be, and the threads calls run in. The scheduler is
left out: these are the calls it would place, made on the role as the agent makes them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests import GPU_EXTRA

torch = pytest.importorskip("torch", reason=GPU_EXTRA)
pytestmark = pytest.mark.torch

from tangram.api.wire import ServiceDef, ServiceOutcome  # noqa: E402
from tangram.node_agent.execution import ExecError  # noqa: E402
from tangram.node_agent.gpu_service import GpuOptions, GpuRole  # noqa: E402
from tangram.node_agent.gpu_worker import GpuWorker  # noqa: E402
from tests.fixtures import odd_reward  # noqa: E402
from tests.fixtures.tiny_reward import weights  # noqa: E402

from .service_harness import until  # noqa: E402

MB = 2**20
INPUTS = [[float(i + j) / 10 for j in range(16)] for i in range(4)]


def _spec(tmp: Path, name: str, entry: str = "tests.fixtures.tiny_reward:build") -> ServiceDef:
    path = tmp / f"{name}.pt"
    weights(str(path))
    return ServiceDef(name=name, entrypoint=entry, weights=str(path), gpu_memory_gb=4 / 1024)


def _on_role(devices: int, scenario: Callable[[GpuRole], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``scenario`` on a GPU role of ``devices`` CPU-backed devices, the gate closed;
    the gate opens and the role closes however it ends."""
    role = GpuRole.start(GpuOptions.parse(f"cpu:{devices}", 10))
    assert role is not None
    odd_reward.GATE.clear()
    try:
        return asyncio.run(scenario(role))
    finally:
        odd_reward.GATE.set()
        role.close()


async def _until(check: Callable[[], bool], what: str) -> None:
    for _ in range(3000):  # a guard only: a minute
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


def _queued(role: GpuRole, service: str, chunk: tuple[int, ...]) -> int:
    """Calls whose inputs wait for the next shared pass on the instance's first replica
    while a pass runs (-1 while none runs)."""
    worker = role.backend
    assert isinstance(worker, GpuWorker)
    resident = worker.instances.get((service, chunk))
    if resident is None or not resident.passes[0]._running:
        return -1
    return len(resident.passes[0]._queue)


def test_only_the_caller_whose_outputs_json_cannot_carry_fails(tmp_path: Path) -> None:
    """Three calls share a forward pass; the outputs of two of them are a NaN and an
    object. Those two fail, naming what and where; the third gets its outputs."""
    spec = _spec(tmp_path, "marked", "tests.fixtures.odd_reward:build_marked")

    async def scenario(role: GpuRole) -> tuple[list[Any], int]:
        await role.sync([spec])
        first = asyncio.create_task(role.call("marked", [0], ["a"]))  # its pass: at the gate
        await _until(lambda: _queued(role, "marked", (0,)) == 0, "the first pass never ran")
        rest = [asyncio.create_task(role.call("marked", [0], [x])) for x in ("bb", "nan", "object")]
        await _until(lambda: _queued(role, "marked", (0,)) == 3, "the others never joined")
        odd_reward.GATE.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        worker = role.backend
        assert isinstance(worker, GpuWorker)
        return results, worker.instances[("marked", (0,))].passes[0].passes

    (first, good, nan, obj), passes = _on_role(1, scenario)
    assert passes == 2  # the three later calls were scored in one pass
    assert isinstance(first, ServiceOutcome) and first.outputs == [1.0]
    assert isinstance(good, ServiceOutcome) and good.outputs == [2.0]
    assert isinstance(nan, ExecError)
    assert str(nan).startswith("service marked: score returned nan at outputs[0]: JSON has no NaN")
    assert isinstance(obj, ExecError)
    assert "score returned an object at outputs[0]: return plain numbers" in str(obj)


def test_a_tensor_returned_by_score_fails_the_call(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "tensor", "tests.fixtures.odd_reward:build_tensor")

    async def scenario(role: GpuRole) -> str:
        await role.sync([spec])
        with pytest.raises(ExecError) as e:
            await role.call("tensor", [0], INPUTS)
        return str(e.value)

    said = _on_role(1, scenario)
    assert said == (
        "service tensor: score returned a torch.Tensor at outputs[0]: "
        "return plain numbers, lists, dicts or strings (.tolist())"
    )


def test_a_call_on_a_free_gpu_runs_while_a_batch_holds_threads_on_another(
    tmp_path: Path,
) -> None:
    """Four calls share the instance on GPU 0, held at the gate: each holds a thread. The
    loop's default executor (Docker exec output and closes use it) is as small as on a
    small node, so a call run there would wait for the batch. A call on the free GPU 1 is
    answered while the batch still waits."""
    slow = _spec(tmp_path, "slow", "tests.fixtures.odd_reward:build_gated")
    fast = _spec(tmp_path, "fast")

    async def scenario(role: GpuRole) -> tuple[bool, ServiceOutcome, list[ServiceOutcome]]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        await role.sync([slow, fast])
        batch = [asyncio.create_task(role.call("slow", [0], INPUTS[:1])) for _ in range(4)]
        await _until(lambda: _queued(role, "slow", (0,)) >= 1, "no call joined the first")
        quick = asyncio.create_task(role.call("fast", [1], INPUTS))
        await asyncio.wait({quick}, timeout=30)  # a guard only: it is answered at once
        first = quick.done() and not any(t.done() for t in batch)
        odd_reward.GATE.set()
        return first, await quick, list(await asyncio.gather(*batch))

    answered_first, quick, batch = _on_role(2, scenario)
    assert answered_first  # while the batch on GPU 0 still waited at the gate
    assert len(quick.outputs) == len(INPUTS) and quick.stats.service == "fast"
    assert len(batch) == 4 and all(len(b.outputs) == 1 for b in batch)


def test_a_chunk_never_waits_for_replica_threads_a_batch_holds_elsewhere(
    tmp_path: Path,
) -> None:
    """A DoP-2 call drives its second replica in a pool thread. 33 calls (more than the
    pool once had threads for four devices) share the DoP-2 instance on GPUs 0-1, held at
    the gate; a DoP-2 call on the free GPUs 2-3 still runs to its end meanwhile."""
    slow = _spec(tmp_path, "slow", "tests.fixtures.odd_reward:build_gated")
    fast = _spec(tmp_path, "fast")
    worker = GpuWorker({d: 10 * MB for d in range(4)}, cpu=True)  # four, wherever it runs
    worker.load(slow)
    worker.load(fast)
    odd_reward.GATE.clear()
    calls = 8 * 4 + 1
    got: list[Any] = []
    batch = [
        threading.Thread(target=lambda: got.append(worker.call("slow", [0, 1], INPUTS[:2])))
        for _ in range(calls)
    ]
    try:
        for t in batch:
            t.start()

        def queued() -> int:
            resident = worker.instances.get(("slow", (0, 1)))
            return len(resident.passes[0]._queue) if resident is not None else -1

        until(lambda: queued() == calls - 1, "the calls never joined the instance", 60)
        quick: list[Any] = []
        other = threading.Thread(target=lambda: quick.append(worker.call("fast", [2, 3], INPUTS)))
        other.start()
        other.join(30)  # a guard only: it runs at once
        assert quick and not got  # done while the batch on GPUs 0-1 still waits
    finally:
        odd_reward.GATE.set()
        for t in batch:
            t.join(60)
        worker.close()
    outputs, stats = quick[0]
    assert len(outputs) == len(INPUTS) and not stats.hit
    assert len(got) == calls


def test_a_failed_call_leaves_its_instance_resident_as_the_scheduler_counts_it(
    tmp_path: Path,
) -> None:
    """The scheduler counts the instance of a failed call that restored it as not resident
    (the restore may be what failed); the worker drops it too. A failed call on an instance
    that was resident leaves it resident, on both sides."""
    worker = GpuWorker({0: 10 * MB})
    worker.load(_spec(tmp_path, "f", "tests.fixtures.odd_reward:build_failing"))
    with pytest.raises(ValueError, match="bad input"):
        worker.call("f", [0], ["bad"])
    assert worker.resident_instances() == []
    _, stats = worker.call("f", [0], INPUTS)
    assert not stats.hit
    with pytest.raises(ValueError, match="bad input"):
        worker.call("f", [0], ["bad"])
    assert worker.resident_instances() == [("f", [0])]
    _, stats = worker.call("f", [0], INPUTS)
    assert stats.hit
