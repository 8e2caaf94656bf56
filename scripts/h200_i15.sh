#!/usr/bin/env bash
# Issue 15 on the H200, one device call: region entry before the redesign and after it, side
# by side in one run (scripts/entry_latency.py interleaves the builds round by round), and what
# `krex run` adds per command with 16 starting at once (scripts/run_overhead.py), per build.
#   before: .whl-old, a wheel built from 201d96c (the last commit before the redesign)
#   after:  .whl-krex, a wheel built from this tree (`pip wheel --no-deps -w .whl-krex .`)
# Needs carry: .whl (cffi, pycparser, posix_ipc for cp312) .whl-old .whl-krex.
# Each build runs from its own --target directory through a wrapper interpreter, with its own
# KREX world (state directory, segment), so the two never share a daemon. Logs under $OUT.
set -uo pipefail
REPO=$PWD; RES=${OUT:-/tmp/krex-out}; FINAL=/tmp/i15; mkdir -p "$FINAL" "$RES"
# At most 8 files come back from a device call: everything travels as one archive.
trap 'find "$FINAL" -name "ready-*" -delete; rm -rf "$FINAL"/entry/*/state; tar czf "$RES/i15.tgz" -C "$FINAL" .' EXIT
ROUNDS=${ROUNDS:-3}; REGIONS=${REGIONS:-100}
source scripts/_builds.sh
install_builds old=.whl-old new=.whl-krex | tee -a "$FINAL/builds.txt"; [ -x /tmp/py-new ] || exit 1
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$FINAL/gpu.txt"
for t in "" --torch; do  # the cgroup v2 freeze itself: notification by poll against re-reading
  OUT="$FINAL" timeout 120 python3 "$REPO/scripts/freeze_latency.py" --n 8 --rounds 300 $t > "$FINAL/freeze$t.log" 2>&1
  cp "$FINAL/freeze_latency.json" "$FINAL/freeze_latency$t.json" 2>/dev/null
done
OUT="$FINAL/entry" timeout 480 python3 "$REPO/scripts/entry_latency.py" --device gpu --siblings 8 \
  --regions "$REGIONS" --rounds "$ROUNDS" --build old=/tmp/py-old --build new=/tmp/py-new > "$FINAL/entry.log" 2>&1
echo "entry_latency rc=$?" >> "$FINAL/entry.log"
for v in old new; do
  PATH=/tmp/$v/bin:$PATH PYTHONPATH=/tmp/$v:/tmp/site timeout 150 python3 "$REPO/scripts/run_overhead.py" --krex-bin /tmp/$v/bin/krex \
    --device gpu -n 16 -r 3 --out "$FINAL/overhead-$v" > "$FINAL/overhead-$v.log" 2>&1
  echo "run_overhead rc=$?" >> "$FINAL/overhead-$v.log"
done
for t in "" --torch; do echo "== freeze $t"; tail -4 "$FINAL/freeze$t.log"; done
echo "== region entry (old = before, new = after)"; tail -8 "$FINAL/entry.log"
for v in old new; do echo "== krex run overhead, $v"; tail -7 "$FINAL/overhead-$v.log"; done
