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
from pathlib import Path
from typing import Any

import torch

from tangram.node_agent.gpu_worker import GpuWorker, ServiceDef

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


_LAYERS = {"n": 8}


def build() -> tuple[torch.nn.Module, Any]:
    """The bench service's entry point (``tangram.node_agent.gpu_bench:build``)."""
    return _Wide(_LAYERS["n"]), lambda module, inputs: list(inputs)


def run(size_mb: int = 1024, repeats: int = 5) -> dict[str, Any]:
    layers = max(1, size_mb // 32)
    _LAYERS["n"] = layers
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: the same path, on the CPU)"
    nbytes = layers * WIDTH * WIDTH * 2

    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if cuda else host
    copies = []
    for _ in range(repeats):
        _sync(cuda)
        t0 = time.perf_counter()
        on_device = host.to(device, non_blocking=True) if cuda else host.clone()
        _sync(cuda)
        copies.append(time.perf_counter() - t0)
        del on_device

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wide.pt"
        torch.manual_seed(0)
        torch.save(_Wide(layers).state_dict(), weights)
        capacity = nbytes * 2
        worker = GpuWorker({0: capacity})
        entry = f"{__name__}:build"
        worker.load(ServiceDef("wide", entry, str(weights), capacity))
        restores = []
        for _ in range(repeats):
            worker.evict_all()
            _, stats = worker.call("wide", [0], [])
            restores.append(stats.restore_s)
        worker.evict_all()
    h2d = nbytes / statistics.median(copies) / 1e9
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


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


__all__ = ["build", "run"]
