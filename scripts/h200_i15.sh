#!/usr/bin/env bash
# Issues 15 and 11 on the H200, one device call: the same measurements for the build before
# the redesign (.whl-old, built from the last commit before it) and after (.whl-krex, built
# from this tree), side by side:
#   - region entry with 8 idle and 8 hammering siblings (scripts/gpu_fidelity.py --latency-only)
#   - what `krex run` adds per command with 16 starting at once (scripts/run_overhead.py)
# Needs carry: .whl .whl-old .whl-krex. Logs under $OUT/<build>/, the table last.
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; mkdir -p "$FINAL"
ROUNDS=${ROUNDS:-4}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
for v in old new; do
  w=.whl-krex; [ $v = old ] && w=.whl-old
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/$v $w/krex-*.whl || exit 1
done
cd /tmp
for v in old new; do
  O="$FINAL/$v"; mkdir -p "$O"
  export PYTHONPATH=/tmp/$v:/tmp/site KREX_STATE_DIR=/tmp/state-$v PYTHONUNBUFFERED=1 OUT="$O"
  ENTRY=(python3 -m krex.cli.main); [ -x /tmp/$v/bin/krex ] && ENTRY=(/tmp/$v/bin/krex)
  python3 -c "import krex, sys; print('$v krex from', krex.__file__)" | tee "$O/which.txt"
  "${ENTRY[@]}" daemon start --device gpu --slots-per-gpu 16 > "$O/daemon.txt" 2>&1 || { cat "$O/daemon.txt"; continue; }
  timeout 150 python3 "$REPO/scripts/gpu_fidelity.py" --latency-only 2>&1 | tail -4 | tee "$O/latency.txt"
  "${ENTRY[@]}" daemon stop >> "$O/daemon.txt" 2>&1
  timeout 100 python3 "$REPO/scripts/run_overhead.py" --device gpu -n 16 -r "$ROUNDS" --out "$O" 2>&1 | tail -8 | tee "$O/overhead.txt"
done
echo "== table (before = old, after = new)"
for v in old new; do
  echo "-- $v"; grep -h "region entry" "$FINAL/$v/latency.txt"; tail -4 "$FINAL/$v/overhead.txt"
done
