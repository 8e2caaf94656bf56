#!/usr/bin/env bash
# Two builds of krex (base, new) measured the same way, alternating, on the H200.
# Carry a folder results/admit-prof with whl/ (cffi, posix_ipc, pycparser wheels: .whl),
# whl-base/ and whl-new/ (`python3 -m pip wheel --no-deps -w DIR .` of each tree).
set -uo pipefail
REPO=$PWD; P=$REPO/results/admit-prof; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $P/whl/*.whl 2>/dev/null
for b in base new; do
  rm -rf /tmp/k-$b
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/k-$b \
    $P/whl-$b/krex-*.whl > "$O/install-$b.log" 2>&1 || { tail -20 "$O/install-$b.log"; exit 1; }
  python3 -m compileall -q /tmp/k-$b >/dev/null
done
cd /tmp
T="timeout -k 5 ${TMO:-90}"
for r in $(seq ${REPS:-2}); do
  for b in base new; do
    export PYTHONPATH=/tmp/k-$b:/tmp/site PYTHONUNBUFFERED=1
    $T python3 $REPO/benchmarks/krexd_cpu.py --krex-bin /tmp/k-$b/bin/krex --device gpu -n 16 --waves ${WAVES:-15} | sed "s/^/$b drive: /" | tee -a $O/log.txt
    $T python3 "$REPO/benchmarks/run_overhead.py" --krex-bin /tmp/k-$b/bin/krex --device gpu -n 16 -r ${ROUNDS:-5} \
      --out "$O/ovh-$b-$r" > $O/ovh-$b-$r.log 2>&1
    tail -3 $O/ovh-$b-$r.log | sed "s/^/$b ovh: /" | tee -a $O/log.txt
  done
done
