"""Test victim for tests/integration/test_prewarm.py: a command shaped like an agent's,
a CPU phase then a GPU phase, on the simulated GPU through ctypes (under `krex run`
the shim gates it).

    warm_victim.py OUT_DIR NAME [--cpu-s S] [--gpu-s S] [--region] [--until FILE]

Writes NAME.start at once ({"pid", "t"}), spends --cpu-s seconds on the CPU (imports and
input generation stand-in), writes NAME.cpu, makes its first GPU call (a region first
with --region), writes NAME.gpu ({"t"}: when that call returned), then keeps the GPU
busy for --gpu-s seconds, or until FILE exists with --until, and writes NAME.json
({"pid", "t_start", "t_cpu", "t_gpu", "t_end", "grant"}). Times: CLOCK_MONOTONIC s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cp_worker import Gpu, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("name")
    ap.add_argument("--cpu-s", type=float, default=0.0)
    ap.add_argument("--gpu-s", type=float, default=0.0)
    ap.add_argument("--region", action="store_true")
    ap.add_argument("--until", default="")
    a = ap.parse_args()
    out = Path(a.out)
    rec: dict[str, object] = {"pid": os.getpid(), "t_start": time.monotonic()}
    write_json(out / f"{a.name}.start", {"pid": os.getpid(), "t": rec["t_start"]})
    t = time.monotonic() + a.cpu_s
    while time.monotonic() < t:
        pass
    rec["t_cpu"] = time.monotonic()
    write_json(out / f"{a.name}.cpu", {"t": rec["t_cpu"]})
    gpu = Gpu()
    if a.region:
        import krex

        with krex.region() as r:
            rec["t_gpu"] = time.monotonic()
            gpu.kernel(100)
            gpu.synchronize()
        rec["grant"] = r.grant
    else:
        gpu.kernel(100)
        rec["t_gpu"] = time.monotonic()
    write_json(out / f"{a.name}.gpu", {"t": rec["t_gpu"]})
    t = time.monotonic() + a.gpu_s
    while (time.monotonic() < t) if not a.until else not Path(a.until).exists():
        gpu.kernel(2000)
        gpu.synchronize()
    rec["t_end"] = time.monotonic()
    write_json(out / f"{a.name}.json", rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
