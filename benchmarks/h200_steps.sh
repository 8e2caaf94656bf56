#!/usr/bin/env bash
# Measurement steps on the H200, resumable across device calls (carry .whl and h200run/). STEPS, in the
# order given: topo (CPU topology), short (the short-kernel experiment), settle (benchmarks/gpu_settle.py),
# pacing (benchmarks/gpu_pacing.py: bounded queues on and off),
# autotune (benchmarks/gpu_autotune.py),
# lone (benchmarks/lone_region.py: LONE_ARGS, LONE_TIMEOUT),
# bench (a krex bench that
# compares freeze policies side by side, BENCH_ARGS), entry (region entry while siblings copy
# GB-scale inputs). The bench directory travels as h200run/bench.tgz; everything comes back in $OUT.
#   env: STEPS (default "short bench"), DEADLINE, BENCH_ARGS, BENCH_TIMEOUT (s, default 400),
#   KREX_WHEELS (a folder with a built krex wheel to install instead of this tree: the bench
#   keeps one build across device calls while the tree moves on)
#   KREX_BENCH_DIR (default /tmp/krexbench: a second directory for a second corpus)
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; L=/tmp/h200-steps; B=${KREX_BENCH_DIR:-/tmp/krexbench}; mkdir -p "$L" "$FINAL"
trap 'cp /tmp/krexstate/krexd.log "$L/" 2>/dev/null; tar czf "$FINAL/logs.tgz" -C "$L" . ; [ -d $B ] && tar czf "$FINAL/bench.tgz" -C $B .' EXIT
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  SRC=.; [ -n "${KREX_WHEELS:-}" ] && SRC=$(ls "$KREX_WHEELS"/krex_gpu-*.whl | head -1)
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg "$SRC" > "$L/install.log" 2>&1 || { tail -20 "$L/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate PYTHONUNBUFFERED=1 OUT=$L
K="python3 -m krex.cli.main"; STEPS=${STEPS:-short bench}
if [ ! -d $B ] && [ -f h200run/bench.tgz ]; then mkdir -p $B && tar xzf h200run/bench.tgz -C $B; fi
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv > "$L/versions.txt" 2>&1
# DEADLINE (s since start): later steps get only what is left of it, so the trap's tar still
# runs inside the device call's limit.
left() { local l=$(( ${DEADLINE:-100000} - SECONDS )); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
for step in $STEPS; do case $step in
  topo)  # which vCPUs share a physical core (the region core's neighbour)
  { lscpu -e; grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list; } > "$L/topology.txt" 2>&1
  echo "== topology"; lscpu -e | head -20 ;;
  short)
  echo "== short kernels (variants: benchmarks/gpu_short_kernels.py)"; timeout $(left ${SHORT_TIMEOUT:-200}) python3 "$REPO/benchmarks/gpu_short_kernels.py" 2>"$L/short.err" || tail -5 "$L/short.err" ;;
  bench)
  R="--out $B"; [ -f $B/meta.json ] && R="--resume $B"
  echo "== krex bench $R ${BENCH_ARGS:-}"
  timeout $(left ${BENCH_TIMEOUT:-400}) $K bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" $R ${BENCH_ARGS:-} > "$L/bench-$(date +%s).log" 2>&1
  echo "bench exit $?"; tail -c 3000 $(ls -t "$L"/bench-*.log | head -1) | grep -v '^krex bench: \[' | tail -22 ;;
  settle)  # how long the GPU stays slower after another process frees memory or exits
  echo "== settle after a free or an exit (benchmarks/gpu_settle.py)"; timeout $(left ${SETTLE_TIMEOUT:-200}) python3 "$REPO/benchmarks/gpu_settle.py" ${SETTLE_ARGS:-} 2>"$L/settle.err" | tee "$L/settle.txt" || tail -5 "$L/settle.err" ;;
  autotune)  # does Inductor pick a slower kernel when its autotuning runs under KREX?
  echo "== autotuning under KREX (benchmarks/gpu_autotune.py)"; timeout $(left ${AUTOTUNE_TIMEOUT:-300}) python3 "$REPO/benchmarks/gpu_autotune.py" --out "$L" ${AUTOTUNE_ARGS:-} 2>"$L/autotune.err" | tee "$L/autotune.txt" || tail -5 "$L/autotune.err" ;;
  pacing)  # region entry while siblings queue work: bounded queues on and off (benchmarks/gpu_pacing.py)
  echo "== bounded queues (benchmarks/gpu_pacing.py)"; timeout $(left ${PACING_TIMEOUT:-200}) python3 "$REPO/benchmarks/gpu_pacing.py" --device gpu --out "$L/pacing" ${PACING_ARGS:-} 2>"$L/pacing.err" | tee "$L/pacing.txt" || tail -5 "$L/pacing.err" ;;
  lone)  # each command alone in a region, without one under krex run, and natively (benchmarks/lone_region.py);
         # its runs come back as lone.jsonl in logs.tgz: carry it as h200run/lone.jsonl to continue
  [ -f "$REPO/h200run/lone.jsonl" ] && [ ! -f "$L/lone.jsonl" ] && cp "$REPO/h200run/lone.jsonl" "$L/lone.jsonl"
  echo "== lone region ${LONE_ARGS:-}"; timeout $(left ${LONE_TIMEOUT:-500}) python3 "$REPO/benchmarks/lone_region.py" --device gpu --corpus "$REPO/examples/workloads/manifest.py" --out "$L/lone.jsonl" ${LONE_ARGS:-} > "$L/lone.txt" 2>&1; echo "lone exit $?"; tail -25 "$L/lone.txt" ;;
  entry)
  echo "== region entry while siblings copy GB-scale inputs"; timeout $(left ${ENTRY_TIMEOUT:-150}) python3 "$REPO/benchmarks/gpu_entry_copies.py" 2>"$L/entry.err" || tail -5 "$L/entry.err" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac; done
