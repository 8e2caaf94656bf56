"""On the H200: why short torch.compile kernels inflate under krex at C >= 8.

One owner (a torch.compile'd layer-norm + GELU over 4096x4096 fp32, about 0.05-0.13 ms)
times 100 trials with CUDA events inside each of 5 regions. Siblings run under `krex run`.
Variants change one thing at a time:
- native: the owner alone without KREX (no daemon, no shim, no region);
- alone: under krex run, no siblings;
- busy-N-POLICY: N siblings that keep every shared core busy (torch CPU matmuls on all
  their intra-op threads) and submit a GPU matmul every iteration, the region freezing them
  (policy all) or not (policy gpu: they keep their CPU work and park at the gate);
- busy-7-all-unpin: as busy-7-all, but the owner moves its measuring thread back to its
  command cores right after entry (pinning off);
- hold-7-all: 7 idle siblings each holding SK_GB GB of GPU memory (the footprint alone).
Per variant: GPU time per trial (events) and the CPU time the owner's thread spent
launching it (perf_counter around the launch), min / p10 / median / p90 / max; krexd's CPU
time over the owner's run; the SM clock before and after. JSON to $OUT/short_kernels.json.
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
ENV = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/tmp/sk-inductor"}

OWNER = r"""
import json, os, sys, time, torch, krex
import torch.nn.functional as F
def fn(x, w, b):
    return F.gelu(F.layer_norm(x, (x.shape[-1],)) * w + b) + x
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(4096, 4096, device="cuda", generator=g)
w = torch.randn(4096, device="cuda", generator=g); b = torch.randn(4096, device="cuda", generator=g)
cfn = torch.compile(fn)
for _ in range(20): cfn(x, w, b)
torch.cuda.synchronize()
open(sys.argv[1], "w").close()  # compiled and warm: measure once the siblings run
while not os.path.exists(sys.argv[2]): time.sleep(0.05)
unpin = os.environ.get("SK_UNPIN") == "1"
mine = os.sched_getaffinity(0)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ms, cpu_us, grants, cpus = [], [], [], []
for r in range(5):
    time.sleep(0.3)
    with krex.region() as reg:
        if unpin:
            os.sched_setaffinity(0, mine)
        cpus.append(sorted(os.sched_getaffinity(0)))
        for _ in range(100):
            t0 = time.perf_counter()
            s.record(); cfn(x, w, b); e.record()
            cpu_us.append((time.perf_counter() - t0) * 1e6)
            e.synchronize()
            ms.append(s.elapsed_time(e))
    gr = getattr(reg, "grant", None) or {}
    grants.append({k: gr.get(k) for k in ("freeze_policy", "frozen_slots", "running_slots", "contaminated",
                                          "entry_s", "reserved_cpus", "flags")})
print(json.dumps({"ms": ms, "cpu_us": cpu_us, "grants": grants, "cpus": cpus[:1]}))
"""

SIBLING = r"""
import os, sys, time, torch
torch.set_num_threads(2)  # 7 siblings x 2 threads fill the 14 command cores without oversubscribing
gb, mode = float(sys.argv[1]), sys.argv[4]
hold = torch.empty(int(gb * (1 << 30)), dtype=torch.uint8, device="cuda") if gb > 0 else None
if hold is not None: hold.fill_(1)
a = torch.randn(2048, 2048, device="cuda")
c = torch.randn(1024, 1024)
torch.cuda.synchronize()
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    if mode == "busy":
        for _ in range(4): c = torch.tanh(c @ c)  # every intra-op thread busy
        (a @ a).sum().item()
    else:
        (a @ a).sum().item(); time.sleep(0.05)
