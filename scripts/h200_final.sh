#!/usr/bin/env bash
# One device call for the session's last figures: issue 15's before/after (scripts/h200_i15.sh:
# freeze, region entry, krex run overhead) and a krex bench of unprotected against krex at
# C = 8 and 16 on the quick corpus with the CPU-heavy family (scripts/h200_issue11.sh).
# carry: .whl .whl-old .whl-krex. Comes back: i15.tgz, i11 logs.tgz and bench.tgz, the tables.
set -uo pipefail
RES=${OUT:-/tmp/krex-out}; mkdir -p "$RES"
ROUNDS=${ROUNDS:-2} OUT="$RES" bash scripts/h200_i15.sh 2>&1 | tail -32
mkdir -p /tmp/i11out
STEPS=bench BENCH_TIMEOUT=${BENCH_TIMEOUT:-330} \
  BENCH_ARGS="--quick --modes unprotected,krex --concurrency 8,16 --timeout 200" OUT=/tmp/i11out \
  bash scripts/h200_issue11.sh 2>&1 | tail -26
cp /tmp/i11out/*.tgz "$RES/" 2>/dev/null
ls -la "$RES"
