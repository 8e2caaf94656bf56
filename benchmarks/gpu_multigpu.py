"""KREX on a machine with several GPUs (run by benchmarks/h200_multigpu.sh).

Steps (each writes $OUT/<step>.json; a short table is printed last):
  independence  regions on GPU 0 while a hammer runs on GPU 1, both under `krex run`:
                the hammer's per-iteration timestamps (a time series) against the regions
  ctx           CUDA context creation with N commands starting at once across the GPUs:
                bare, under `krex run`, and with a per-GPU start token (at most K
                contexts created at once per GPU, the candidate fix)
Usage: python3 gpu_multigpu.py STEP [STEP...]"""

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

REGIONS = r"""
import json, sys, time, torch, triton, krex
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
fn = lambda: a @ a
fn(); torch.cuda.synchronize()
iv = []
for _ in range(int(sys.argv[1])):
    with krex.region():
        t0 = time.monotonic()
        triton.testing.do_bench(fn, warmup=10, rep=100)
        t1 = time.monotonic()
    iv.append((t0, t1))
    time.sleep(0.1)
print(json.dumps(iv))
"""

HAMMER = r"""
import json, sys, time, torch
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
stop = time.monotonic() + float(sys.argv[1])
ts = []
while time.monotonic() < stop:
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
    ts.append(time.monotonic())
print(json.dumps(ts))
"""

# The start token: at most K processes of one GPU create their context at once (flock on K
# files); what a launcher could do for its commands.
CTX = r"""
import fcntl, json, os, sys, time
t0 = time.time()
import torch
t1 = time.time()
k = int(sys.argv[1])
lock = None
if k > 0:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    while lock is None:
        for i in range(k):
            f = open(f"/tmp/ctxtok-{gpu}-{i}", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock = f
                break
            except OSError:
                f.close()
        else:
            time.sleep(0.002)
t2 = time.time()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t3 = time.time()
if lock: lock.close()
print(json.dumps({"import_s": t1 - t0, "token_wait_s": t2 - t1, "ctx_s": t3 - t2,
                  "start": t0, "ready": t3}))
"""


def run_under(gpu: int | None, src: str, *args: str, krex: bool = True) -> subprocess.Popen[str]:
    if krex:
        cmd = [*KREX, "run", "--device", "gpu", *(["--gpu", str(gpu)] if gpu is not None else []), "--"]
        env = None
    else:
        cmd = []
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    return subprocess.Popen([*cmd, PY, "-c", src, *args], stdout=subprocess.PIPE, text=True, env=env)


def last_json(p: subprocess.Popen[str]) -> object:
    out, _ = p.communicate(timeout=300)
    return json.loads(out.strip().splitlines()[-1])


def ngpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def independence() -> dict[str, object]:
    h = run_under(1, HAMMER, "30")
    time.sleep(10)  # the hammer is past start-up and steady
    r = run_under(0, REGIONS, "20")
    iv = last_json(r)
    ts = last_json(h)
    assert isinstance(iv, list) and isinstance(ts, list)
    lo, hi = iv[0][0] - 2.0, iv[-1][1] + 2.0
    ts = [t for t in ts if lo <= t <= hi]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    inside = [g for a, g in zip(ts[1:], gaps, strict=False) if any(x <= a <= y for x, y in iv)]
    outside = [g for a, g in zip(ts[1:], gaps, strict=False) if not any(x <= a <= y for x, y in iv)]
    res = {
        "regions": iv,
        "hammer_ts": ts,
        "iter_ms_in_regions": {"n": len(inside), "median": 1e3 * statistics.median(inside),
                               "p99": 1e3 * sorted(inside)[int(0.99 * (len(inside) - 1))],
                               "max": 1e3 * max(inside)},
        "iter_ms_outside": {"n": len(outside), "median": 1e3 * statistics.median(outside),
                            "p99": 1e3 * sorted(outside)[int(0.99 * (len(outside) - 1))],
                            "max": 1e3 * max(outside)},
    }
    try:  # the picture: hammer iterations per 50 ms on GPU 1, GPU 0's regions shaded
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = lo
        nb = int((hi - lo) / 0.05) + 1
        bins = [0] * nb
        for t in ts:
            bins[min(nb - 1, int((t - lo) / 0.05))] += 1
        fig, ax = plt.subplots(figsize=(10, 3.2))
        ax.plot([i * 0.05 for i in range(nb)], [b / 0.05 for b in bins], lw=0.8, label="GPU 1 hammer")
        for a, b in iv:
            ax.axvspan(a - t0, b - t0, color="tab:red", alpha=0.25, lw=0)
        ax.set_xlabel("seconds")
        ax.set_ylabel("hammer iterations / s (GPU 1)")
        ax.set_title("A region on GPU 0 (shaded) does not slow a command on GPU 1")
        ax.set_ylim(bottom=0)
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "independence.png"), dpi=110)
    except Exception as e:  # the numbers stand without the picture
        res["plot_error"] = repr(e)
    return res


