#!/usr/bin/env bash
# Issue 4 on the H200: the isolated fast-path cost and region-entry latency (STEPS has
# "probe"), then `krex bench` on the GPU corpus (STEPS has "bench"), resumable across calls:
# the results directory lives in /tmp/krexbench on a warm machine, else it is unpacked from
# h200run/bench.tgz (carry h200run). Everything comes back in $OUT (bench.tgz, logs.tgz).
#   env: STEPS ("smoke probe bench"; smoke: the changed matmul commands once, all at once), BENCH_ARGS (bench options), BENCH_TIMEOUT (s, default 420)
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; LOGS=/tmp/krexlogs; B=/tmp/krexbench
mkdir -p "$LOGS" "$FINAL"
trap 'tar czf "$FINAL/logs.tgz" -C "$LOGS" . ; [ -d $B ] && tar czf "$FINAL/bench.tgz" -C $B .' EXIT
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . > "$LOGS/install.log" 2>&1 || { tail -20 "$LOGS/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate PYTHONUNBUFFERED=1
if [ ! -d $B ] && [ -f h200run/bench.tgz ]; then mkdir -p $B && tar xzf h200run/bench.tgz -C $B; fi
cd /tmp
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__)'; } > "$LOGS/versions.txt" 2>&1
case " ${STEPS:-probe bench} " in *" smoke "*)
  echo "== smoke: matmul-k, matmul-tiles, mm-epilogue once each, concurrently (correctness only)"
  python3 - "$REPO/examples/workloads/manifest.py" <<'PY'
import subprocess, sys, json
from pathlib import Path
from krex.bench import load_corpus
ws = [w for w in load_corpus(Path(sys.argv[1]), "gpu", False, None)
      if (w.family or "").startswith("matmul") or "mm-epilogue" in w.name]
bad = 0
ps = [(w, subprocess.Popen(w.argv(sys.executable), cwd=str(w.script.parent), stdout=subprocess.PIPE,
       stderr=subprocess.PIPE, text=True)) for w in ws]
for w, p in ps:
    out, err = p.communicate(timeout=240)
    line = next((json.loads(l) for l in out.splitlines()[::-1] if l.startswith("{")), None)
    print(f"{w.name:34s} rc={p.returncode}", f"ms={line['ms']:.3f} correct={line['correct']}" if line else err[-400:])
    bad += not (p.returncode == 0 and line and line["correct"])
sys.exit(1 if bad else 0)
PY
  [ $? = 0 ] || { echo "smoke failed: no bench"; exit 1; } ;;
esac
case " ${STEPS:-probe bench} " in *" probe "*)
  echo "== fast path (isolated gate cost)"
  python3 "$REPO/scripts/fastpath/run.py" 7 | tee "$LOGS/fastpath_micro.json"
  echo "== region entry latency (parallel freeze)"
  python3 -m krex.cli.main daemon start --device gpu --slots-per-gpu 16 > /dev/null || exit 1
  OUT=$LOGS timeout 110 python3 "$REPO/scripts/gpu_fidelity.py" --latency-only 2>&1 | tail -3 | tee "$LOGS/latency.txt"
  python3 -m krex.cli.main daemon stop > /dev/null ;;
esac
case " ${STEPS:-probe bench} " in *" bench "*)
  echo "== krex bench $BENCH_ARGS"
  R=""; [ -f $B/meta.json ] && R="--resume $B" || R="--out $B"
  timeout ${BENCH_TIMEOUT:-420} python3 -m krex.cli.main bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" $R ${BENCH_ARGS:-} > "$LOGS/bench-$(date +%s).log" 2>&1
  echo "bench exit $?"; tail -c 2500 "$LOGS"/bench-*.log | grep -v '^krex bench: \[' | tail -25
  python3 - <<'PY'
import json, collections
c = collections.Counter(); bad = []
for l in open("/tmp/krexbench/raw.jsonl"):
    r = json.loads(l); c[r["cell"]] += 1
    if not r["ok"]: bad.append((r["cell"], r["name"], (r.get("error") or "")[:80], (r.get("stderr_tail") or "")[-200:]))
print("raw runs per cell:", dict(c))
print("cells done:", [json.loads(l)["cell"] for l in open("/tmp/krexbench/cells.jsonl")] if __import__("os").path.exists("/tmp/krexbench/cells.jsonl") else [])
for b in bad[:8]: print("FAILED", b)
PY
  ;;
esac
