#!/usr/bin/env bash
# The agent-loop work on one real GPU, one device call (carry .whl .whl-new), about 4 minutes:
#  1. examples/agent_loop/agent_loop.py --device gpu: Triton candidates proposed, screened with
#     krex.Executor, compared with Executor.compare, the faster kept (2 rounds);
#  2. `krex compare` of two Triton candidates from the command line, with pyperf JSON;
#  3. NVTX ranges as regions on real CUDA: examples/nvtx/nvtx_bench.cu (nvcc, shared cudart)
#     under KREX_NVTX_REGION=timed: one region, labelled nvtx:timed, and nothing else.
# Everything comes back in $OUT (logs, compare.json, pyperf/, nvtx.json, agent_loop.log).
# .whl holds the support wheels the other H200 scripts use; build this tree's wheel first, here:
#   rm -rf .whl-new && python3 -m pip wheel -q --no-deps -w .whl-new .
set -uo pipefail
REPO=$PWD; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
if [ ! -d /tmp/krexpkg/krex ]; then  # (benchmarks/h200_env.sh builds this checkout there instead)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg \
    .whl-new/krex_gpu-*.whl > "$O/install.log" 2>&1 || { tail -20 "$O/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1 KREX_STATE_DIR=/tmp/krexstate-agent
KREX=(python3 -m krex.cli.main)
cd /tmp
nvidia-smi -L | head -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1. agent loop (Executor + Executor.compare), Triton candidates"
timeout 170 python3 "$REPO/examples/agent_loop/agent_loop.py" --device gpu --rounds 2 --max-runs 12 --jobs 4 \
  > "$O/agent_loop.log" 2>&1
echo "rc=$?"; grep -v '^{' "$O/agent_loop.log" | tail -8

echo "== 2. krex compare, two Triton candidates"
CAND="python3 $REPO/examples/agent_loop/triton_candidate.py"
timeout 110 "${KREX[@]}" compare --device gpu --figure do_bench --auto-region do_bench -j 4 --max-runs 12 \
  --names b1024w4,b256w1 --pyperf "$O/pyperf" --out "$O/compare-runs" --json \
  "$CAND --block 1024 --warps 4" "$CAND --block 256 --warps 1" > "$O/compare.json" 2> "$O/compare.log"
echo "rc=$?"; tail -3 "$O/compare.log"
python3 - "$O/compare.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["ratios"]:
    print(f"{r['name']}: ratio {r['ratio']} [{r['low']}, {r['high']}] p_wrong {r['p_wrong']} {r['verdict']}, "
          f"{r['runs']}+{r['base_runs']} runs; settled {d['settled']}; simulated {d['simulated']}")
print("runs left out:", [x["left_out"] for x in d["runs"] if x["left_out"]])
print("regions per run:", sorted({x["regions"] for x in d["runs"]}))
EOF

echo "== 3. NVTX ranges as regions (real CUDA)"
NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
if [ -z "$NVCC" ]; then echo "no nvcc: skipped"; else
  INC=$(dirname "$NVCC")/../include
  "$NVCC" -O2 -cudart shared -I"$INC" "$REPO/examples/nvtx/nvtx_bench.cu" -o /tmp/nvtx_bench || exit 1
  KREX_NVTX_REGION=timed timeout 40 "${KREX[@]}" run --device gpu --report "$O/nvtx.json" -- /tmp/nvtx_bench
  echo "rc=$?"
  KREX_NVTX_REGION=nothing timeout 40 "${KREX[@]}" run --device gpu --report "$O/nvtx-none.json" -- /tmp/nvtx_bench
  python3 - "$O/nvtx.json" "$O/nvtx-none.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("KREX_NVTX_REGION=timed:", [(x.get("label"), round(x["region_s"], 6), x["flags"]) for x in r["regions"]])
print("KREX_NVTX_REGION=nothing:", json.load(open(sys.argv[2]))["regions"])
EOF
fi
"${KREX[@]}" daemon stop
ls "$O"
