"""Why a lone command can time slower inside a region than outside it (real GPU only).

One command, no sibling, times each workload in blocks of TRIALS CUDA-event trials
(KernelBench's way: record, call, record, synchronize), alternating a block inside a region
with a block outside one. The ratio of the two block means is what a user sees as the
region's cost to its own command. Variants change one thing at a time:

- native:       no KREX at all; "region" blocks are plain blocks (the noise floor);
- native-nvml:  no KREX; as each "region" block starts, another thread of the process makes
                the NVML queries krexd's attestation makes as it grants a region (process
                list with memory, clock-event reasons, SM clock);
- native-pin:   no KREX; each "region" block runs with the thread pinned to the last CPU
                (the region core of a 1-GPU partition), as krexd pins it;
- krex:         `krex run`, regions from krex.region() (the default daemon);
- krex-unpin:   as krex, but the thread moves back to its cores right after the grant;
- krex-nonvml:  as krex, with a daemon that cannot import NVML (no attestation queries).

Prints one table (workload x variant: mean ms outside, inside, ratio, and how much of the
difference the first trial of a block carries); JSON lines to $OUT/lone_region.jsonl.
Run with KREX_STATE_DIR set and krex importable; it starts and stops its own daemons."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

PY = sys.executable
KREX = [PY, "-P", "-m", "krex.cli.main"]
OUT = os.environ.get("OUT", "/tmp")
BLOCKS = int(os.environ.get("LONE_BLOCKS", "8"))
TRIALS = int(os.environ.get("LONE_TRIALS", "100"))

CHILD = r"""
import json, os, sys, threading, time, torch
import torch.nn.functional as F
import krex
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
mode, blocks, trials = os.environ["LONE_MODE"], int(os.environ["LONE_BLOCKS"]), int(os.environ["LONE_TRIALS"])

class Chain(torch.nn.Module):  # conv + group norm + activation + residual + reduction
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.gn = torch.nn.GroupNorm(8, 64)
    def forward(self, x):
        y = F.gelu(self.gn(self.conv(x))) + x
        return torch.logsumexp(y, dim=1)

class Deconv(torch.nn.Module):  # ConvTranspose3d + ReLU + GroupNorm, eager
    def __init__(self):
        super().__init__()
        self.ct = torch.nn.ConvTranspose3d(32, 32, 3, stride=2, padding=1)
        self.gn = torch.nn.GroupNorm(4, 32)
    def forward(self, x):
        return self.gn(F.relu(self.ct(x)))

def gemm(a, b):
    return a @ b

work = {}
x1 = torch.randn(32, 64, 96, 96).cuda()
work["compiled-chain"] = (torch.compile(Chain().cuda()), (x1,))
x2 = torch.randn(8, 32, 24, 48, 48).cuda()
work["eager-deconv3d"] = (Deconv().cuda(), (x2,))
a = torch.randn(8192, 8192, dtype=torch.bfloat16).cuda()
b = torch.randn(8192, 8192, dtype=torch.bfloat16).cuda()
work["cublas-gemm"] = (gemm, (a, b))

def nvml_sample():
    import pynvml
    pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    try: pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
    except pynvml.NVMLError: pass
    pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)

def block(fn, args):
    out = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        s.record(); fn(*args); e.record(); torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return out

class Region:
    def __enter__(self):
        self.aff = os.sched_getaffinity(0)
        if mode.startswith("krex"):
            self.r = krex.region(); self.r.__enter__()
            if mode == "krex-unpin":
                os.sched_setaffinity(0, self.aff)
        elif mode == "native-nvml":
            threading.Thread(target=nvml_sample).start()
        elif mode == "native-pin":
            os.sched_setaffinity(0, {max(self.aff)})
        return self
    def __exit__(self, *a):
        if mode.startswith("krex"):
            self.r.__exit__(*a)
        elif mode == "native-pin":
            os.sched_setaffinity(0, self.aff)

for name, (fn, args) in work.items():
    for _ in range(10):
        block(fn, args)  # warm-up: compile, cudnn benchmark, clocks
    for i in range(2 * blocks):
        inside = i % 2 == 1
        if inside:
            with Region():
                t = block(fn, args)
        else:
            t = block(fn, args)
        print(json.dumps({"workload": name, "mode": mode, "inside": inside, "ms": t}), flush=True)
"""

VARIANTS = ["native", "native-nvml", "native-pin", "krex", "krex-unpin", "krex-nonvml"]


def run(mode: str, child: str, nonvml_dir: str) -> list[dict]:
    env = {**os.environ, "LONE_MODE": mode, "LONE_BLOCKS": str(BLOCKS), "LONE_TRIALS": str(TRIALS),
           "TORCHINDUCTOR_CACHE_DIR": "/tmp/lone-inductor", "PYTHONUNBUFFERED": "1"}
    argv = [PY, child]
    if mode.startswith("krex"):
        subprocess.run([*KREX, "daemon", "stop"], env=env, capture_output=True, timeout=60)
        if mode == "krex-nonvml":
            env["PYTHONPATH"] = nonvml_dir + os.pathsep + env.get("PYTHONPATH", "")
        argv = [*KREX, "run", "--", PY, child]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=400)
    if mode.startswith("krex"):
        subprocess.run([*KREX, "daemon", "stop"], env=env, capture_output=True, timeout=60)
    with open(os.path.join(OUT, f"lone_{mode}.err"), "w") as f:
        f.write(p.stderr)
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not rows:
        print(f"{mode}: exit {p.returncode}; {p.stderr[-800:]}", file=sys.stderr)
    return rows


def main() -> None:
    d = tempfile.mkdtemp()
    child = os.path.join(d, "child.py")
    with open(child, "w") as f:
        f.write(CHILD)
    nonvml = os.path.join(d, "nonvml")
    os.mkdir(nonvml)
    with open(os.path.join(nonvml, "pynvml.py"), "w") as f:
        f.write("raise ImportError('NVML withheld for this experiment')\n")
    rows: list[dict] = []
    for mode in VARIANTS:
        rows += run(mode, child, nonvml)
    with open(os.path.join(OUT, "lone_region.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    # paired: each inside block against the outside block just before it (drift cancels)
    print(f"{'workload':16} {'variant':12} {'out ms':>8} {'in ms':>8} {'in/out':>7} {'paired med':>10} "
          f"{'1st-trial share':>15}")
    for w in dict.fromkeys(r["workload"] for r in rows):
        for m in VARIANTS:
            ins = [r["ms"] for r in rows if r["workload"] == w and r["mode"] == m and r["inside"]]
            outs = [r["ms"] for r in rows if r["workload"] == w and r["mode"] == m and not r["inside"]]
            if not ins or not outs:
                print(f"{w:16} {m:12} {'n/a':>8}")
                continue
            mi = statistics.mean(x for b in ins for x in b)
            mo = statistics.mean(x for b in outs for x in b)
            # the first trial's excess over the block's median, as a share of the whole excess
            first = statistics.mean(b[0] - statistics.median(b) for b in ins) / len(ins[0])
            share = first / (mi - mo) if mi - mo > 1e-9 else float("nan")
            pairs = zip(ins, outs, strict=False)
            paired = statistics.median(statistics.mean(i) / statistics.mean(o) for i, o in pairs)
            print(f"{w:16} {m:12} {mo:8.4f} {mi:8.4f} {mi / mo:7.4f} {paired:10.4f} {share:15.2f}")


if __name__ == "__main__":
    main()
