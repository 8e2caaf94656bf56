#!/usr/bin/env bash
# Issue 11 item 3 on the H200, one device call: what `krex run` adds per command with 16
# starting at once (scripts/run_overhead.py), main's build against this one, alternating, and
# the step breakdown of this one (scripts/run_breakdown.py; main's has no stamps: total only).
#   before: .whl-old, a wheel built from main; after: .whl-krex, from this tree
#   (`pip wheel --no-deps -w .whl-krex .`). Needs carry: .whl (cffi, pycparser, psutil,
#   click, nvidia-ml-py for cp312) .whl-old .whl-krex.
# Each build runs from its own --target directory (bytecode compiled: without it every
# `krex run` would compile krex) through a wrapper, with its own KREX world; from /tmp, so no
# krex checkout in the current directory shadows the install.
set -uo pipefail
REPO=$PWD; RES=${OUT:-/tmp/krex-out}; FINAL=/tmp/i11; mkdir -p "$FINAL" "$RES"
trap 'tar czf "$RES/i11.tgz" -C "$FINAL" .' EXIT  # at most 8 files come back: one archive
source scripts/_builds.sh
install_builds old=.whl-old new=.whl-krex || exit 1
cd /tmp
for i in 1 2; do
  for v in old new; do
    timeout 200 python3 "$REPO/scripts/run_overhead.py" --krex-bin /tmp/krex-$v --device gpu -n 16 -r 5 \
      --out "$FINAL/overhead-$v-$i" > "$FINAL/overhead-$v-$i.log" 2>&1
    echo "run_overhead rc=$?" >> "$FINAL/overhead-$v-$i.log"
  done
done
timeout 120 python3 "$REPO/scripts/run_breakdown.py" --krex-bin /tmp/krex-new --device gpu -n 16 -r 5 \
  --out "$FINAL/breakdown" > "$FINAL/breakdown.log" 2>&1
for i in 1 2; do for v in old new; do echo "== krex run overhead, $v, run $i"; tail -4 "$FINAL/overhead-$v-$i.log"; done; done
echo "== step breakdown (new)"; cat "$FINAL/breakdown.log"
