"""Fast-path cost of the gate, in isolation: ns per call through the shim (gate
open, KREX active) minus ns per direct call into a stand-in driver. Alternates
the two in one run. Usage: python scripts/fastpath/run.py [rounds] [kernel|copy] [SHIM]
(copy: a 4 KiB cuMemcpyHtoD_v2, below the chunk size; SHIM: another build's shim)"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from krex.node.shm import Segment
from krex.proc.envvars import opt_in_env

HERE = Path(__file__).resolve().parent


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    call = sys.argv[2] if len(sys.argv) > 2 else "kernel"
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            "-o",
            tmp / "libcuda.so.1",
            HERE / "fakecu.c",
            "-Wl,-soname,libcuda.so.1",
        ],
        check=True,
    )
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-o",
            tmp / "micro",
            HERE / "micro.c",
            f"-L{tmp}",
            "-l:libcuda.so.1",
            f"-Wl,-rpath,{tmp}",
        ],
        check=True,
    )
    name = f"/krex-fastpath-{os.getpid()}"
    seg = Segment.create(name, n_gpus=1)
    slot = seg.claim_slot(0)
    on = dict(os.environ, **opt_in_env("gpu", name), KREX_SLOT=str(slot), KREX_GPU="0")
    on.pop("KREX_SOCKET", None)
    if len(sys.argv) > 3:
        on["LD_PRELOAD"] = sys.argv[3]
    off = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "LD_PRELOAD"}
    preload_only = dict(off, LD_PRELOAD=on["LD_PRELOAD"])
    res: dict[str, list[float]] = {"direct": [], "shim_passthrough": [], "shim_gate_open": []}
    try:
        for _ in range(rounds):
            for key, env in (("direct", off), ("shim_passthrough", preload_only), ("shim_gate_open", on)):
                out = subprocess.run(
                    [tmp / "micro", "5000000", call], env=env, capture_output=True, text=True, check=True
                )
                res[key].append(json.loads(out.stdout)["ns_per_call"])
        gated = sum(p.submits["kernel" if call == "kernel" else "copy"] for p in seg.snapshot().procs)
    finally:
        seg.release_slot(slot)
        seg.close()
        Segment.unlink(name)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        json.dumps(
            {
                "median_ns": med,
                "all": res,
                "gated_calls": gated,
                "gate_cost_ns": med["shim_gate_open"] - med["direct"],
                "passthrough_cost_ns": med["shim_passthrough"] - med["direct"],
            }
        )
    )


if __name__ == "__main__":
    main()
