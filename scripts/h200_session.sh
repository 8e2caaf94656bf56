#!/usr/bin/env bash
# Several issues' H200 checks in ONE device call (one machine start), installing once:
#   issue 12: the shipped manylinux wheel (zig-built, glibc 2.17) on the real CUDA stack:
#             doctor, Inductor autotune and pytest-benchmark regions (scripts/h200_issue12.sh)
#   issue 14: `krex fleet` on a one-node Ray cluster against `krex batch` (fleet_overhead.py)
#   issue 11: lending the region core (KREX_LEND_CORES) or not: unprotected-8 and krex-8 on the
#             quick corpus, once with each setting (two bench directories, back to back)
# Carry .whl (posix_ipc), .whl-fleet (slimmed Ray + deps + cffi; scripts/fleet_wheels.sh) and
# .whl-krex (the wheel built here: pip wheel --no-deps -w .whl-krex .). Results in $OUT.
#   env: STEPS (default "i12 fleet lend")
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; mkdir -p "$FINAL"; STEPS=" ${STEPS:-i12 fleet lend} "
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/posix_ipc*.whl .whl-fleet/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/krexpkg .whl-krex/krex_gpu-*.whl || exit 1
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1
python3 -c 'import krex, ray; print("krex from", krex.__file__, "ray", ray.__version__)'
case $STEPS in *" i12 "*)
  echo "== issue 12: the wheel on the real stack"; mkdir -p /tmp/o12
  (OUT=/tmp/o12 timeout 240 bash scripts/h200_issue12.sh 2>&1 | tail -8)
  tar czf "$FINAL/i12.tgz" -C /tmp/o12 . ;;
esac
case $STEPS in *" fleet "*)
  echo "== issue 14: krex fleet against krex batch"; mkdir -p /tmp/ofl /tmp/fleetwork
  (cd /tmp/fleetwork && KREX_STATE_DIR=/tmp/krexstate-fleet KREX_SHM=/krex-fleet timeout 330 \
     python3 "$REPO/scripts/fleet_overhead.py" --device gpu --slots 16 --corpus-slots 8 --serial 20 \
     --trivial 100 ${FLEET_ARGS:---no-corpus} --corpus "$REPO/examples/workloads/manifest.py" --timeout 150 --out /tmp/ofl/runs \
     > /tmp/ofl/table.txt 2>&1; tail -16 /tmp/ofl/table.txt)
  tar czf "$FINAL/fleet.tgz" -C /tmp/ofl . ;;
esac
case $STEPS in *" lend "*)
  echo "== issue 11: region core lent or not (unprotected-8 vs krex-8, quick corpus)"; mkdir -p /tmp/olend
  for lend in 0 1; do
    (cd /tmp && KREX_STATE_DIR=/tmp/krexstate-lend$lend KREX_LEND_CORES=$lend timeout 200 python3 -m krex.cli.main bench \
      --device gpu --corpus "$REPO/examples/workloads/manifest.py" --quick --modes unprotected,krex --concurrency 8 \
      --timeout 150 --no-plots --out /tmp/olend/lend$lend > /tmp/olend/lend$lend.log 2>&1; echo "lend=$lend exit $?")
    grep -E "^(unprotected|krex)-8 " /tmp/olend/lend$lend.log
  done
  tar czf "$FINAL/lend.tgz" -C /tmp/olend . ;;
esac