def ctx() -> dict[str, object]:
    n_gpu = ngpus()
    out: dict[str, object] = {}
    variants = (("bare", 0, False), ("krex-run", 0, True), ("token-2", 2, False))
    for n in (8, 16, 32):
        for label, k, under in variants:
            if label != "bare" and n == 8:
                continue
            ps = [run_under(i % n_gpu, CTX, str(k), krex=under) for i in range(n)]
            rows = [last_json(p) for p in ps]
            c = [r["ctx_s"] for r in rows]  # type: ignore[index]
            out[f"{label}-{n}"] = {
                "n": n,
                "variant": label,
                "ctx_median_s": statistics.median(c),
                "ctx_max_s": max(c),
                "token_wait_median_s": statistics.median(r["token_wait_s"] for r in rows),  # type: ignore[index]
                "import_median_s": statistics.median(r["import_s"] for r in rows),  # type: ignore[index]
                "span_s": max(r["ready"] for r in rows) - min(r["start"] for r in rows),  # type: ignore[index]
            }
    # One context alone, for the baseline.
    one = last_json(run_under(0, CTX, "0", krex=False))
    out["single"] = one
    return out


def scaling() -> dict[str, object]:
    """Bench A (C per GPU on GPU 0 alone, with native-serial) against bench B (the same C on
    each of all GPUs, the corpus repeated once per GPU): throughput scaling and, per GPU,
    B's inflation against A's native-serial medians."""
    from pathlib import Path

    from krex.bench import metrics as bm

    a_dir, b_dir = Path(os.environ["BENCH_A"]), Path(os.environ["BENCH_B"])
    sa = json.loads((a_dir / "summary.json").read_text())
    sb = json.loads((b_dir / "summary.json").read_text())
    ref = sa["reference"]["ms"]
    ka = next(t for t in sa["throughput"] if t["mode"] == "krex")
    kb = next(t for t in sb["throughput"] if t["mode"] == "krex")
    n = len(json.loads((b_dir / "meta.json").read_text())["gpus"])
    per_gpu: dict[str, dict[str, object]] = {}
    recs = [json.loads(ln) for ln in (b_dir / "raw.jsonl").read_text().splitlines()]
    for g in sorted({r.get("gpu") for r in recs if r.get("mode") == "krex"}):
        pairs = [(ref[r["name"]], r["result"]["ms"]) for r in recs
                 if r.get("mode") == "krex" and r.get("gpu") == g and r.get("ok") and r["name"] in ref]
        per_gpu[str(g)] = {"n": len(pairs), **{b: bm.dist(v).to_json() for b, v in bm.inflation_by_band(pairs).items()}}
    one = [(ref[r["name"]], r["result"]["ms"]) for r in (json.loads(ln) for ln in (a_dir / "raw.jsonl").read_text().splitlines())
           if r.get("mode") == "krex" and r.get("ok") and r["name"] in ref]
    return {
        "one_gpu": {"cell": ka["cell"], "cmds_per_min": ka["cmds_per_min"], "makespan_s": ka["makespan_s"],
                    "runs": ka["n_runs"], "failures": ka["failures"]},
        "all_gpus": {"cell": kb["cell"], "gpus": n, "cmds_per_min": kb["cmds_per_min"], "makespan_s": kb["makespan_s"],
                     "runs": kb["n_runs"], "failures": kb["failures"]},
        "native_cpm": sa["native_cpm"],
        "efficiency": kb["cmds_per_min"] / (n * ka["cmds_per_min"]),
        "inflation_one_gpu": {b: bm.dist(v).to_json() for b, v in bm.inflation_by_band(one).items()},
        "inflation_per_gpu": per_gpu,
    }


def main() -> None:
    steps = sys.argv[1:] or ["independence", "ctx"]
    for step in steps:
        res = {"independence": independence, "ctx": ctx, "scaling": scaling}[step]()
        with open(os.path.join(OUT, f"{step}.json"), "w") as f:
            json.dump(res, f, indent=1)
        if step == "independence":
            a, b = res["iter_ms_in_regions"], res["iter_ms_outside"]  # type: ignore[index]
            print(f"hammer on GPU 1, ms per iteration: during GPU 0's {len(res['regions'])} regions "  # type: ignore[arg-type]
                  f"median {a['median']:.3f} p99 {a['p99']:.3f} max {a['max']:.3f} (n={a['n']}); "
                  f"outside median {b['median']:.3f} p99 {b['p99']:.3f} max {b['max']:.3f} (n={b['n']})")
        elif step == "scaling":
            o, a = res["one_gpu"], res["all_gpus"]  # type: ignore[index]
            print(f"krex bench, C per GPU: one GPU {o['cmds_per_min']:.1f} cmds/min ({o['runs']} runs, "
                  f"{o['failures']} failed); {a['gpus']} GPUs {a['cmds_per_min']:.1f} cmds/min ({a['runs']} runs, "
                  f"{a['failures']} failed); scaling efficiency {res['efficiency']:.2f}; native serial "
                  f"{res['native_cpm']:.1f}")
            for g, bands in [("one-gpu run", res["inflation_one_gpu"]), *[(f"gpu {k}", v) for k, v in res["inflation_per_gpu"].items()]]:  # type: ignore[union-attr]
                print(f"  inflation {g}: " + ", ".join(
                    f"{b} p50 {100 * d['p50']:.2f}% p95 {100 * d['p95']:.2f}% (n={d['n']})"
                    for b, d in bands.items() if isinstance(d, dict) and d.get("n")))
        else:
            print(f"single context: {res['single']['ctx_s']:.3f} s")  # type: ignore[index]
            for k, v in res.items():
                if k != "single":
                    print(f"ctx {k:>12}: ctx median {v['ctx_median_s']:.2f}s max {v['ctx_max_s']:.2f}s "  # type: ignore[index]
                          f"token wait median {v['token_wait_median_s']:.2f}s "  # type: ignore[index]
                          f"import median {v['import_median_s']:.2f}s span {v['span_s']:.2f}s")  # type: ignore[index]


if __name__ == "__main__":
    main()
