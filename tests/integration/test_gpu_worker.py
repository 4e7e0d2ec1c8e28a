"""The GPU worker: load once, restore, evict, LRU, refusal, DoP split, with a tiny model
built in code. Where CUDA is there (a lent GPU machine, tests/gpu-device.sh) every test runs
on it, the worker's logical devices sharing the GPUs there are; elsewhere on the CPU, the
same code paths. The tests that need CUDA itself are marked ``gpu``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests import GPU_EXTRA, TANGRAM_CLI

torch = pytest.importorskip("torch", reason=GPU_EXTRA)
pytestmark = pytest.mark.torch

from tangram.api.wire import ServiceDef  # noqa: E402
from tangram.node_agent.gpu_residency import BusyError, NeverFitsError  # noqa: E402
from tangram.node_agent.gpu_worker import GpuWorker, ServiceError, read_weights  # noqa: E402
from tests.fixtures.tiny_reward import score, weights  # noqa: E402

from .service_harness import until  # noqa: E402

ENTRY = "tests.fixtures.tiny_reward:build"
MB = 2**20
INPUTS = [[float(i + j) / 10 for j in range(16)] for i in range(6)]


def _def(
    name: str,
    weights_path: str,
    mb: float,
    *,
    entry: str = ENTRY,
    replicated: bool = True,
    max_batch: int = 16,
) -> ServiceDef:
    return ServiceDef(
        name=name,
        entrypoint=entry,
        weights=weights_path,
        gpu_memory_gb=mb / 1024,
        replicated=replicated,
        max_batch=max_batch,
    )


def _spec(tmp: Path, name: str, seed: int = 0, mb: int = 4, max_batch: int = 16) -> ServiceDef:
    path = tmp / f"{name}.pt"
    weights(str(path), seed)
    return _def(name, str(path), mb, max_batch=max_batch)


def _on_this_machine(capacity: dict[int, int]) -> GpuWorker:
    """A worker on CUDA where there is any (logical device ``i`` on GPU ``i mod count``: the
    tests' two devices fit one GPU, capacity being the worker's own count), else the CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        return GpuWorker(capacity)
    return GpuWorker(capacity, device=lambda i: torch.device("cuda", i % gpus))


def _worker(devices: int = 2, mb: int = 10) -> GpuWorker:
    return _on_this_machine({d: mb * MB for d in range(devices)})


def test_load_once_restore_then_hit(tmp_path: Path) -> None:
    w = _worker()
    spec = _spec(tmp_path, "judge")
    w.load(spec)
    # (Its files unchanged: a weights file written again would be loaded again.)
    assert w.load(spec) == 0.0 and w.loads == 1
    first, stats = w.call("judge", [0], INPUTS)
    assert not stats.hit and stats.restored_bytes > 0 and len(first) == len(INPUTS)
    again, stats = w.call("judge", [0], INPUTS)
    assert stats.hit and stats.restore_s == 0.0 and again == first
    assert w.resident_instances() == [("judge", [0])]


def test_outputs_are_bit_exact_across_eviction_and_dop(tmp_path: Path) -> None:
    w = _worker(devices=2, mb=5)
    for name, seed in (("a", 0), ("b", 1)):
        w.load(_spec(tmp_path, name, seed))
    before, _ = w.call("a", [0], INPUTS)
    w.call("b", [0], INPUTS)  # 4 + 4 MB > 5 MB: a is evicted from device 0
    assert w.resident_instances() == [("b", [0])] and w.evictions == 1
    after, stats = w.call("a", [0], INPUTS)
    assert not stats.hit and stats.evicted == ["b@0"]
    assert after == before  # restored from the host copy: identical weights, identical scores
    split, stats = w.call("a", [0, 1], INPUTS)  # DoP 2: half the batch on each replica
    # Another batch shape takes other kernels: equal up to float rounding, not bitwise.
    assert split == pytest.approx(before, rel=1e-5) and ("a", [0, 1]) in w.resident_instances()


