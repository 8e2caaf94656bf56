"""GPU discovery: real GPUs, or the simulated GPU.

NVIDIA: NVML (nvidia-ml-py, a dependency); where NVML is missing (containers
without the management library, or nvidia-ml-py not installed), the CUDA driver
through cuda-python (`krex-gpu[cuda]`). AMD: amdsmi (`krex-gpu[amd]`), else hip-python.
The first that finds a visible GPU wins, in that order. Each backend is one small
function over an imported module, so tests replace the module with a fake
(KREX_NVML_FAKE stands in for NVML in tests that start processes: krex/device/nvml.py).

AMD bindings are imported only where the AMD driver's node (/dev/kfd) exists: amdsmi prints
to stdout when it is imported on a machine without one. Whatever a vendor binding prints
while it is imported or asked goes to stderr (`_output_to_stderr`): a command's stdout
carries its results only (`eval "$(krex env --export)"`, `krex fleet --node-resources`).

`--device auto` falls back to the simulated GPU only where no GPU driver node exists
(`/dev/nvidiactl`, `/dev/kfd`): on a GPU machine a silent simulator would turn every
timing into fiction, so there discovery fails with the reasons instead (trust issue).
CUDA_VISIBLE_DEVICES is read as CUDA reads it: indices, GPU UUIDs (or unique
prefixes), MIG ids."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from krex.device import DEVICES
from krex.errors import NotFound, UsageError

log = logging.getLogger(__name__)


@dataclass
class GpuInfo:
    kind: str  # "nvidia", "amd" or "sim"
    count: int
    names: list[str] = field(default_factory=list)
    physical: list[int] = field(default_factory=list)  # index of each visible GPU (for *_VISIBLE_DEVICES)
    numa: list[int | None] = field(default_factory=list)
    note: str = ""
    api: str = ""  # what found them: nvml, cuda-python, amdsmi, hip-python, sim
    tried: list[str] = field(default_factory=list)  # "api: why not" for the backends that found nothing
    # What to put in a command's CUDA_VISIBLE_DEVICES for each GPU: the entry the user
    # gave (an index, a GPU UUID, a MIG id), so MIG and UUID selections survive.
    visible: list[str] = field(default_factory=list)

    def visible_token(self, gpu: int) -> str:
        return self.visible[gpu] if gpu < len(self.visible) else str(self.physical[gpu])

    @property
    def vendor(self) -> str:
        return {"nvidia": "NVIDIA", "amd": "AMD"}.get(self.kind, self.kind)


def _visible(total: int, spec: str | None) -> list[int]:
    """CUDA_VISIBLE_DEVICES semantics: a list of indices, cut at the first invalid one."""
    if spec is None:
        return list(range(total))
    out: list[int] = []
    for tok in spec.split(","):
        tok = tok.strip()
        if not tok.isdigit() or int(tok) >= total:
            break
        out.append(int(tok))
    return out


DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's driver control nodes


def gpu_device_nodes() -> list[str]:
    """The GPU driver nodes present on this machine (KREX_GPU_DEVICE_NODES, colon-separated,
    overrides the paths)."""
    raw = os.environ.get("KREX_GPU_DEVICE_NODES")
    paths = [p for p in raw.split(":") if p] if raw is not None else list(DEVICE_NODES)
    return [p for p in paths if os.path.exists(p)]


def amd_driver_present() -> bool:
    """Whether the AMD GPU driver's node (/dev/kfd, or a `kfd` among KREX_GPU_DEVICE_NODES) exists."""
    return any(os.path.basename(p) == "kfd" for p in gpu_device_nodes())


