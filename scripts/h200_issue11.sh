#!/usr/bin/env bash
# Issue 11 on the H200, resumable across device calls (carry .whl and h200run/): a krex bench
# that compares freeze policies side by side (BENCH_ARGS), then the short-kernel experiment
# (STEPS has "short") and the entry-latency probe with GB-scale sibling copies (STEPS has
# "entry"). The bench directory travels as h200run/bench.tgz; everything comes back in $OUT.
#   env: STEPS (default "bench short"), BENCH_ARGS, BENCH_TIMEOUT (s, default 400)
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; L=/tmp/i11; B=/tmp/krexbench; mkdir -p "$L" "$FINAL"
trap 'tar czf "$FINAL/logs.tgz" -C "$L" . ; [ -d $B ] && tar czf "$FINAL/bench.tgz" -C $B .' EXIT
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . > "$L/install.log" 2>&1 || { tail -20 "$L/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate PYTHONUNBUFFERED=1 OUT=$L
K="python3 -m krex.cli.main"; STEPS=" ${STEPS:-bench short} "
if [ ! -d $B ] && [ -f h200run/bench.tgz ]; then mkdir -p $B && tar xzf h200run/bench.tgz -C $B; fi
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv > "$L/versions.txt" 2>&1
case $STEPS in *" bench "*)
  R="--out $B"; [ -f $B/meta.json ] && R="--resume $B"
  echo "== krex bench $R ${BENCH_ARGS:-}"
  timeout ${BENCH_TIMEOUT:-400} $K bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" $R ${BENCH_ARGS:-} > "$L/bench-$(date +%s).log" 2>&1
  echo "bench exit $?"; tail -c 3000 $(ls -t "$L"/bench-*.log | head -1) | grep -v '^krex bench: \[' | tail -22 ;;
esac
case $STEPS in *" short "*)
  echo "== short kernels (7 siblings, 13 GB each)"; timeout ${SHORT_TIMEOUT:-200} python3 "$REPO/scripts/gpu_short_kernels.py" 2>"$L/short.err" || tail -5 "$L/short.err" ;;
esac
case $STEPS in *" entry "*)
  echo "== region entry while siblings copy GB-scale inputs"; timeout ${ENTRY_TIMEOUT:-150} python3 "$REPO/scripts/gpu_entry_copies.py" 2>"$L/entry.err" || tail -5 "$L/entry.err" ;;
esac
