"""GPU discovery with the vendor layer replaced by fakes: NVML, cuda-python where NVML
is missing, amdsmi and hip-python on a ROCm node, and nothing at all. The fakes have
the call shapes of the real bindings (tuples of (error, value) for cuda-python and
hip-python, dicts for amdsmi); no real AMD hardware was involved."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from krex.device import gpus
from krex.errors import NotFound

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.fakes import FAKE_AMDSMI, fake_cuda_driver, fake_module  # noqa: E402

VIS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def no_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every vendor binding missing unless a test installs a fake."""
    for k in VIS:
        monkeypatch.delenv(k, raising=False)
    for m in ("pynvml", "cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda", "amdsmi", "hip"):
        monkeypatch.setitem(sys.modules, m, None)  # None in sys.modules: import raises ImportError
    monkeypatch.setenv("KREX_GPU_DEVICE_NODES", "/nonexistent/nvidiactl:/nonexistent/kfd")


@pytest.fixture
def kfd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The AMD driver's node exists (a file standing in for /dev/kfd): AMD bindings are asked."""
    n = tmp_path / "kfd"
    n.write_text("")
    monkeypatch.setenv("KREX_GPU_DEVICE_NODES", str(n))
    return n


# ----------------------------------------------------------------------------- fakes


class _NVMLError(Exception):
    pass


def fake_pynvml(names: list[str], init_error: bool = False) -> types.ModuleType:
    class Pci:
        def __init__(self, i: int) -> None:
            self.busId = f"00000000:{0x10 + i:02X}:00.0".encode()

    def init() -> None:
        if init_error:
            raise _NVMLError("NVML Shared Library Not Found")

    return fake_module(
        "pynvml",
        NVMLError=_NVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(names),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h].encode(),
        nvmlDeviceGetPciInfo=lambda h: Pci(h),
    )


def fake_amdsmi() -> types.ModuleType:
    m = types.ModuleType("amdsmi")
    exec(FAKE_AMDSMI, m.__dict__)
    return m


def fake_hip(names: list[str]) -> types.ModuleType:
    class hipError_t(int):
        hipSuccess: Any = None

    hipError_t.hipSuccess = hipError_t(0)

    class hipDeviceProp_t:
        name = b""
        pciDomainID = pciBusID = pciDeviceID = 0

    def hipGetDeviceCount() -> tuple[Any, int]:
        return hipError_t(0), len(names)

    def hipGetDeviceProperties(props: hipDeviceProp_t, i: int) -> tuple[Any]:
        props.name = names[i].encode() + b"\0" * 8
        props.pciBusID = 0x20 + i
        return (hipError_t(0),)

    hip = fake_module(
        "hip.hip",
        hipError_t=hipError_t,
        hipDeviceProp_t=hipDeviceProp_t,
        hipGetDeviceCount=hipGetDeviceCount,
        hipGetDeviceProperties=hipGetDeviceProperties,
    )
    return fake_module("hip", hip=hip)


# ----------------------------------------------------------------------------- tests


