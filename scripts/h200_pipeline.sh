#!/usr/bin/env bash
# Region entry with the freeze overlapped with the drain (issue 15), what `krex run` adds
# (issue 11 item 3) and region entry while siblings copy GB-scale inputs (issue 11 item 6),
# in one device call on the H200. Three builds, each from its own --target directory with
# its own KREX world, interleaved round by round by scripts/entry_latency.py:
#   old:  .whl-old, 201d96c (before the redesign)
#   prev: .whl-krex, 1257fa9 (the redesign: wake-ups, freezer re-read; freeze after the drain)
#   new:  .whl-new, this tree (`pip wheel --no-deps -w .whl-new .`)
# carry: .whl .whl-old .whl-krex .whl-new. Everything comes back as pipeline.tgz in $OUT.
set -uo pipefail
REPO=$PWD; RES=${OUT:-/tmp/krex-out}; F=/tmp/pipe; mkdir -p "$F" "$RES"
trap 'find "$F" -name "ready-*" -delete; rm -rf "$F"/*/*/state; tar czf "$RES/pipeline.tgz" -C "$F" .' EXIT
ROUNDS=${ROUNDS:-2}; REGIONS=${REGIONS:-100}
source scripts/_builds.sh
install_builds old=.whl-old prev=.whl-krex new=.whl-new | tee -a "$F/builds.txt"; [ -x /tmp/py-new ] || exit 1
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$F/gpu.txt"
T0=$(date +%s)
OUT="$F/entry" timeout ${ENTRY_TIMEOUT:-300} python3 "$REPO/scripts/entry_latency.py" --device gpu --siblings 8 \
  --regions "$REGIONS" --rounds "$ROUNDS" --build old=/tmp/py-old --build prev=/tmp/py-prev --build new=/tmp/py-new \
  > "$F/entry.log" 2>&1
echo "entry_latency rc=$? in $(( $(date +%s) - T0 )) s" >> "$F/entry.log"
for v in prev new; do
  PATH=/tmp/$v/bin:$PATH PYTHONPATH=/tmp/$v:/tmp/site timeout 80 python3 "$REPO/scripts/run_overhead.py" \
    --krex-bin /tmp/$v/bin/krex --device gpu -n 16 -r 3 --out "$F/overhead-$v" > "$F/overhead-$v.log" 2>&1
  echo "run_overhead rc=$?" >> "$F/overhead-$v.log"
done
PATH=/tmp/new/bin:$PATH PYTHONPATH=/tmp/new:/tmp/site timeout ${COPIES_TIMEOUT:-150} python3 \
  "$REPO/scripts/gpu_entry_copies.py" --device gpu --out "$F/copies" > "$F/copies.log" 2>&1
echo "gpu_entry_copies rc=$?" >> "$F/copies.log"
echo "== region entry (old: before the redesign, prev: freeze after the drain, new: overlapped)"
tail -9 "$F/entry.log"
for v in prev new; do echo "== krex run overhead, $v"; tail -7 "$F/overhead-$v.log"; done
echo "== region entry while siblings copy GB-scale inputs"; tail -8 "$F/copies.log"
