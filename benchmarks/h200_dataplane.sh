#!/usr/bin/env bash
# On the H200: build, coverage vs CUPTI, pause demo, fast-path cost.
# Run from the repo root on the device machine; logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/krex-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c 'import torch,triton;print(torch.__version__,triton.__version__,torch.version.cuda)'; uname -a; } > "$OUT/versions.txt" 2>&1
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== coverage"
python3 - <<'PY' 2>&1 | tee "$OUT/coverage.log"
import json
from krex.doctor.coverage import run_all
rows = run_all()
json.dump([r.__dict__ for r in rows], open(__import__('os').environ['OUT'] + '/coverage.json', 'w'), indent=1)
for r in rows:
    print(f"{r.workload:12s} ok={r.ok} shim={r.shim} cupti={r.cupti} exp_k={r.expected_kernels} exp_c={r.expected_copies} {r.note}")
PY
echo "== pause demo"
python3 benchmarks/gpu_pause_demo.py 2>&1 | tee "$OUT/pause.json" | tail -c 3000
echo "== fast path"
nvcc -O2 -cudart shared -arch=sm_90 benchmarks/gpu/launch_rate.cu -o /tmp/launch_rate -lcuda > "$OUT/nvcc.log" 2>&1 || cat "$OUT/nvcc.log"
python3 benchmarks/gpu_fastpath.py /tmp/launch_rate 7 200000 2>&1 | tee "$OUT/fastpath.json"