def test_nvml_first_with_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(["H200 a", "H200 b", "H200 c"]))
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_cuda_driver(["never asked"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    info = gpus.discover("gpu")
    assert (info.kind, info.api, info.count, info.names, info.physical) == (
        "nvidia",
        "nvml",
        2,
        ["H200 c", "H200 a"],
        [2, 0],
    )


@pytest.mark.parametrize("nvml", ["missing", "no-library"])
def test_cuda_python_where_nvml_is_missing(monkeypatch: pytest.MonkeyPatch, nvml: str) -> None:
    if nvml == "no-library":  # nvidia-ml-py installed, libnvidia-ml.so not in the container
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=True))
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_cuda_driver(["GH200 480GB", "GH200 480GB"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    info = gpus.discover("gpu")
    assert (info.kind, info.api, info.names, info.physical) == (
        "nvidia",
        "cuda-python",
        ["GH200 480GB", "GH200 480GB"],
        [3, 1],
    )
    assert info.tried and info.tried[0].startswith("nvml: ")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1f2e,GPU-9a8b")  # UUIDs: numbered as the driver does
    assert gpus.discover("gpu").physical == [0, 1]


def test_old_cuda_python_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = fake_cuda_driver(["A100"])
    drv.__name__ = "cuda.cuda"
    monkeypatch.setitem(sys.modules, "cuda.cuda", drv)
    info = gpus.discover("gpu")
    assert (info.api, info.names) == ("cuda-python", ["A100"])


def test_cuda_python_driver_error_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_cuda_driver(["x"], init_err=100))
    info = gpus.discover("auto")
    assert info.kind == "sim" and any(t.startswith("cuda-python: cuInit failed") for t in info.tried)


def test_amdsmi_orders_by_hip_id_and_honours_visibility(monkeypatch: pytest.MonkeyPatch, kfd: Path) -> None:
    smi = fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    info = gpus.discover("gpu")
    assert (info.kind, info.api, info.vendor) == ("amd", "amdsmi", "AMD")
    assert info.names == ["AMD Instinct MI300X (a)", "AMD Instinct MI300X (b)"] and info.physical == [0, 1]
    assert smi._STATE == {"init": 1, "shut": 1}
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert gpus.discover("gpu").names == ["AMD Instinct MI300X (b)"]
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1")  # ROCR filters first; HIP then numbers from 0
    info = gpus.discover("gpu")
    assert info.names == ["AMD Instinct MI300X (b)"] and info.physical == [0]


def test_amdsmi_without_enumeration_info_uses_pci_order(monkeypatch: pytest.MonkeyPatch, kfd: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    monkeypatch.setenv("FAKE_AMDSMI_OLD", "1")
    assert gpus.discover("gpu").names == ["AMD Instinct MI300X (a)", "AMD Instinct MI300X (b)"]


def test_hip_python_when_amdsmi_fails(monkeypatch: pytest.MonkeyPatch, kfd: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    monkeypatch.setenv("FAKE_AMDSMI_FAIL", "1")
    monkeypatch.setitem(sys.modules, "hip", fake_hip(["AMD Radeon PRO W7900", "AMD Radeon PRO W7900"]))
    info = gpus.discover("gpu")
    assert (info.kind, info.api, info.count) == ("amd", "hip-python", 2)
    assert info.names == ["AMD Radeon PRO W7900"] * 2
    assert any("DRIVER_NOT_LOADED" in t for t in info.tried)


def test_broken_binding_never_breaks_discovery(monkeypatch: pytest.MonkeyPatch, kfd: Path) -> None:
    # no handles function
    bad = fake_module("amdsmi", amdsmi_init=lambda: None, amdsmi_shut_down=lambda: None)
    monkeypatch.setitem(sys.modules, "amdsmi", bad)
    info, tried = gpus.discover_real()
    assert info is None and any(t.startswith("amdsmi: AttributeError") for t in tried)


def test_amd_bindings_are_not_asked_without_the_amd_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    smi = fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    monkeypatch.setitem(sys.modules, "hip", fake_hip(["AMD Radeon PRO W7900"]))
    info = gpus.discover("auto")
    assert info.kind == "sim" and smi._STATE == {"init": 0, "shut": 0}
    assert "amdsmi: not tried: no AMD GPU driver (/dev/kfd)" in info.tried
    assert "hip-python: not tried: no AMD GPU driver (/dev/kfd)" in info.tried


def test_what_a_binding_prints_goes_to_stderr(
    monkeypatch: pytest.MonkeyPatch, kfd: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import os

    def init() -> None:
        print("Unable to load the amdsmi library")
        os.write(1, b"from C\n")
        raise RuntimeError("AMDSMI_STATUS_DRIVER_NOT_LOADED")

    monkeypatch.setitem(sys.modules, "amdsmi", fake_module("amdsmi", amdsmi_init=init))
    print("before")
    gpus.discover_real()
    print("after")
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and "Unable to load the amdsmi library\nfrom C\n" in err


def test_no_gpu_names_every_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NotFound) as ei:
        gpus.discover("gpu")
    msg = str(ei.value)
    for api in ("nvml", "cuda-python", "amdsmi", "hip-python"):
        assert f"{api}: " in msg
    assert "krex-gpu[amd]" in ei.value.fix and "krex-gpu[cuda]" in ei.value.fix
    info = gpus.discover("auto")
    assert info.kind == "sim" and len(info.tried) == 4