"""


def daemon(start: bool) -> None:
    # A daemon left by an earlier, interrupted run would make the start fail (exit 6).
    subprocess.run([*KREX, "daemon", "stop"], capture_output=True, env=ENV)
    if start:
        subprocess.run([*KREX, "daemon", "start", "--device", "gpu", "--slots-per-gpu", "16"], check=True,
                       capture_output=True, env=ENV)


def krexd_cpu_s() -> float:
    tot = 0.0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ")
            if b"krex" in cmd and b"daemon" in cmd and b" run" not in cmd:
                with open(f"/proc/{p}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
                tot += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return tot


def sm_clock() -> str:
    p = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return p.stdout.strip()


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def variant(label: str, n_sib: int, gb: float, mode: str, policy: str, unpin: bool = False,
            native: bool = False) -> dict[str, object]:
    if not native:
        daemon(True)
    tag = f"/tmp/sk-{label}"
    sibs = []
    env = {**ENV, "SK_UNPIN": "1" if unpin else "0"}
    log = open(os.path.join(OUT, f"short-{label}.log"), "w")  # noqa: SIM115 - closed in finally
    owner = None
    try:
        for i in range(n_sib):
            sibs.append(subprocess.Popen([*KREX, "run", "--device", "gpu", "--", PY, "-c", SIBLING, str(gb),
                                          f"{tag}-ready{i}", f"{tag}-stop", mode], env=ENV, stdout=log,
                                         stderr=log))
        argv = [PY, "-c", OWNER] if native else [*KREX, "run", "--device", "gpu", "--freeze", policy, "--", PY,
                                                  "-c", OWNER]
        owner = subprocess.Popen([*argv, f"{tag}-owner-ready", f"{tag}-go"], env=env, stdout=subprocess.PIPE,
                                 stderr=log, text=True)
        need = [f"{tag}-ready{i}" for i in range(n_sib)] + [f"{tag}-owner-ready"]
        deadline = time.time() + 90
        while any(not os.path.exists(f) for f in need) and time.time() < deadline and owner.poll() is None:
            time.sleep(0.2)
        missing = [f for f in need if not os.path.exists(f)]
        if missing:
            raise RuntimeError(f"not ready after 90 s: {missing}")
        time.sleep(2 if n_sib else 0)  # let the siblings settle into their loop
        clk0, cpu0 = sm_clock(), krexd_cpu_s()
        open(f"{tag}-go", "w").close()
        out, _ = owner.communicate(timeout=60)
        cpu1, clk1 = krexd_cpu_s(), sm_clock()
        res = json.loads(out.strip().splitlines()[-1])
    finally:
        open(f"{tag}-stop", "w").close()
        if owner is not None and owner.poll() is None:
            owner.kill()
        for s in sibs:
            try:
                s.wait(timeout=60)
            except subprocess.TimeoutExpired:
                s.kill()
        if not native:
            daemon(False)
        log.close()
    ms, cu = res["ms"], res["cpu_us"]
    return {"label": label, "siblings": n_sib, "gb": gb, "mode": mode, "policy": policy, "unpin": unpin,
            "native": native, "min": min(ms), "p10": pct(ms, 0.1), "median": statistics.median(ms),
            "p90": pct(ms, 0.9), "max": max(ms), "cpu_us_median": statistics.median(cu), "cpu_us_p90": pct(cu, 0.9),
            "n": len(ms), "krexd_cpu_s": round(cpu1 - cpu0, 3), "clock_before": clk0, "clock_after": clk1,
            "cpus": res["cpus"], "grants": res["grants"], "ms": ms, "cpu_us": cu}


def main() -> None:
    gb = float(os.environ.get("SK_GB", "13"))
    plan = [("native", 0, 0.0, "idle", "all", False, True),
            ("alone", 0, 0.0, "idle", "all"),
            ("busy-7-all", 7, 0.0, "busy", "all"),
            ("busy-7-all-unpin", 7, 0.0, "busy", "all", True),
            ("busy-7-gpu", 7, 0.0, "busy", "gpu"),
            ("hold-7-all", 7, gb, "idle", "all"),
            ("busy-15-all", 15, 0.0, "busy", "all"),
            ("busy-3-all", 3, 0.0, "busy", "all")]
    only = os.environ.get("SK_ONLY")
    rows = []
    print(f"{'variant':>17} {'min':>7} {'p10':>7} {'median':>7} {'p90':>7} {'max':>7} ms | launch CPU us "
          f"p50/p90 | krexd CPU s | frozen | clock before -> after", flush=True)
    for args in plan:
        if only and args[0] not in only.split(","):
            continue
        try:
            rows.append(variant(*args))  # type: ignore[arg-type]
        except Exception as e:  # one failed variant must not lose the others
            print(f"{args[0]:>17}: failed: {e!r}", flush=True)
            continue
        r = rows[-1]
        fz = [len(g["frozen_slots"] or []) for g in r["grants"]][:1] if not r["native"] else "-"
        print(f"{r['label']:>17} {r['min']:7.4f} {r['p10']:7.4f} {r['median']:7.4f} {r['p90']:7.4f} {r['max']:7.4f}"
              f" | {r['cpu_us_median']:6.1f}/{r['cpu_us_p90']:6.1f} | {r['krexd_cpu_s']:5.2f} | {fz} | "
              f"{r['clock_before']} -> {r['clock_after']}", flush=True)
        with open(os.path.join(OUT, "short_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
