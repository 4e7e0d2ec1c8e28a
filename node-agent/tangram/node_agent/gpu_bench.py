"""``tangram bench gpu``: how close a restore gets to the host-to-device copy bandwidth.

In one run: the bandwidth of a plain copy of a pinned host buffer to the device (what the
hardware gives), and the bandwidth of the worker restoring a service of the same size
(skeleton on ``meta``, tensors copied from the pinned host copy, ``assign``), both as the
median of several repetitions; ``restore_fraction`` is their ratio (target ≥ 0.8). The
bench model is a stack of wide fp16 linear layers built in code: nothing is downloaded.
Without CUDA the same path runs on the CPU and the report says so.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tangram.api.wire import ServiceDef
from tangram.node_agent.gpu_worker import GIB, GpuWorker, Score, cuda_name

WIDTH = 4096  # one fp16 layer: 32 MiB


class _Wide(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.float16) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _echo(module: torch.nn.Module, inputs: list[Any]) -> list[Any]:
    return list(inputs)


def _timed(module: torch.nn.Module, inputs: list[Any]) -> list[Any]:
    """Modeled compute: each input is milliseconds of device time; the call sleeps their
    sum (leaving the CPU to restores and the scheduler) and answers, per input, a checksum
    of the weights it ran with, so a caller can tell which model was resident."""
    try:
        ms = sum(float(x) for x in inputs)
    except (TypeError, ValueError):
        raise ValueError("timed bench service: every input is a number of milliseconds") from None
    time.sleep(ms / 1000)
    return [_checksum(module.state_dict())] * len(inputs)


def _batched(module: torch.nn.Module, inputs: list[Any]) -> list[Any]:
    """Modeled compute as a GPU batches it: a pass of several calls costs its longest one
    (on an H200 a decode step over 16 rows costs what one over a single row does), so calls
    sharing a pass share its time. Inputs and answers as ``timed``."""
    try:
        ms = max((float(x) for x in inputs), default=0.0)
    except (TypeError, ValueError):
        raise ValueError("batched bench service: every input is a number of milliseconds") from None
    time.sleep(ms / 1000)
    return [_checksum(module.state_dict())] * len(inputs)


def _decode(module: torch.nn.Module, inputs: list[Any]) -> list[Any]:
    """Real compute, shaped like a generative model's decoding: each input is a number of
    steps, one row of the batch; the pass runs the stack once per step over every row still
    decoding (rows leave as they finish, as a decode loop's sequences do) and waits for the
    device. Calls sharing a pass share its steps: on a GPU a step over 16 rows costs about
    what one over a single row does (each step reads every weight once), which is what a
    deployment gains by batching. Answers the weights' checksum per input, as ``timed``."""
    try:
        steps = [int(x) for x in inputs]
    except (TypeError, ValueError):
        raise ValueError("decode bench service: every input is a number of steps") from None
    if any(n < 0 for n in steps):
        raise ValueError("decode bench service: a number of steps is never negative")
    weight = next(module.parameters())
    left = sorted(steps, reverse=True)  # row r decodes left[r] steps: the last rows leave first
    x = torch.full((len(steps), WIDTH), 1e-3, dtype=weight.dtype, device=weight.device)
    rows = len(left)
    for step in range(left[0] if left else 0):
        while left[rows - 1] <= step:
            rows -= 1
        x = module(x[:rows])
    if weight.device.type == "cuda":
        torch.cuda.synchronize(weight.device)
    return [_checksum(module.state_dict())] * len(inputs)


def step_seconds(layers: int, device: str, steps: int = 200) -> float:
    """Seconds of one ``decode`` step over one row of a ``layers``-deep stack on ``device``
    (median of 3 runs after a warm-up): what a call's ``--compute-ms`` becomes in steps."""
    module = _Wide(layers).to(device)
    runs = []
    with torch.inference_mode():
        _decode(module, [2])
        for _ in range(3):
            t0 = time.perf_counter()
            _decode(module, [steps])
            runs.append((time.perf_counter() - t0) / steps)
    del module
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return statistics.median(runs)


def _checksum(state: dict[str, torch.Tensor]) -> float:
    return float(state["layers.0.weight"][0, :8].float().sum())


_SCORES: dict[str, Score] = {
    "wide": _echo,
    "timed": _timed,
    "batched": _batched,
    "decode": _decode,
}


def __getattr__(name: str) -> Callable[[], tuple[torch.nn.Module, Score]]:
    """Entry points sized by their name (PEP 562): ``wide_<layers>`` (score echoes its
    inputs; ``tangram bench gpu``), ``timed_<layers>`` and ``batched_<layers>`` (modeled
    compute) and ``decode_<layers>`` (real compute; all three ``tangram bench gpu-pool``),
    each a stack of ``<layers>`` fp16 layers of 32 MiB."""
    kind, _, layers = name.partition("_")
    if kind not in _SCORES or not layers.isdigit() or int(layers) < 1:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    n, score = int(layers), _SCORES[kind]
    return lambda: (_Wide(n), score)


def entrypoint(kind: str, layers: int) -> str:
    return f"{__name__}:{kind}_{layers}"


def write_weights(path: Path, layers: int, seed: int = 0) -> tuple[int, float]:
    """The seeded weights of a ``layers``-deep bench model, in ``path``: their bytes, and
    the checksum a ``timed`` call of that model answers."""
    torch.manual_seed(seed)
    state = _Wide(layers).state_dict()
    torch.save(state, path)
    return layers * WIDTH * WIDTH * 2, _checksum(state)


def run(size_mb: int = 1024, repeats: int = 5) -> dict[str, Any]:
    layers = max(1, size_mb // 32)
    cuda = torch.cuda.is_available()
    name = cuda_name(0) if cuda else "cpu (no CUDA: the same path, on the CPU)"

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wide.pt"
        nbytes, _ = write_weights(weights, layers)
        capacity = nbytes * 2
        worker = GpuWorker({0: capacity})
        h2d = worker.h2d_gbps(0, nbytes, repeats)
        entry = entrypoint("wide", layers)
        worker.load(
            ServiceDef(
                name="wide", entrypoint=entry, weights=str(weights), gpu_memory_gb=capacity / GIB
            )
        )
        restores = []
        for _ in range(repeats):
            worker.evict_all()
            _, stats = worker.call("wide", [0], [])
            restores.append(stats.restore_s)
        worker.evict_all()
    restore = nbytes / statistics.median(restores) / 1e9
    return {
        "device": name,
        "bytes": nbytes,
        "h2d_gbps": round(h2d, 2),
        "restore_gbps": round(restore, 2),
        "restore_fraction": round(restore / h2d, 3),
        "restore_s_per_gb": round(statistics.median(restores) / (nbytes / 1e9), 4),
        "repeats": repeats,
    }


__all__ = ["entrypoint", "run", "step_seconds", "write_weights"]