def test_the_weights_file_is_read_once_and_may_change_after(tmp_path: Path) -> None:
    w = _worker(devices=1, mb=5)
    spec = _spec(tmp_path, "a")
    w.load(spec)
    w.load(_spec(tmp_path, "b", seed=1))
    before, _ = w.call("a", [0], INPUTS)
    weights(spec.weights, seed=7)  # rewritten in place: a mapped file would now read these
    w.call("b", [0], INPUTS)  # evicts a: its next call restores from the host copy
    Path(spec.weights).unlink()
    after, stats = w.call("a", [0], INPUTS)
    assert not stats.hit and after == before and w.loads == 2


def _module(path: Path, body: str) -> None:
    """An entry point module whose score gives every input ``body``'s value."""
    path.write_text(f"from tests.fixtures.tiny_reward import TinyReward\n\n{body}\n")


def test_a_load_after_an_edit_of_the_entry_point_module_runs_the_new_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """importlib.import_module returns the module as first imported: a function added
    to it since was missing, and a changed one ran as before, until the agent restarted."""
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "edited_entry.py"
    _module(source, "def build():\n    return TinyReward(), lambda m, xs: [1.0] * len(xs)\n")
    w = _worker(devices=1)
    spec = _def("e", _spec(tmp_path, "base").weights, 4, entry="edited_entry:build")
    w.load(spec)
    assert w.call("e", [0], INPUTS[:2])[0] == [1.0, 1.0]
    w.unload("e")
    _module(source, "def build2():\n    return TinyReward(), lambda m, xs: [2.0] * len(xs)\n")
    w.load(spec.model_copy(update={"entrypoint": "edited_entry:build2"}))  # a new function
    assert w.call("e", [0], INPUTS[:2])[0] == [2.0, 2.0]
    # Its body changed, and its size kept: only the file's time and inode tell.
    _module(source, "def build2():\n    return TinyReward(), lambda m, xs: [3.0] * len(xs)\n")
    w.unload("e")
    w.load(spec.model_copy(update={"entrypoint": "edited_entry:build2", "max_batch": 5}))
    assert w.call("e", [0], INPUTS[:2])[0] == [3.0, 3.0]


def test_an_edited_package_entry_point_keeps_its_submodules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package imported afresh ran its ``import pkg.sub`` with pkg.sub already imported,
    which binds nothing: the new package had no ``sub``, its build loaded, and every call
    failed (AttributeError)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    package = tmp_path / "edited_pkg"
    package.mkdir()
    (package / "sub.py").write_text("VALUE = 1.0\n")

    def init(value: float) -> None:
        (package / "__init__.py").write_text(
            "import edited_pkg.sub\nfrom tests.fixtures.tiny_reward import TinyReward\n\n"
            "def build():\n    return TinyReward(), "
            f"lambda m, xs: [edited_pkg.sub.VALUE + {value}] * len(xs)\n"
        )

    init(0.0)
    w = _worker(devices=1)
    spec = _def("p", _spec(tmp_path, "base").weights, 4, entry="edited_pkg:build")
    w.load(spec)
    assert w.call("p", [0], INPUTS[:2])[0] == [1.0, 1.0]
    w.unload("p")
    init(1.0)
    w.load(spec.model_copy(update={"max_batch": 5}))
    assert w.call("p", [0], INPUTS[:2])[0] == [2.0, 2.0]


