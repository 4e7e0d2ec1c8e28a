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
from pathlib import Path
from typing import Any

import torch

from tangram.api.wire import ServiceDef
from tangram.node_agent.gpu_worker import GIB, GpuWorker

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
    name = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: the same path, on the CPU)"
    nbytes = layers * WIDTH * WIDTH * 2

    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wide.pt"
        torch.manual_seed(0)
        torch.save(_Wide(layers).state_dict(), weights)
        capacity = nbytes * 2
        worker = GpuWorker({0: capacity})
        h2d = worker.h2d_gbps(0, nbytes, repeats)
        entry = f"{__name__}:build"
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


__all__ = ["build", "run"]
