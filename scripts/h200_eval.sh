#!/usr/bin/env bash
# Issues 2-4 on the H200, final pass: the isolated fast-path cost, region-entry latency with
# parallel freezing, then `krex bench` on the GPU corpus. Everything lands in $OUT/results.tgz.
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; export OUT=/tmp/krexlogs; mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" .' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate
cd /tmp
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__)'; } > "$OUT/versions.txt" 2>&1
echo "== fast path (isolated gate cost)"
python3 "$REPO/scripts/fastpath/run.py" 7 | tee "$OUT/fastpath_micro.json"
echo "== region entry latency (parallel freeze)"
python3 -m krex.cli.main daemon start --device gpu --slots-per-gpu 16 > /dev/null || exit 1
timeout 150 python3 "$REPO/scripts/gpu_fidelity.py" --latency-only 2>&1 | tail -3 | tee "$OUT/latency.txt"
python3 -m krex.cli.main daemon stop > /dev/null
echo "== krex bench"
BENCH_ARGS=${BENCH_ARGS:-}
timeout ${BENCH_TIMEOUT:-420} python3 -m krex.cli.main bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" --out "$OUT/bench" $BENCH_ARGS 2>&1 | tail -40
