"""Issue 11.4 on the H200: why short torch.compile kernels inflate under krex at C >= 8.

One owner (a torch.compile'd layer-norm + GELU over 4096x4096 fp32, about 0.05-0.13 ms)
times 100 trials with CUDA events inside each of 5 regions; 7 siblings under `krex run`
each hold --gb GB on the GPU and run a small op every 50 ms. Variants change one thing at
a time: no siblings; siblings frozen by cgroup v2 (policy all); siblings not frozen (policy
gpu: they park at the gate); siblings frozen with SIGSTOP (signal freezer); siblings without
the large footprint. Prints min / p10 / median per variant; JSON to $OUT/short_kernels.json.
Run with KREX_STATE_DIR set; it starts and stops its own daemons."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PY = sys.executable
KREX = [PY, "-m", "krex.cli.main"]
OUT = os.environ.get("OUT", "/tmp")

OWNER = r"""
import json, sys, time, torch, krex
import torch.nn.functional as F
def fn(x, w, b):
    return F.gelu(F.layer_norm(x, (x.shape[-1],)) * w + b) + x
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(4096, 4096, device="cuda", generator=g)
w = torch.randn(4096, device="cuda", generator=g); b = torch.randn(4096, device="cuda", generator=g)
cfn = torch.compile(fn)
for _ in range(20): cfn(x, w, b)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ms, grants = [], []
for r in range(5):
    time.sleep(0.3)
    with krex.region() as reg:
        for _ in range(100):
            s.record(); cfn(x, w, b); e.record(); e.synchronize()
            ms.append(s.elapsed_time(e))
    grants.append({k: (reg.grant or {}).get(k) for k in ("freeze_policy", "frozen_slots", "running_slots", "contaminated", "entry_s")})
print(json.dumps({"ms": ms, "grants": grants}))
"""

SIBLING = r"""
import os, sys, time, torch
gb = float(sys.argv[1])
hold = torch.empty(int(gb * (1 << 30)), dtype=torch.uint8, device="cuda") if gb > 0 else None
if hold is not None: hold.fill_(1)
a = torch.randn(256, 256, device="cuda")
torch.cuda.synchronize()
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    (a @ a).sum().item()
    time.sleep(0.05)
"""


def daemon(start: bool, freezer: str | None = None) -> None:
    if start:
        args = [*KREX, "daemon", "start", "--device", "gpu", "--slots-per-gpu", "16"]
        if freezer:
            args += ["--freezer", freezer]
        subprocess.run(args, check=True, capture_output=True)
    else:
        subprocess.run([*KREX, "daemon", "stop"], capture_output=True)


def variant(label: str, n_sib: int, gb: float, policy: str, freezer: str | None) -> dict[str, object]:
    daemon(True, freezer)
    tag = f"/tmp/sk-{label}"
    sibs = []
    try:
        for i in range(n_sib):
            sibs.append(subprocess.Popen([*KREX, "run", "--device", "gpu", "--", PY, "-c", SIBLING, str(gb),
                                          f"{tag}-ready{i}", f"{tag}-stop"]))
        deadline = time.time() + 120
        while any(not os.path.exists(f"{tag}-ready{i}") for i in range(n_sib)) and time.time() < deadline:
            time.sleep(0.2)
        p = subprocess.run([*KREX, "run", "--device", "gpu", "--freeze", policy, "--", PY, "-c", OWNER],
                           capture_output=True, text=True, timeout=300)
        res = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        open(f"{tag}-stop", "w").close()
        for s in sibs:
            try:
                s.wait(timeout=60)
            except subprocess.TimeoutExpired:
                s.kill()
        daemon(False)
    ms = sorted(res["ms"])
    return {"label": label, "siblings": n_sib, "gb": gb, "policy": policy, "freezer": freezer or "default",
            "min": ms[0], "p10": ms[len(ms) // 10], "median": statistics.median(ms), "max": ms[-1],
            "n": len(ms), "grants": res["grants"]}


def main() -> None:
    gb = float(os.environ.get("SK_GB", "13"))
    rows = []
    for args in (("alone", 0, 0.0, "all", None),
                 ("frozen-cgroup2", 7, gb, "all", None),
                 ("not-frozen-gpu", 7, gb, "gpu", None),
                 ("frozen-sigstop", 7, gb, "all", "signal"),
                 ("frozen-no-footprint", 7, 0.0, "all", None),
                 ("alone-again", 0, 0.0, "all", None)):
        rows.append(variant(*args))
        r = rows[-1]
        print(f"{r['label']:>20}: min {r['min']:.4f} p10 {r['p10']:.4f} median {r['median']:.4f} ms "
              f"(n={r['n']}, frozen {[g['frozen_slots'] for g in r['grants']][:1]})", flush=True)
    with open(os.path.join(OUT, "short_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
