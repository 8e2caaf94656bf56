"""NVML samples of the bench's GPUs: SM clock, power and temperature, every few tens of ms
on a thread of the bench, through every cell of the invocation (native, unprotected and
krex alike, so the sampling costs every mode the same).

Each sample is written to ``nvml.jsonl`` (``t_ns`` on CLOCK_MONOTONIC, the clock of krexd's
``t_grant_ns``/``t_end_ns``) and kept in memory, so that `Sampler.around` can put a
region's figures into its raw.jsonl record: the sample at its grant (the last one before
it, if recent) and the samples inside it. On the simulated GPU there is no NVML: no sampler.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from krex.device.nvml import Nvml

__all__ = ["NVML_FILE", "Sample", "Sampler", "open_sampler", "window"]

NVML_FILE = "nvml.jsonl"
Sample = tuple[int, int | None, int | None, int | None]  # (t_ns, SM MHz, power mW, temperature C)
_KEEP = 200_000  # samples kept per GPU (about 80 min at 25 ms): older regions get no figures


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def window(samples: Sequence[Sample], t0_ns: int, t1_ns: int, stale_ns: int) -> dict[str, Any] | None:
    """A region's figures from time-ordered samples: ``entry``, the last sample at or before
    its grant ``t0_ns`` (at most ``stale_ns`` old; else the first one after it, if as close),
    and ``inside``, the samples in [t0_ns, t1_ns] (count, min and mean SM clock, max and mean
    power in W, max temperature). None when no sample is near the region."""

    def at(t: int) -> int:
        return bisect.bisect_right(samples, t, key=lambda s: s[0])

    i = at(t0_ns)
    entry: Sample | None = None
    if i > 0 and t0_ns - samples[i - 1][0] <= stale_ns:
        entry = samples[i - 1]
    elif i < len(samples) and samples[i][0] - t0_ns <= stale_ns:
        entry = samples[i]
    lo = bisect.bisect_left(samples, t0_ns, key=lambda s: s[0])
    inside = samples[lo : at(t1_ns)]
    if entry is None and not inside:
        return None
    out: dict[str, Any] = {}
    if entry is not None:
        out["entry"] = {
            "sm_mhz": entry[1],
            "power_w": None if entry[2] is None else entry[2] / 1000.0,
            "temp_c": entry[3],
            "age_ms": round((t0_ns - entry[0]) / 1e6, 1),
        }
    sm = [float(s[1]) for s in inside if s[1] is not None]
    pw = [s[2] / 1000.0 for s in inside if s[2] is not None]
    tc = [float(s[3]) for s in inside if s[3] is not None]
    out["inside"] = {
        "n": len(inside),
        "sm_min": min(sm) if sm else None,
        "sm_mean": _mean(sm),
        "power_max_w": max(pw) if pw else None,
        "power_mean_w": _mean(pw),
        "temp_max_c": max(tc) if tc else None,
    }
    return out


class Sampler:
    """Samples ``nvml`` for the visible GPUs (``physical[i]`` is visible GPU i's NVML index)
    every ``interval_s`` until `stop`."""

    def __init__(self, nvml: Nvml, physical: Sequence[int], interval_s: float, path: Path | None) -> None:
        self.nvml, self.physical, self.interval_s = nvml, list(physical), interval_s
        self.samples: dict[int, list[Sample]] = {i: [] for i in range(len(self.physical))}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._file: IO[str] | None = open(path, "a") if path is not None else None  # noqa: SIM115
        self._thread = threading.Thread(target=self._run, name="krex-bench-nvml", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(Exception):  # shutting NVML down is best effort
            self.nvml.close()

    def _one(self, i: int) -> Sample:
        phys = self.physical[i]
        return (
            time.monotonic_ns(),
            self.nvml.sm_clock(phys),
            self.nvml.power_mw(phys),
            self.nvml.temperature_c(phys),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            lines = []
            for i in self.samples:
                try:
                    s = self._one(i)
                except Exception:  # noqa: BLE001 - a failing NVML must never fail the bench
                    continue
                with self.lock:
                    keep = self.samples[i]
                    keep.append(s)
                    if len(keep) > _KEEP:
                        del keep[: len(keep) - _KEEP]
                lines.append(
                    json.dumps({"t_ns": s[0], "gpu": i, "sm_mhz": s[1], "power_mw": s[2], "temp_c": s[3]})
                )
            if self._file is not None and lines:
                with contextlib.suppress(OSError):
                    self._file.write("\n".join(lines) + "\n")
                    self._file.flush()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))

    def around(self, gpu: int, t0_ns: int, t1_ns: int) -> dict[str, Any] | None:
        """A region's figures on visible GPU ``gpu`` (see `window`)."""
        with self.lock:
            return window(self.samples.get(gpu, []), t0_ns, t1_ns, int(3 * self.interval_s * 1e9))

    def annotate(self, report: dict[str, Any]) -> None:
        """Put each region's figures (``nvml``) into a compacted `krex run` report."""
        gpu = report.get("gpu")
        for g in report.get("regions") or []:
            t0, t1 = g.get("t_grant_ns"), g.get("t_end_ns")
            if isinstance(gpu, int) and isinstance(t0, int) and isinstance(t1, int) and t0 > 0:
                got = self.around(gpu, t0, t1)
                if got is not None:
                    g["nvml"] = got


def open_sampler(dev: str, interval_ms: float, out_dir: Path) -> tuple[Sampler | None, str]:
    """A started sampler of the visible GPUs writing ``out_dir/nvml.jsonl``, or None, and a
    note saying which (or why none)."""
    if dev != "gpu":
        return None, "NVML samples: none (the simulated GPU has no NVML)"
    if interval_ms <= 0:
        return None, "NVML samples: off (--nvml-ms 0)"
    from krex.device.gpus import discover
    from krex.device.nvml import NvmlUnavailable, open_nvml

    try:
        nvml = open_nvml()
        physical = list(discover(dev).physical)
    except (NvmlUnavailable, Exception) as e:  # noqa: BLE001 - the bench runs on without samples
        return None, f"NVML samples: unavailable ({type(e).__name__}: {e})"
    s = Sampler(nvml, physical, interval_ms / 1000.0, out_dir / NVML_FILE).start()
    return s, (
        f"NVML samples: SM clock, power and temperature of GPU(s) {','.join(map(str, physical))} every "
        f"{interval_ms:g} ms in {NVML_FILE}; each region's figures at its grant and inside it are in "
        "raw.jsonl"
    )
