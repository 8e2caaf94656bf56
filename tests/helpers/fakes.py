"""Fake vendor bindings for discovery tests (the call shapes of the real ones)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

FAKE_AMDSMI = '''
"""A fake amdsmi (the real call shapes: handles, dicts, BDF strings)."""
import os

class AmdSmiException(Exception):
    pass

_GPUS = [  # listed in a different order than HIP numbers them
    {"bdf": "0000:c1:00.0", "hip_id": 1, "market_name": "AMD Instinct MI300X (b)"},
    {"bdf": "0000:05:00.0", "hip_id": 0, "market_name": "AMD Instinct MI300X (a)"},
]
_STATE = {"init": 0, "shut": 0}

def amdsmi_init(flags=None):
    if os.environ.get("FAKE_AMDSMI_FAIL"):
        raise AmdSmiException("AMDSMI_STATUS_DRIVER_NOT_LOADED")
    _STATE["init"] += 1

def amdsmi_shut_down():
    _STATE["shut"] += 1

def amdsmi_get_processor_handles():
    return [f"h{i}" for i in range(len(_GPUS))]

def _g(h):
    return _GPUS[int(h[1:])]

def amdsmi_get_gpu_device_bdf(h):
    return _g(h)["bdf"]

def amdsmi_get_gpu_enumeration_info(h):
    if os.environ.get("FAKE_AMDSMI_OLD"):
        raise AttributeError("amdsmi_get_gpu_enumeration_info")  # amdsmi before ROCm 6.3
    return {"drm_render": 128, "drm_card": 0, "hsa_id": 0, "hip_id": _g(h)["hip_id"], "hip_uuid": "x"}

def amdsmi_get_gpu_asic_info(h):
    return {"market_name": _g(h)["market_name"], "vendor_id": "0x1002"}
'''


def write_fake_amd_node(d: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes a process see a ROCm node with two GPUs
    and no NVIDIA bindings; `d/kfd` stands in for the AMD driver's node (point
    KREX_GPU_DEVICE_NODES at it: AMD bindings are asked only where it exists)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "kfd").write_text("")
    (d / "amdsmi.py").write_text(FAKE_AMDSMI)
    (d / "pynvml.py").write_text("raise ImportError('no NVIDIA bindings on this fake node')\n")
    (d / "cuda").mkdir(exist_ok=True)
    (d / "cuda" / "__init__.py").write_text("raise ImportError('no cuda-python on this fake node')\n")
    return d


# torch/_inductor/runtime/benchmarking.py's hook, as upstream: set_gpu_benchmark_lock_context,
# maybe_gpu_benchmark_lock and the gpu_benchmark_lock decorator of its benchmark methods.
# Tests append their Benchmarker classes (tests/unit/test_harnesses.py,
# tests/integration/test_autotune_regions.py).
FAKE_INDUCTOR_HOOK = """import contextlib
from functools import wraps

_gpu_benchmark_lock_context = None

def set_gpu_benchmark_lock_context(context_factory):
    global _gpu_benchmark_lock_context
    previous = _gpu_benchmark_lock_context
    _gpu_benchmark_lock_context = context_factory
    return previous

@contextlib.contextmanager
def maybe_gpu_benchmark_lock():
    context_factory = _gpu_benchmark_lock_context
    if context_factory is None:
        yield
        return
    with context_factory():
        yield

def gpu_benchmark_lock(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        with maybe_gpu_benchmark_lock():
            return fn(*args, **kwargs)
    return wrapper
"""


def fake_module(name: str, **attrs: Any) -> types.ModuleType:
    """A module named `name` holding `attrs`, to put in sys.modules."""
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def fake_cuda_driver(names: list[str], init_err: int = 0) -> types.ModuleType:
    """cuda.bindings.driver: every call returns (CUresult, values...)."""

    class CUresult(int):
        CUDA_SUCCESS: Any = None

    CUresult.CUDA_SUCCESS = CUresult(0)

    def cuInit(flags: int) -> tuple[Any]:
        return (CUresult(init_err),)

    def cuDeviceGetCount() -> tuple[Any, int]:
        return CUresult(0), len(names)

    def cuDeviceGet(i: int) -> tuple[Any, int]:
        return CUresult(0), 100 + i

    def cuDeviceGetName(n: int, dev: int) -> tuple[Any, bytes]:
        return CUresult(0), names[dev - 100].encode().ljust(n, b"\0")

    def cuDeviceGetPCIBusId(n: int, dev: int) -> tuple[Any, bytes]:
        return CUresult(0), b"0000:3b:00.0\0"

    return fake_module(
        "cuda.bindings.driver",
        CUresult=CUresult,
        cuInit=cuInit,
        cuDeviceGetCount=cuDeviceGetCount,
        cuDeviceGet=cuDeviceGet,
        cuDeviceGetName=cuDeviceGetName,
        cuDeviceGetPCIBusId=cuDeviceGetPCIBusId,
    )
