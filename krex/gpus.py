"""GPU discovery: real NVIDIA GPUs through NVML, or the simulated GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from krex.errors import NotFound, UsageError

DEVICES = ("auto", "gpu", "sim")


@dataclass
class GpuInfo:
    kind: str  # "nvidia" or "sim"
    count: int
    names: list[str] = field(default_factory=list)
    physical: list[int] = field(default_factory=list)  # NVML index of each visible GPU
    numa: list[int | None] = field(default_factory=list)
    note: str = ""


def _visible(total: int) -> list[int]:
    """CUDA_VISIBLE_DEVICES semantics: a list of indices, cut at the first invalid one."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(total))
    out: list[int] = []
    for tok in spec.split(","):
        tok = tok.strip()
        if not tok.isdigit() or int(tok) >= total:
            break
        out.append(int(tok))
    return out


def sim_gpu_count() -> int:
    raw = os.environ.get("KREX_SIM_GPUS", "1")
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise UsageError(f"KREX_SIM_GPUS={raw!r} is not a GPU count", "set KREX_SIM_GPUS to 1..16")
    return int(raw)


def _nvml() -> GpuInfo | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVML raises its own error types; any failure means "no GPU here"
        return None
    try:
        total = int(pynvml.nvmlDeviceGetCount())
        vis = _visible(total)
        names, numa = [], []
        for i in vis:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            n = pynvml.nvmlDeviceGetName(h)
            names.append(n.decode() if isinstance(n, bytes) else str(n))
            node: int | None = None
            try:
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = bus.decode() if isinstance(bus, bytes) else str(bus)
                with open(f"/sys/bus/pci/devices/{bus.lower()[-12:]}/numa_node") as f:
                    v = int(f.read().strip())
                    node = v if v >= 0 else None
            except (OSError, ValueError, pynvml.NVMLError):
                node = None
            numa.append(node)
        return GpuInfo("nvidia", len(vis), names, vis, numa)
    finally:
        pynvml.nvmlShutdown()


def discover(device: str = "auto") -> GpuInfo:
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", f"use one of: {', '.join(DEVICES)}")
    if device in ("auto", "gpu"):
        info = _nvml()
        if info and info.count:
            return info
        if device == "gpu":
            raise NotFound(
                "no NVIDIA GPU found (NVML unavailable or no visible device)",
                "install nvidia-ml-py and the driver, check CUDA_VISIBLE_DEVICES, or use --device sim",
            )
    n = sim_gpu_count()
    return GpuInfo(
        "sim",
        n,
        [f"simulated GPU {i}" for i in range(n)],
        list(range(n)),
        [None] * n,
        note="simulated GPU: proves logic, never performance",
    )