def parse_visible(spec: str | None, uuids: list[str], migs: dict[str, int]) -> list[tuple[int, str]]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: indices, GPU UUIDs (or unique prefixes of
    them), MIG ids (`MIG-<uuid>`, or the older `MIG-GPU-<uuid>/<gi>/<ci>`), cut at the
    first entry that names no device. Returns (physical index, the entry as given)."""
    total = len(uuids)
    if spec is None:
        return [(i, str(i)) for i in range(total)]
    out: list[tuple[int, str]] = []
    for tok in spec.split(","):
        tok = tok.strip()
        idx: int | None = None
        if tok.isdigit():
            idx = int(tok) if int(tok) < total else None
        elif tok.startswith("MIG-GPU-"):
            parent = tok[4:].split("/")[0]
            idx = uuids.index(parent) if parent in uuids else None
        elif tok.startswith("MIG-"):
            idx = migs.get(tok)
        elif tok.startswith("GPU-") and len(tok) > 4:
            hits = [i for i, u in enumerate(uuids) if u.startswith(tok)]
            idx = hits[0] if len(hits) == 1 else None
        if idx is None:
            break
        out.append((idx, tok))
    return out


def _cuda_visible(total: int) -> list[int]:
    return _visible(total, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _hip_visible(total: int) -> list[int]:
    # HIP reads HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES (indices after ROCR's filter).
    spec = os.environ.get("HIP_VISIBLE_DEVICES")
    return _visible(total, spec if spec is not None else os.environ.get("CUDA_VISIBLE_DEVICES"))


def sim_gpu_count() -> int:
    raw = os.environ.get("KREX_SIM_GPUS", "1")
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise UsageError(f"KREX_SIM_GPUS={raw!r} is not a GPU count", "set KREX_SIM_GPUS to 1..16")
    return int(raw)


def _numa_of_bus(bus: Any) -> int | None:
    """NUMA node of a PCI bus id such as 00000000:3B:00.0 or 0000:3b:00.0, from sysfs."""
    try:
        b = bus.decode() if isinstance(bus, bytes) else str(bus)
        b = b.strip("\0").strip().lower()
        with open(f"/sys/bus/pci/devices/{b[-12:]}/numa_node") as f:
            v = int(f.read().strip())
        return v if v >= 0 else None
    except (OSError, ValueError):
        return None


def _text(v: Any) -> str:
    return (v.decode(errors="replace") if isinstance(v, bytes) else str(v)).split("\0")[0].strip()


class _NoGpu(Exception):
    """A backend that is present but finds nothing (or fails): the reason, for doctor."""


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# ------------------------------------------------------------------------- backends


def _nvml() -> GpuInfo:
    from krex.device.nvml import FakeNvml, NvmlUnavailable, RealNvml, fake_path

    fake = fake_path()
    if fake is None and _import("pynvml") is None:
        raise ImportError("nvidia-ml-py is not installed")
    try:
        nv = FakeNvml(fake) if fake else RealNvml()
    except NvmlUnavailable as e:
        raise _NoGpu(f"NVML did not initialise ({e})") from None
    try:
        total = nv.count()
        spec = os.environ.get("CUDA_VISIBLE_DEVICES")
        if spec is None or all(t.strip().isdigit() for t in spec.split(",")):
            vis = [(i, str(i)) for i in _visible(total, spec)]
        else:  # UUIDs or MIG ids: ask NVML for them
            uuids = [nv.uuid(i) for i in range(total)]
            migs = {m: i for i in range(total) for m in nv.mig_uuids(i)}
            vis = parse_visible(spec, uuids, migs)
        names = [nv.name(i) for i, _t in vis]
        numa = [_numa_of_bus(nv.pci_bus(i)) if nv.pci_bus(i) else None for i, _t in vis]
        return GpuInfo(
            "nvidia", len(vis), names, [i for i, _t in vis], numa, api="nvml", visible=[t for _i, t in vis]
        )
    finally:
        nv.close()


def _cuda_driver_module() -> Any:
    drv = _import("cuda.bindings.driver")  # cuda-python >= 12.6
    if drv is None:
        old = _import("cuda.cuda")  # older cuda-python
        drv = old
    if drv is None:
        raise ImportError("cuda-python is not installed")
    return drv


def _cuda_python() -> GpuInfo:
    """The CUDA driver API through cuda-python: used where NVML is missing. The driver
    already applies CUDA_VISIBLE_DEVICES; the physical indices come from the variable."""
    drv = _cuda_driver_module()
    ok = drv.CUresult.CUDA_SUCCESS

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        res = fn(*args)
        err, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
        if err != ok:
            raise _NoGpu(f"{getattr(fn, '__name__', 'a CUDA call')} failed ({err})")
        return rest[0] if len(rest) == 1 else rest

    call(drv.cuInit, 0)
    n = int(call(drv.cuDeviceGetCount))
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    toks = [t.strip() for t in spec.split(",")] if spec is not None else []
    physical = [int(t) for t in toks[:n] if t.isdigit()] if spec is not None else list(range(n))
    visible = toks[:n] if spec is not None and len(toks) >= n else [str(i) for i in range(n)]
    if len(physical) != n:  # UUIDs or MIG names in the variable: number them as the driver does
        physical = list(range(n))
    names, numa = [], []
    for i in range(n):
        dev = call(drv.cuDeviceGet, i)
        names.append(_text(call(drv.cuDeviceGetName, 256, dev)))
        try:
            numa.append(_numa_of_bus(call(drv.cuDeviceGetPCIBusId, 64, dev)))
        except _NoGpu:
            numa.append(None)
    return GpuInfo("nvidia", n, names, physical, numa, api="cuda-python", visible=visible)


def _rocr_filter(indices: list[Any]) -> list[Any]:
    """ROCR_VISIBLE_DEVICES (numeric form) filters what HIP enumerates."""
    spec = os.environ.get("ROCR_VISIBLE_DEVICES")
    return [indices[i] for i in _visible(len(indices), spec)] if spec is not None else indices


def _amdsmi() -> GpuInfo:
    smi = _import("amdsmi")
    if smi is None:
        raise ImportError("amdsmi is not installed")
    try:
        smi.amdsmi_init()
    except Exception as e:  # AmdSmiException and friends: no usable driver here
        raise _NoGpu(f"amdsmi did not initialise ({e})") from None
    try:
        handles = list(smi.amdsmi_get_processor_handles())
        rows = []
        for pos, h in enumerate(handles):
            bdf = _text(smi.amdsmi_get_gpu_device_bdf(h))
            try:  # HIP's own numbering where amdsmi knows it (ROCm >= 6.3), else PCI order
                order: Any = int(smi.amdsmi_get_gpu_enumeration_info(h)["hip_id"])
            except Exception:  # noqa: BLE001 - older amdsmi, or "N/A"
                order = (bdf, pos)
            try:
                name = _text(smi.amdsmi_get_gpu_asic_info(h).get("market_name") or "AMD GPU")
            except Exception:  # noqa: BLE001 - the name is cosmetic
                name = "AMD GPU"
            rows.append((order, name, bdf))
        rows.sort(key=lambda r: (isinstance(r[0], tuple), r[0]))
        rows = _rocr_filter(rows)
        vis = _hip_visible(len(rows))
        return GpuInfo(
            "amd",
            len(vis),
            [rows[i][1] for i in vis],
            vis,
            [_numa_of_bus(rows[i][2]) for i in vis],
            api="amdsmi",
        )
    finally:
        try:
            smi.amdsmi_shut_down()
        except Exception:  # noqa: BLE001 - nothing to do about a failed shutdown
            log.debug("amdsmi_shut_down failed", exc_info=True)


def _hip_python() -> GpuInfo:
    """The HIP runtime through hip-python: it applies HIP_VISIBLE_DEVICES itself."""
    mod = _import("hip")
    if mod is None or not hasattr(mod, "hip"):
        raise ImportError("hip-python is not installed")
    hip = mod.hip
    ok = hip.hipError_t.hipSuccess

    def check(res: Any) -> tuple[Any, ...]:
        res = res if isinstance(res, tuple) else (res,)
        if res[0] != ok:
            raise _NoGpu(f"HIP call failed ({res[0]})")
        return tuple(res[1:])

    (n,) = check(hip.hipGetDeviceCount())
    names, numa = [], []
    for i in range(int(n)):
        props = hip.hipDeviceProp_t()
        check(hip.hipGetDeviceProperties(props, i))
        names.append(_text(props.name))
        bus = f"{int(props.pciDomainID):04x}:{int(props.pciBusID):02x}:{int(props.pciDeviceID):02x}.0"
        numa.append(_numa_of_bus(bus))
    spec = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    toks = [t.strip() for t in spec.split(",")] if spec is not None else []
    physical = [int(t) for t in toks[: int(n)] if t.isdigit()] if spec is not None else list(range(int(n)))
    if len(physical) != int(n):
        physical = list(range(int(n)))
    return GpuInfo("amd", int(n), names, physical, numa, api="hip-python")


# Order matters: a node's NVIDIA management library first, its runtime only without it.
BACKENDS: tuple[tuple[str, Callable[[], GpuInfo]], ...] = (
    ("nvml", _nvml),
    ("cuda-python", _cuda_python),
    ("amdsmi", _amdsmi),
    ("hip-python", _hip_python),
)


AMD_BACKENDS = ("amdsmi", "hip-python")


@contextlib.contextmanager
def _output_to_stderr() -> Iterator[None]:
    """Send what is written to stdout meanwhile, from Python (sys.stdout) and from C (fd 1,
    libc's stdio), to stderr. Process-wide while it lasts: used only around vendor bindings."""
    out = getattr(sys, "stdout", None)
    with contextlib.suppress(Exception):
        if out is not None:
            out.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 at all: nothing to protect
        yield
        return
    libc = None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None)
    try:
        try:
            os.dup2(2, 1)
        except OSError:  # no fd 2 either: drop it
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if libc is not None:
            libc.fflush(None)  # C stdio buffers the binding filled go out before fd 1 is back
        os.dup2(saved, 1)
        os.close(saved)


