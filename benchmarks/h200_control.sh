#!/usr/bin/env bash
# On the H200: install as a wheel would, re-check coverage (graph capture + drain),
# pause/resume, fast path, freezer on pure cgroup v2, then fidelity and region-entry latency.
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; export OUT=/tmp/krexlogs; mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" .' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 setup.py -q build_ext --inplace >> "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate
cd /tmp
python3 -m krex.cli.main doctor > "$OUT/doctor.txt" 2>&1; tail -25 "$OUT/doctor.txt"
echo "== freezer tests on pure cgroup v2"
(cd "$REPO" && PYTHONPATH=$REPO:/tmp/site timeout 300 python3 -m pytest -q -p no:cacheprovider tests/integration/test_freezer.py 2>&1 | tail -3) | tee "$OUT/freezer_tests.txt"
echo "== coverage"
python3 - <<'PY' 2>&1 | grep -v Warn | tee "$OUT/coverage.log"
import json, os
from krex.doctor.coverage import run_all
rows = run_all()
json.dump([r.__dict__ for r in rows], open(os.environ['OUT'] + '/coverage.json', 'w'), indent=1)
for r in rows:
    print(f"{r.workload:12s} ok={r.ok} shim={r.shim} cupti={r.cupti} exp_k={r.expected_kernels} exp_c={r.expected_copies} {r.note}")
PY
echo "== fast path"
nvcc -O2 -cudart shared -arch=sm_90 "$REPO/benchmarks/gpu/launch_rate.cu" -o /tmp/launch_rate -L/usr/local/cuda/lib64/stubs -lcuda > "$OUT/nvcc.log" 2>&1 || cat "$OUT/nvcc.log"
python3 "$REPO/benchmarks/gpu_fastpath.py" /tmp/launch_rate 7 100000 > "$OUT/fastpath.json" 2>&1; python3 -c "
import json; d=json.load(open('$OUT/fastpath.json'))
for r in d['rows']: print(f\"{r['mode']:4s} base {r['base_ns']:.1f} ns  shim {r['shim_ns']:.1f} ns  added {r['added_ns']:+.1f} ns  ratio {r['rate_ratio']:.3f}\")"
echo "== daemon + pause demo"
python3 -m krex.cli.main daemon start --device gpu --slots-per-gpu 16 || exit 1
python3 -m krex.cli.main daemon status | tee "$OUT/daemon_status.txt"
python3 "$REPO/benchmarks/gpu_pause_demo.py" > "$OUT/pause.json" 2>&1; tail -c 1500 "$OUT/pause.json"; echo
echo "== fidelity"
timeout 420 python3 "$REPO/benchmarks/gpu_fidelity.py" 2>&1 | tail -8 | tee "$OUT/fidelity.txt"
python3 -m krex.cli.main journal -n 12 > "$OUT/journal_tail.txt" 2>&1
cp "$KREX_STATE_DIR/journal.jsonl" "$OUT/journal.jsonl" 2>/dev/null
python3 -m krex.cli.main daemon stop
