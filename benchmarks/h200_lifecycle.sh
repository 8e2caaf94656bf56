#!/usr/bin/env bash
# The LIFE-call experiment under KREX on the H200, one device call (carry .whl .whl-new):
# benchmarks/gpu_lifecycle.py's siblings, each its own `krex run`, against an owner that times
# every round inside a region (--freeze gpu, then POLICIES). Output in $OUT. Build first:
#   rm -rf .whl-new && python3 -m pip wheel -q --no-deps -w .whl-new .
set -uo pipefail
REPO=$PWD; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg \
  .whl-new/krex_gpu-*.whl > "$O/install.log" 2>&1 || { tail -20 "$O/install.log"; exit 1; }
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1 KREX_STATE_DIR=/tmp/krexstate-life OUT="$O"
cd /tmp
for pol in ${POLICIES:-gpu}; do
  echo "== LIFE calls under krex, --freeze $pol"
  timeout ${LIFE_TIMEOUT:-300} python3 "$REPO/benchmarks/gpu_lifecycle.py" --krex /tmp/krexpkg/bin/krex --freeze $pol \
    > "$O/lifecycle-krex-$pol.log" 2> "$O/lifecycle-krex-$pol.err"
  echo "rc=$?"; cat "$O/lifecycle-krex-$pol.log"; tail -3 "$O/lifecycle-krex-$pol.err"
done
python3 -m krex.cli.main daemon stop > /dev/null 2>&1 || true
