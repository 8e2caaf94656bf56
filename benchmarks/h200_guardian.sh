#!/usr/bin/env bash
# On the H200, one device call (carry .whl .whl-new): what `krex run` adds with 16
# commands starting at once (the native guardian), then one krex-8@gpu cell of the quick corpus to see `sibling-context`
# flag regions that run slow while siblings start or end their GPU contexts (docs/results/lifecycle-calls/).
# Everything comes back in $OUT. Build the wheel of this tree first, here:
#   rm -rf .whl-new && python3 -m pip wheel -q --no-deps -w .whl-new .
set -uo pipefail
REPO=$PWD; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg \
  .whl-new/krex_gpu-*.whl > "$O/install.log" 2>&1 || { tail -20 "$O/install.log"; exit 1; }
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1
cd /tmp; file /tmp/krexpkg/bin/krex | cut -c1-80
for g in native; do
  timeout ${OVH_TIMEOUT:-75} python3 "$REPO/benchmarks/run_overhead.py" --krex-bin /tmp/krexpkg/bin/krex \
    --device gpu -n 16 -r ${ROUNDS:-3} --out "$O/overhead-$g" > "$O/overhead-$g.log" 2>&1
  echo "== krex run overhead, $g guardian (rc=$?)"; tail -4 "$O/overhead-$g.log"
done
KREX_STATE_DIR=/tmp/krexstate-flag timeout ${BENCH_TIMEOUT:-100} python3 -m krex.cli.main bench --device gpu \
  --corpus "$REPO/examples/workloads/manifest.py" --quick --modes krex --concurrency 8 --freeze gpu --timeout 100 \
  --seed 3 --no-plots --out "$O/gpuflag" > "$O/gpuflag.log" 2>&1
echo "== krex-8@gpu (rc=$?)"; grep -E "^\| krex-8" "$O/gpuflag/summary.md" | tail -2