def test_a_service_whose_files_changed_is_loaded_again_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its definition unchanged: a new weights file renamed over the old one (as gpu.md
    advises), or an edit of its entry point module, is loaded again at the next sync."""
    monkeypatch.syspath_prepend(str(tmp_path))
    w = _worker(devices=1)
    spec = _spec(tmp_path, "a")
    w.load(spec)
    before, _ = w.call("a", [0], INPUTS)
    assert w.load(spec) == 0.0 and w.loads == 1  # nothing changed: not read again
    weights(str(tmp_path / "next.pt"), seed=5)
    Path(tmp_path / "next.pt").replace(spec.weights)
    assert w.load(spec) > 0.0 and w.loads == 2
    after, stats = w.call("a", [0], INPUTS)
    assert not stats.hit and after != before  # the resident instance had the old weights
    Path(tmp_path / "bad.pt").write_text("not a torch file")
    Path(tmp_path / "bad.pt").replace(spec.weights)
    with pytest.raises(ServiceError, match="weights"):
        w.load(spec)
    assert w.call("a", [0], INPUTS)[0] == after  # the one loaded serves on
    source = tmp_path / "entry_in_place.py"
    _module(source, "def build():\n    return TinyReward(), lambda m, xs: [1.0] * len(xs)\n")
    weights(str(tmp_path / "b.pt"))
    entry = _def("b", str(tmp_path / "b.pt"), 4, entry="entry_in_place:build")
    w.load(entry)
    assert w.call("b", [0], INPUTS[:1])[0] == [1.0]
    _module(source, "def build():\n    return TinyReward(), lambda m, xs: [4.0] * len(xs)\n")
    assert w.load(entry) > 0.0
    assert w.call("b", [0], INPUTS[:1])[0] == [4.0]


def test_weights_are_mapped_from_the_file_not_read_into_a_first_copy(tmp_path: Path) -> None:
    path = _spec(tmp_path, "a").weights

    def mapped() -> bool:
        return path in Path("/proc/self/maps").read_text()

    state = read_weights(path)
    assert mapped() and set(state) == {"embed.weight", "embed.bias", "head.weight", "head.bias"}


def test_weights_saved_in_the_legacy_format_load(tmp_path: Path) -> None:
    state = torch.load(_spec(tmp_path, "zip").weights, weights_only=True)
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    w = _worker(devices=1)
    w.load(_spec(tmp_path, "zip"))
    w.load(_def("legacy", str(tmp_path / "legacy.pt"), 4))
    assert w.call("legacy", [0], INPUTS)[0] == w.call("zip", [0], INPUTS)[0]


def test_buffers_the_module_computes_itself_are_restored(tmp_path: Path) -> None:
    from tests.fixtures.tiny_reward import RotaryReward

    path = tmp_path / "rotary.pt"
    weights(str(path), seed=3)  # RotaryReward's state dict is TinyReward's
    w = _worker(devices=2)
    model = RotaryReward()
    model.load_state_dict(torch.load(path, weights_only=True))
    with torch.inference_mode():  # on the worker's device: a GPU's sums differ from a CPU's
        want = score(model.to(w.device(0)), INPUTS)
    w.load(_def("rotary", str(path), 4, entry="tests.fixtures.tiny_reward:build_rotary"))
    got, _ = w.call("rotary", [0], INPUTS)
    w.evict_all()
    again, stats = w.call("rotary", [1], INPUTS)
    assert got == want and again == want and not stats.hit
    with pytest.raises(ServiceError, match=r"buffers \['mask'\] are on the meta device"):
        w.load(_def("meta", str(path), 4, entry="tests.fixtures.tiny_reward:build_meta_buffer"))


def test_least_recently_used_goes_first(tmp_path: Path) -> None:
    w = _worker(devices=1, mb=9)
    for name in ("a", "b", "c"):
        w.load(_spec(tmp_path, name, mb=3))
    for name in ("a", "b", "c", "b", "a"):
        w.call(name, [0], INPUTS[:1])
    w.load(_spec(tmp_path, "d", mb=3))
    _, stats = w.call("d", [0], INPUTS[:1])
    assert stats.evicted == ["c@0"]  # b was used after c; a after both


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    w = _on_this_machine({0: 3 * MB, 1: 5 * MB})
    big = _spec(tmp_path, "big", mb=4)
    with pytest.raises(ServiceError, match=r"gpuMemoryGiB 0.0078125 is more than any GPU here"):
        w.load(_def("huge", big.weights, 8))  # refused before it is read: no host copy
    assert "huge" not in w.services
    w.load(big)  # fits GPU 1, not GPU 0
    with pytest.raises(NeverFitsError, match=r"needs 4\.0 MiB per GPU; a GPU here has 3\.0 MiB"):
        w.call("big", [0], INPUTS)
    assert w.call("big", [1], INPUTS)[0]
    with pytest.raises(ServiceError, match="unknown service"):
        w.call("nope", [0], INPUTS)
    with pytest.raises(ServiceError, match="entrypoint"):
        w.load(_def("bad", big.weights, 1, entry="tests.fixtures.tiny_reward:missing"))
    with pytest.raises(ServiceError, match="weights"):
        w.load(_def("gone", str(tmp_path / "none.pt"), 1))
    with pytest.raises(ServiceError, match="more than gpuMemoryGiB"):
        w.load(_def("tight", big.weights, 0.0001))
    extra = torch.load(big.weights, weights_only=True)
    extra["spare.weight"] = torch.zeros(2)
    torch.save(extra, tmp_path / "extra.pt")  # a restore would refuse the unknown key
    with pytest.raises(ServiceError, match=r"unexpected \['spare.weight'\]"):
        w.load(_def("extra", str(tmp_path / "extra.pt"), 1))
    assert "extra" not in w.services
    with pytest.raises(ServiceError, match="external inference server"):
        w.load(_def("sharded", big.weights, 1, replicated=False))


@pytest.mark.parametrize(
    ("entry", "says"),
    [  # (the agent's error names the service: the worker's does not name it again)
        ("build_dict_of_one", "score returned a dict, not a list with one output per input"),
        ("build_dict_per_input", "score returned a dict, not a list with one output per input"),
        ("build_generator", "score returned a generator, not a list with one output per input"),
    ],
)
def test_a_score_that_returns_no_list_is_named_for_what_it_returned(
    tmp_path: Path, entry: str, says: str
) -> None:
    w = _worker(devices=1)
    base = _spec(tmp_path, "base")
    w.load(_def("odd", base.weights, 4, entry=f"tests.fixtures.odd_reward:{entry}"))
    with pytest.raises(ServiceError) as e:
        w.call("odd", [0], INPUTS[:2])
    assert str(e.value) == says


def test_a_build_that_raises_is_refused_with_its_exception_type(tmp_path: Path) -> None:
    w = _worker(devices=1)
    base = _spec(tmp_path, "base")
    entry = "tests.fixtures.odd_reward:build_raising"
    with pytest.raises(ServiceError) as e:
        w.load(_def("raises", base.weights, 4, entry=entry))
    assert str(e.value) == f"raises: {entry} raised RuntimeError: build exploded"


@pytest.mark.parametrize("restore", ["call", "ahead"])
def test_a_running_instance_is_never_evicted(tmp_path: Path, restore: str) -> None:
    """Neither a call's restore nor a restore ahead evicts an instance whose call runs."""
    w = _worker(devices=1, mb=5)
    for name in ("a", "b"):
        w.load(_spec(tmp_path, name))

    def restore_b() -> Any:
        return w.call("b", [0], INPUTS)[1] if restore == "call" else w.restore_ahead("b", [0])

    w.call("a", [0], INPUTS)
    w.residency.acquire(("a", (0,)))  # as if a call on a were still running
    with pytest.raises(BusyError):
        restore_b()
    w.residency.release(("a", (0,)))
    assert restore_b().evicted == ["a@0"]
    assert w.resident_instances() == [("b", [0])]


