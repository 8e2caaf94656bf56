#!/usr/bin/env bash
# Issue 11, throughput: unprotected against krex at C = 8 and 16 (quick corpus plus the
# CPU-heavy family) under each lend_cores setting, one krex bench per setting (its own daemon,
# state directory and segment), in the order ORDER (default "off all"; the second call runs
# "all off", so drift hits both settings alike). Each bench has its own unprotected cells:
# the krex/unprotected ratio is measured side by side inside one bench run.
# carry: .whl. Comes back: lend-<tag>.tgz in $OUT.
set -uo pipefail
REPO=$PWD; RES=${OUT:-/tmp/krex-out}; L=/tmp/olend; mkdir -p "$L" "$RES"
TAG=${TAG:-a}; trap 'tar czf "$RES/lend-$TAG.tgz" -C "$L" .' EXIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . \
  > "$L/install.log" 2>&1 || { tail -20 "$L/install.log"; exit 1; }
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader > "$L/gpu-$TAG.txt"
cd /tmp
for lend in ${ORDER:-off all}; do
  d=$L/$TAG-$lend; T0=$(date +%s)
  KREX_STATE_DIR=/tmp/krexstate-$TAG-$lend KREX_SHM=/krex-$TAG-$lend KREX_LEND_CORES=$lend timeout ${BENCH_TIMEOUT:-280} \
    python3 -m krex.cli.main bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" --quick \
    --modes ${MODES:-unprotected,krex} --concurrency 8,16 --timeout 200 --seed ${SEED:-1} --out "$d" > "$d.log" 2>&1
  echo "lend=$lend exit $? in $(( $(date +%s) - T0 )) s"
  grep -E "^\| *(native-serial|unprotected|krex)-?(8|16)? " "$d/summary.md" | head -16
done
