"""Fast-path cost on a real GPU: empty-kernel launch rate with the shim (gate
open) against without it, interleaved in one run so drift favours neither."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from krex.node.shm import Segment
from krex.proc.envvars import opt_in_env


def launch(binary: str, n: int, mode: str, env: dict[str, str]) -> float:
    out = subprocess.run([binary, str(n), mode], env=env, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["ns_per_launch"])


def main() -> None:
    binary, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seg = Segment.create(n_gpus=1)
    slot = seg.claim_slot(0)
    shim_env = dict(os.environ, **opt_in_env("gpu", seg.name), KREX_SLOT=str(slot), KREX_GPU="0")
    base_env = dict(os.environ)
    rows = []
    for mode in ("rt", "drv", "enq"):
        base, shim = [], []
        for _ in range(rounds):
            base.append(launch(binary, n, mode, base_env))
            shim.append(launch(binary, n, mode, shim_env))
        b, s = statistics.median(base), statistics.median(shim)
        rows.append(
            {
                "mode": mode,
                "base_ns": b,
                "shim_ns": s,
                "added_ns": s - b,
                "rate_ratio": b / s,
                "base_all": base,
                "shim_all": shim,
            }
        )
    snap = seg.snapshot()
    seg.release_slot(slot)
    print(json.dumps({"rows": rows, "gated_kernels": sum(p.submits["kernel"] for p in snap.procs)}))


if __name__ == "__main__":
    main()