def test_batches_are_split_over_replicas_and_capped(tmp_path: Path) -> None:
    w = _worker(devices=2)
    w.load(_spec(tmp_path, "a", max_batch=2))
    sizes: list[int] = []
    score = w.services["a"].score

    def counted(module: Any, batch: list[object]) -> list[object]:
        sizes.append(len(batch))
        return score(module, batch)

    w.services["a"].score = counted
    out, _ = w.call("a", [0, 1], INPUTS)  # 3 inputs per replica, 2 per forward pass
    assert sorted(sizes) == [1, 1, 2, 2]  # the two replicas run at once
    alone, _ = w.call("a", [0], INPUTS)
    assert out == pytest.approx(alone, rel=1e-5)  # in the order of the inputs


def test_a_call_waits_for_a_call_still_running_on_its_gpu(tmp_path: Path) -> None:
    """As after a reconnect: the scheduler no longer knows of a call that still runs."""
    w = _worker(devices=2)
    w.load(_spec(tmp_path, "a"))
    score, gate, spans = w.services["a"].score, threading.Event(), []

    def gated(module: Any, batch: list[object]) -> list[object]:
        started, which = time.monotonic(), threading.current_thread().name
        if which == "first":
            gate.wait()
        out = score(module, batch)
        spans.append(("first" if which == "first" else "second", started, time.monotonic()))
        return out

    w.services["a"].score = gated
    failed: list[BaseException] = []

    def call(chunk: list[int], inputs: list[Any]) -> None:
        try:
            w.call("a", chunk, inputs)
        except BaseException as e:
            failed.append(e)

    first = threading.Thread(target=call, args=([0], INPUTS[:1]), name="first", daemon=True)
    second = threading.Thread(target=call, args=([0, 1], INPUTS[:2]), daemon=True)
    try:
        first.start()
        until(lambda: 0 in w._running, "the first call on GPU 0")
        second.start()
        second.join(0.3)
        assert second.is_alive() and spans == []  # waiting: not failing, not sharing GPU 0
    finally:
        gate.set()
        first.join(30)
        second.join(30)
    assert failed == []
    (_, _, first_end), *seconds = sorted(spans, key=lambda s: s[0])
    assert [s[0] for s in seconds] == ["second", "second"]
    assert all(start >= first_end for _, start, _ in seconds)


