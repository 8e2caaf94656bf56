"""NVML behind one small interface: GPU discovery and per-region attestation use it.

`open_nvml()` returns the real library (nvidia-ml-py, a dependency of KREX) or, when
KREX_NVML_FAKE names a JSON file, a fake that re-reads that file on every call, so a
test can change what "NVML" reports while a region runs. The fake's file:

    {"error": "why nvmlInit failed"}                              (optional)
    {"gpus": [{"name": "...", "uuid": "GPU-...", "pci": "0000:17:00.0",
               "migs": ["MIG-..."], "procs": [pid, ...], "mem": {"pid": bytes, ...},
               "sm_clock": 1980, "throttle": 4, "power_mw": 450000, "temp_c": 60}, ...]}

Nothing here prints; failures raise NvmlUnavailable with the reason."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Protocol

FAKE_ENV = "KREX_NVML_FAKE"

# nvmlClocksEventReasons (formerly ClocksThrottleReasons) bits, nvml.h.
THROTTLE_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that slow a running kernel down (idle, app clocks, sync boost do not).
DISTURBING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def throttle_names(mask: int) -> list[str]:
    return [n for bit, n in THROTTLE_NAMES.items() if mask & bit]


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why."""


class Nvml(Protocol):
    def count(self) -> int: ...
    def name(self, i: int) -> str: ...
    def uuid(self, i: int) -> str: ...
    def pci_bus(self, i: int) -> str | None: ...
    def mig_uuids(self, i: int) -> list[str]: ...
    def processes(self, i: int) -> list[int]: ...
    def process_memory(self, i: int) -> dict[int, int | None]: ...
    def sm_clock(self, i: int) -> int | None: ...
    def throttle(self, i: int) -> int | None: ...
    def power_mw(self, i: int) -> int | None: ...
    def temperature_c(self, i: int) -> int | None: ...
    def close(self) -> None: ...


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RealNvml:
    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({e})") from None
        self.m = pynvml
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError and friends: any failure means "not usable"
            raise NvmlUnavailable(f"nvmlInit failed: {e}") from None
        self._h: dict[int, Any] = {}

    def _handle(self, i: int) -> Any:
        if i not in self._h:
            self._h[i] = self.m.nvmlDeviceGetHandleByIndex(i)
        return self._h[i]

    def count(self) -> int:
        return int(self.m.nvmlDeviceGetCount())

    def name(self, i: int) -> str:
        return _s(self.m.nvmlDeviceGetName(self._handle(i)))

    def uuid(self, i: int) -> str:
        return _s(self.m.nvmlDeviceGetUUID(self._handle(i)))

    def pci_bus(self, i: int) -> str | None:
        try:
            return _s(self.m.nvmlDeviceGetPciInfo(self._handle(i)).busId)
        except Exception:  # noqa: BLE001 - optional information
            return None

    def mig_uuids(self, i: int) -> list[str]:
        out: list[str] = []
        try:
            n = int(self.m.nvmlDeviceGetMaxMigDeviceCount(self._handle(i)))
        except Exception:  # noqa: BLE001 - no MIG support on this GPU
            return out
        for k in range(n):
            try:
                out.append(
                    _s(
                        self.m.nvmlDeviceGetUUID(
                            self.m.nvmlDeviceGetMigDeviceHandleByIndex(self._handle(i), k)
                        )
                    )
                )
            except Exception:  # noqa: BLE001 - an empty MIG slot
                continue
        return out

    def processes(self, i: int) -> list[int]:
        return sorted(self.process_memory(i))

    def process_memory(self, i: int) -> dict[int, int | None]:
        """pid -> its GPU memory in bytes (None where NVML cannot say, e.g. in a container)."""
        mem: dict[int, int | None] = {}
        h = self._handle(i)
        unsupported = getattr(self.m, "NVMLError_NotSupported", ())
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                for p in getattr(self.m, fn)(h):
                    used = getattr(p, "usedGpuMemory", None)
                    mem[int(p.pid)] = int(used) if isinstance(used, int) else mem.get(int(p.pid))
            except unsupported:
                continue  # no graphics (or compute) on this GPU
            except Exception:
                # An empty list would read as "no process" (a newcomer with no context, a
                # teardown over); only a GPU without graphics may answer nothing.
                if fn.endswith("ComputeRunningProcesses"):
                    raise
        return mem

    def sm_clock(self, i: int) -> int | None:
        try:
            return int(self.m.nvmlDeviceGetClockInfo(self._handle(i), self.m.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001
            return None

    def throttle(self, i: int) -> int | None:
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            f = getattr(self.m, fn, None)
            if f is None:
                continue
            try:
                return int(f(self._handle(i)))
            except Exception:  # noqa: BLE001
                return None
        return None

    def power_mw(self, i: int) -> int | None:
        try:
            return int(self.m.nvmlDeviceGetPowerUsage(self._handle(i)))
        except Exception:  # noqa: BLE001
            return None

    def temperature_c(self, i: int) -> int | None:
        try:
            return int(self.m.nvmlDeviceGetTemperature(self._handle(i), self.m.NVML_TEMPERATURE_GPU))
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        with contextlib.suppress(Exception):  # shutting down is best effort
            self.m.nvmlShutdown()


class FakeNvml:
    """Reads $KREX_NVML_FAKE on every call (tests rewrite it while regions run)."""

    def __init__(self, path: str) -> None:
        self.path = path
        d = self._data()
        if d.get("error"):
            raise NvmlUnavailable(str(d["error"]))

    def _data(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise NvmlUnavailable(f"fake NVML file {self.path}: {e}") from None
        return d if isinstance(d, dict) else {}

    def _gpu(self, i: int) -> dict[str, Any]:
        gpus = self._data().get("gpus") or []
        return gpus[i] if 0 <= i < len(gpus) else {}

    def count(self) -> int:
        return len(self._data().get("gpus") or [])

    def name(self, i: int) -> str:
        return str(self._gpu(i).get("name", f"fake GPU {i}"))

    def uuid(self, i: int) -> str:
        return str(self._gpu(i).get("uuid", f"GPU-fake-{i:04d}"))

    def pci_bus(self, i: int) -> str | None:
        v = self._gpu(i).get("pci")
        return None if v is None else str(v)

    def mig_uuids(self, i: int) -> list[str]:
        return [str(x) for x in self._gpu(i).get("migs") or []]

    def processes(self, i: int) -> list[int]:
        return sorted(self.process_memory(i))

    def process_memory(self, i: int) -> dict[int, int | None]:
        g = self._gpu(i)
        mem = {str(k): int(v) for k, v in (g.get("mem") or {}).items()}
        return {int(p): mem.get(str(p)) for p in g.get("procs") or []}

    def sm_clock(self, i: int) -> int | None:
        v = self._gpu(i).get("sm_clock")
        return None if v is None else int(v)

    def throttle(self, i: int) -> int | None:
        v = self._gpu(i).get("throttle")
        return None if v is None else int(v)

    def power_mw(self, i: int) -> int | None:
        v = self._gpu(i).get("power_mw")
        return None if v is None else int(v)

    def temperature_c(self, i: int) -> int | None:
        v = self._gpu(i).get("temp_c")
        return None if v is None else int(v)

    def close(self) -> None:
        pass


def fake_path() -> str | None:
    return os.environ.get(FAKE_ENV) or None


def open_nvml() -> Nvml:
    """The fake when KREX_NVML_FAKE is set, else the real NVML. Raises NvmlUnavailable."""
    p = fake_path()
    if p:
        return FakeNvml(p)
    return RealNvml()