def discover_real() -> tuple[GpuInfo | None, list[str]]:
    """The first backend that sees a GPU, and why each one before it did not."""
    tried: list[str] = []
    amd = amd_driver_present()
    for name, fn in BACKENDS:
        if name in AMD_BACKENDS and not amd:
            tried.append(f"{name}: not tried: no AMD GPU driver (/dev/kfd)")
            continue
        try:
            with _output_to_stderr():
                info = fn()
        except ImportError as e:
            tried.append(f"{name}: {e}")
            continue
        except _NoGpu as e:
            tried.append(f"{name}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a broken vendor binding must not break KREX
            tried.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if info.count:
            info.tried = tried
            log.debug("GPUs through %s: %s", name, info.names)
            return info, tried
        tried.append(f"{name}: no visible GPU")
    return None, tried


def discover(device: str = "auto") -> GpuInfo:
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", f"use one of: {', '.join(DEVICES)}")
    tried: list[str] = []
    if device in ("auto", "gpu"):
        info, tried = discover_real()
        if info is not None:
            return info
        nodes = gpu_device_nodes()
        if device == "auto" and nodes:
            spec = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise NotFound(
                f"this machine has a GPU driver ({', '.join(nodes)}) but KREX could not list its GPUs: "
                + "; ".join(tried)
                + (f" (CUDA_VISIBLE_DEVICES={spec!r})" if spec is not None else ""),
                "install the vendor's management library (nvidia-ml-py is a KREX dependency; 'krex-gpu[amd]' "
                "on ROCm), check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, or pass --device sim to use "
                "the simulated GPU on purpose",
            )
        if device == "gpu":
            raise NotFound(
                "no GPU found: no NVIDIA GPU (NVML, cuda-python) and no AMD GPU (amdsmi, hip-python); "
                + "; ".join(tried),
                "install the driver and nvidia-ml-py (NVIDIA, a dependency of krex-gpu; 'krex-gpu[cuda]' "
                "without NVML) or 'krex-gpu[amd]' (ROCm), check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, "
                "or use --device sim",
            )
    n = sim_gpu_count()
    return GpuInfo(
        "sim",
        n,
        [f"simulated GPU {i}" for i in range(n)],
        list(range(n)),
        [None] * n,
        note="simulated GPU: proves logic, never performance",
        api="sim",
        tried=tried,
    )