@pytest.mark.gpu
def test_restore_and_evict_on_a_real_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    free, _total = torch.cuda.mem_get_info(0)
    w = GpuWorker({0: free // 2})
    w.load(_spec(tmp_path, "a", 0))
    w.load(_spec(tmp_path, "b", 1))
    on_gpu, stats = w.call("a", [0], INPUTS)
    assert not stats.hit and next(iter(w.instances[("a", (0,))].replicas[0].parameters())).is_cuda
    w.evict_all()
    assert ("a", (0,)) not in w.instances
    again, _ = w.call("a", [0], INPUTS)
    assert again == on_gpu


def test_bench_gpu_prints_the_design_shape() -> None:
    import json
    import subprocess

    done = subprocess.run(
        [*TANGRAM_CLI, "bench", "gpu", "--json", "--size-mb", "32"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    assert {"device", "h2d_gbps", "restore_gbps", "restore_fraction"} <= set(report)
    assert report["bytes"] == 32 * 2**20 and report["restore_gbps"] > 0


def test_the_decode_bench_model_runs_each_row_its_steps_and_refuses_other_inputs() -> None:
    from tangram.node_agent import gpu_bench

    module = gpu_bench._Wide(1).to("cuda:0" if torch.cuda.is_available() else "cpu")
    rows: list[int] = []
    module.layers[0].register_forward_hook(lambda _m, args, _out: rows.append(len(args[0])))
    with torch.inference_mode():
        out = gpu_bench._decode(module, [3, 0, 5, 1])
        # Rows leave as their steps run out: all three decoding rows, then the 3 and the 5,
        # then the 5 alone; a call of 0 steps is answered without a pass.
        assert rows == [3, 2, 2, 1, 1]
        check = gpu_bench._checksum(module.state_dict())
        assert out == [check] * 4
        rows.clear()
        assert gpu_bench._decode(module, [0]) == [check] and rows == []
        assert gpu_bench._decode(module, []) == []
        for bad in (["many"], [-1], [None]):
            with pytest.raises(ValueError, match="number of steps"):
                gpu_bench._decode(module, bad)


def test_calls_of_one_instance_run_together_and_another_instance_waits(tmp_path: Path) -> None:
    """Calls on a resident instance share it (the scheduler's batching); a call of another
    service on the same GPU waits until the last of them has ended."""
    w = _worker(devices=1)
    for name in ("a", "b"):
        w.load(_spec(tmp_path, name))
    w.call("a", [0], INPUTS[:1])  # resident
    score, gate, started = w.services["a"].score, threading.Event(), threading.Event()
    passes: list[int] = []

    def gated(module: Any, batch: list[object]) -> list[object]:
        if not passes:
            started.set()
            gate.wait(30)
        passes.append(len(batch))
        return score(module, batch)

    w.services["a"].score = gated
    done: dict[str, Any] = {}

    def call(label: str, service: str, inputs: list[Any]) -> None:
        done[label] = w.call(service, [0], inputs)

    threads = {
        "first": threading.Thread(target=call, args=("first", "a", INPUTS[:2]), daemon=True),
        "joiner": threading.Thread(target=call, args=("joiner", "a", INPUTS[2:5]), daemon=True),
        "other": threading.Thread(target=call, args=("other", "b", INPUTS[:1]), daemon=True),
    }
    try:
        threads["first"].start()
        assert started.wait(30)
        threads["joiner"].start()
        until(
            lambda: len(w.instances[("a", (0,))].passes[0]._queue) == 1, "the joiner never queued"
        )
        threads["other"].start()
        threads["other"].join(0.3)
        assert threads["other"].is_alive() and w._running == {0: ("a", (0,))}
    finally:
        gate.set()
        for t in threads.values():
            t.join(30)
    assert passes == [2, 3]  # the joiner's inputs went in one pass of their own
    alone, _ = w.call("a", [0], INPUTS[:5])
    assert done["first"][0] + done["joiner"][0] == pytest.approx(alone, rel=1e-5)
    assert done["joiner"][1].hit and done["joiner"][1].restore_s == 0
    assert done["other"][1].evicted == [] and not w._running


def _gate_restores(
    w: GpuWorker, only: str | None = None
) -> tuple[threading.Event, threading.Event]:
    """Hold the worker's restores (of service ``only``, or every one) until the first
    event is set; the second is set once one is held."""
    restore, gate, restoring = w._restore, threading.Event(), threading.Event()

    def gated(service: Any, index: int) -> Any:
        if only is None or service.spec.name == only:
            restoring.set()
            gate.wait(30)
        return restore(service, index)

    w._restore = gated  # type: ignore[method-assign]
    return gate, restoring


def test_a_call_that_joins_during_the_restore_waits_for_it(tmp_path: Path) -> None:
    """The scheduler lets a call join an instance whose first call is still restoring it:
    the worker runs it once the instance is resident, without a second restore."""
    w = _worker(devices=2)
    w.load(_spec(tmp_path, "a"))
    gate, restoring = _gate_restores(w)
    done: dict[str, Any] = {}

    def call(label: str, inputs: list[Any]) -> None:
        done[label] = w.call("a", [0, 1], inputs)

    first = threading.Thread(target=call, args=("first", INPUTS[:2]), daemon=True)
    joiner = threading.Thread(target=call, args=("joiner", INPUTS[2:]), daemon=True)
    try:
        first.start()
        assert restoring.wait(30)
        joiner.start()
        joiner.join(0.3)
        assert joiner.is_alive() and "joiner" not in done  # waiting: nothing to run on yet
    finally:
        gate.set()
        first.join(30)
        joiner.join(30)
    assert w.restores == 1 and done["joiner"][1].hit and done["joiner"][1].restore_s == 0
    alone, _ = w.call("a", [0, 1], INPUTS)
    assert done["first"][0] + done["joiner"][0] == pytest.approx(alone, rel=1e-5)


def test_a_restore_ahead_while_a_call_restores_finds_that_memory_taken(tmp_path: Path) -> None:
    """A call's restore takes its memory when it plans, as a restore ahead does: a restore
    ahead meanwhile cannot plan on it (two 6 MB instances on a 10 MB GPU)."""
    w = _worker(devices=1)
    for name in ("a", "b"):
        w.load(_spec(tmp_path, name, mb=6))
    gate, restoring = _gate_restores(w)
    done: dict[str, Any] = {}
    call = threading.Thread(target=lambda: done.update(a=w.call("a", [0], INPUTS)), daemon=True)
    try:
        call.start()
        assert restoring.wait(30)
        with pytest.raises(BusyError, match="held by running calls"):
            w.restore_ahead("b", [0])
    finally:
        gate.set()
        call.join(30)
    assert len(done["a"][0]) == len(INPUTS) and w.resident_instances() == [("a", [0])]
    assert w.residency.used(0) <= w.residency.capacity[0]


def test_a_calls_failed_restore_leaves_nothing_resident(tmp_path: Path) -> None:
    w = _worker(devices=1)
    w.load(_spec(tmp_path, "a"))
    restore = w._restore

    def broken(service: Any, index: int) -> Any:
        raise RuntimeError("copy failed")

    w._restore = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="copy failed"):
        w.call("a", [0], INPUTS)
    assert w.resident_instances() == [] and not w._running and not w._calls
    w._restore = restore  # type: ignore[method-assign]
    out, stats = w.call("a", [0], INPUTS)
    assert len(out) == len(INPUTS) and not stats.hit


def test_a_restore_ahead_makes_the_next_call_a_hit(tmp_path: Path) -> None:
    w = _worker(devices=2)
    w.load(_spec(tmp_path, "a"))
    stats = w.restore_ahead("a", [0, 1])
    assert not stats.hit and stats.restored_bytes > 0 and stats.restore_s > 0
    assert w.resident_instances() == [("a", [0, 1])] and not w._running
    out, call = w.call("a", [0, 1], INPUTS)
    assert call.hit and call.restore_s == 0 and w.restores == 1
    assert w.restore_ahead("a", [0, 1]).hit  # resident already: nothing to do
    w.evict_all()
    again, _ = w.call("a", [0, 1], INPUTS)
    assert again == out  # the same weights as a call's own restore


def test_a_restore_ahead_of_an_unknown_service_is_refused(tmp_path: Path) -> None:
    w = _worker(devices=1)
    with pytest.raises(ServiceError, match="unknown service"):
        w.restore_ahead("nope", [0])
    assert w.resident_instances() == [] and not w._ahead


def test_calls_of_other_instances_run_during_a_restore_ahead_and_its_own_wait(
    tmp_path: Path,
) -> None:
    """A restore ahead does not hold its devices: a call of another instance there runs
    meanwhile; a call of the instance itself waits for the copy, then is a hit."""
    w = _worker(devices=1)
    for name in ("a", "b"):
        w.load(_spec(tmp_path, name))
    gate, restoring = _gate_restores(w, only="b")
    done: dict[str, Any] = {}

    def run(label: str, work: Any) -> None:
        done[label] = work()

    ahead = threading.Thread(target=run, args=("ahead", lambda: w.restore_ahead("b", [0])))
    own = threading.Thread(target=run, args=("own", lambda: w.call("b", [0], INPUTS)))
    try:
        ahead.start()
        assert restoring.wait(30)
        other, stats = w.call("a", [0], INPUTS)  # runs now, beside the copy of b
        assert len(other) == len(INPUTS) and stats.evicted == []
        own.start()
        own.join(0.3)
        assert own.is_alive() and "own" not in done  # it waits for b's copy
    finally:
        gate.set()
        ahead.join(30)
        own.join(30)
    assert not done["ahead"].hit and done["own"][1].hit and w.restores == 2
    assert sorted(w.resident_instances()) == [("a", [0]), ("b", [0])]


def test_a_failed_restore_ahead_leaves_nothing_resident(tmp_path: Path) -> None:
    w = _worker(devices=1)
    w.load(_spec(tmp_path, "a"))

    def broken(service: Any, index: int) -> Any:
        raise RuntimeError("copy failed")

    w._restore = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="copy failed"):
        w.restore_ahead("a", [0])
    assert w.resident_instances() == [] and w.residency.used(0) == 0 and not w._ahead
