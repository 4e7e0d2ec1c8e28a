"""``--gpus``: what the agent serves RewardService calls on, and the errors that name a
bad value."""

from __future__ import annotations

import pytest

from tangram.node_agent.execution import ExecError
from tangram.node_agent.gpu_service import GpuOptions, GpuRole
from tests import GPU_EXTRA


@pytest.mark.parametrize(
    ("text", "mode", "devices"),
    [
        ("auto", "auto", ()),
        ("none", "none", ()),
        ("cpu:4", "cpu:4", ()),
        ("cuda:0", "cuda", (0,)),
        ("cuda:3,1", "cuda", (3, 1)),
    ],
)
def test_gpus_values(text: str, mode: str, devices: tuple[int, ...]) -> None:
    options = GpuOptions.parse(text, 512)
    assert (options.mode, options.devices, options.memory_mib) == (mode, devices, 512)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("cpu:3", "cpu:N with N in 1, 2, 4, 8"),
        ("cuda:", "device indexes"),
        ("cuda:0,x", "device indexes"),
        ("cuda:1,1", "names a device twice"),
        ("cuda:\u00b2", "device indexes"),  # a digit to str.isdigit, not to int()
        ("cpu:\u00b2", "cpu:N with N in 1, 2, 4, 8"),
        ("gpu0", "is not auto, none"),
    ],
)
def test_bad_gpus_values_are_named(text: str, why: str) -> None:
    with pytest.raises(ExecError, match="--gpus") as e:
        GpuOptions.parse(text)
    assert why in str(e.value) and repr(text) in str(e.value)


@pytest.mark.torch
def test_a_cuda_device_that_is_not_there_stops_the_role_naming_it() -> None:
    torch = pytest.importorskip("torch", reason=GPU_EXTRA)
    absent = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ExecError, match=rf"no CUDA device \[{absent}\]"):
        GpuRole.start(GpuOptions.parse(f"cuda:{absent}"))


@pytest.mark.gpu
@pytest.mark.torch
def test_more_gpu_memory_than_the_device_has_is_refused_naming_the_flag() -> None:
    torch = pytest.importorskip("torch", reason=GPU_EXTRA)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    total = torch.cuda.get_device_properties(0).total_memory // 2**20
    with pytest.raises(ExecError, match=rf"--gpu-memory-mib {total}: more than the \d+ MiB"):
        GpuRole.start(GpuOptions.parse("cuda:0", total))
