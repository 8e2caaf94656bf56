"""Issue 5 on a machine with several GPUs: per-GPU independence, the CPU partition,
throughput scaling across GPUs, and CUDA context-creation time with many commands
starting at once. Prints a short table last; raw JSON to $OUT/multigpu.json."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PY = sys.executable
KREX = [PY, "-m", "krex.cli.main"]

REGIONS = r"""
import json, sys, time, torch, triton, krex
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
fn = lambda: a @ a
fn(); torch.cuda.synchronize()
iv = []
for _ in range(int(sys.argv[1])):
    with krex.region():
        t0 = time.monotonic()
        triton.testing.do_bench(fn, warmup=10, rep=50)
        t1 = time.monotonic()
    iv.append((t0, t1))
    time.sleep(0.05)
print(json.dumps(iv))
"""

HAMMER = r"""
import json, sys, time, torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
stop = time.monotonic() + float(sys.argv[1])
ts = []
while time.monotonic() < stop:
    a @ a
    torch.cuda.synchronize()
    ts.append(time.monotonic())
print(json.dumps(ts))
"""

CTX = r"""
import json, os, time
t0 = time.time()
import torch
t1 = time.time()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.time()
print(json.dumps({"import_s": t1 - t0, "ctx_s": t2 - t1, "start": t0, "ready": t2}))
"""

BENCH = r"""
import json, time, torch, triton, krex
t0 = time.time()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
fn = lambda: a @ a
fn(); torch.cuda.synchronize()
with krex.region():
    ms = triton.testing.do_bench(fn, warmup=10, rep=50)
print(json.dumps({"ms": ms}))
"""


def run_under(gpu: int | None, src: str, *args: str) -> subprocess.Popen[str]:
    cmd = [*KREX, "run", "--device", "gpu"]
    if gpu is not None:
        cmd += ["--gpu", str(gpu)]
    return subprocess.Popen([*cmd, "--", PY, "-c", src, *args], stdout=subprocess.PIPE, text=True)


def last_json(p: subprocess.Popen[str]) -> object:
    out, _ = p.communicate(timeout=600)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    res: dict[str, object] = {}
    st = subprocess.run([*KREX, "daemon", "status", "--json"], capture_output=True, text=True)
    res["partition"] = json.loads(st.stdout)["partition"] if st.returncode == 0 else st.stderr
    # 1. Independence: regions on GPU 0, a hammer on GPU 1.
    h = run_under(1, HAMMER, "25")
    time.sleep(8)
    r = run_under(0, REGIONS, "20")
    iv = last_json(r)
    ts = last_json(h)
    assert isinstance(iv, list) and isinstance(ts, list)
    inside = outside = 0
    t_in = sum(b - a for a, b in iv)
    lo, hi = iv[0][0], iv[-1][1]
    for t in ts:
        if lo <= t <= hi:
            if any(a <= t <= b for a, b in iv):
                inside += 1
            else:
                outside += 1
    t_out = (hi - lo) - t_in
    res["independence"] = {
        "hammer_rate_in_regions": inside / t_in,
        "hammer_rate_outside": outside / max(t_out, 1e-9),
        "regions": len(iv),
    }
    # 2. Context creation with N commands starting at once (no KREX: what the driver does).
    ctx: dict[str, object] = {}
    ngpu = int(
        subprocess.run(
            [PY, "-c", "import torch;print(torch.cuda.device_count())"], capture_output=True, text=True
        ).stdout
    )
    for n in (8, 16, 32):
        ps = []
        for i in range(n):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % ngpu))
            ps.append(subprocess.Popen([PY, "-c", CTX], stdout=subprocess.PIPE, text=True, env=env))
        rows = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in ps]
        c = [r["ctx_s"] for r in rows]
        ctx[str(n)] = {
            "ctx_median_s": statistics.median(c),
            "ctx_max_s": max(c),
            "import_median_s": statistics.median(r["import_s"] for r in rows),
            "span_s": max(r["ready"] for r in rows) - min(r["start"] for r in rows),
        }
    res["context_creation"] = ctx
    # 3. Throughput: 16 bench commands on 1 GPU vs spread over all GPUs (C=8 per GPU).
    thr = {}
    for label, gpus in (("1gpu", [0]), (f"{ngpu}gpu", list(range(ngpu)))):
        t0 = time.time()
        ps = [run_under(gpus[i % len(gpus)], BENCH) for i in range(16)]
        for p in ps:
            p.communicate(timeout=600)
        thr[label] = 16 / ((time.time() - t0) / 60)
    res["throughput_cmds_per_min"] = thr
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "multigpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    ind = res["independence"]
    print(
        f"hammer on GPU1: {ind['hammer_rate_in_regions']:.1f}/s during GPU0 regions vs "  # type: ignore[index]
        f"{ind['hammer_rate_outside']:.1f}/s outside ({ind['regions']} regions)"
    )  # type: ignore[index]
    for n, v in ctx.items():
        print(
            f"{n} commands at once: context creation median {v['ctx_median_s']:.2f}s max {v['ctx_max_s']:.2f}s, "  # type: ignore[index]
            f"torch import median {v['import_median_s']:.2f}s"
        )  # type: ignore[index]
    base = thr["1gpu"]
    for k, v in thr.items():
        print(
            f"throughput {k}: {v:.1f} cmds/min (x{v / base:.2f} of one GPU, efficiency {v / base / (1 if k == '1gpu' else ngpu):.2f})"
        )
    print("partition:", json.dumps(res["partition"])[:600])


if __name__ == "__main__":
    main()
