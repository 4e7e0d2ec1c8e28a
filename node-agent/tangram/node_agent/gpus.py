"""GPU inventory through NVML (``nvidia-ml-py``); the only module that imports ``pynvml``."""

from __future__ import annotations

from tangram.api.inventory import GpuInfo


def nvml_gpus() -> list[GpuInfo]:
    """The node's GPUs, or an empty list where NVML (the driver or the package) is absent."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(
                GpuInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    memory_gb=float(memory.total) / 1024**3,
                    healthy=_healthy(pynvml, handle),
                )
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def _healthy(pynvml: object, handle: object) -> bool:
    """A GPU that answers a utilization query (a lost or wedged GPU raises)."""
    try:
        pynvml.nvmlDeviceGetUtilizationRates(handle)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True
