#!/usr/bin/env bash
# On the H200: `krex fleet` on a one-node Ray cluster against `krex batch` on the same
# commands (trivial `true` commands serial and 16 at a time; the GPU corpus's quick subset at 8):
# the per-command cost Ray adds, its one-off start, throughput, and the commands' own measured ms.
# The image has no Ray and nothing can be downloaded there: first run benchmarks/fleet_wheels.sh here
# (it fills .whl-fleet/: slimmed ray 43 MiB, its missing deps, cffi), and carry .whl-fleet alone
# (the tree limit is 64 MiB). One call, ~4-6 min: run(command="bash benchmarks/h200_fleet.sh",
# carry=[".whl-fleet"], timeout_s=560).
set -uo pipefail
REPO=$PWD; FINAL=${OUT:-/tmp/krex-out}; export OUT=/tmp/krexlogs; mkdir -p "$OUT" "$FINAL"
trap 'cp -f "$OUT"/*.txt "$FINAL"/ 2>/dev/null; tar czf "$FINAL/results.tgz" -C "$OUT" .' EXIT
ls .whl-fleet/ray-*.whl >/dev/null 2>&1 || { echo "no .whl-fleet/ray-*.whl: run benchmarks/fleet_wheels.sh here first and carry .whl-fleet"; exit 1; }
if [ ! -d /tmp/fleetsite/ray ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fleetsite .whl-fleet/*.whl || exit 1
fi
export PYTHONPATH=/tmp/fleetsite PYTHONUNBUFFERED=1
python3 -c "import ray; print('ray', ray.__version__)" || exit 1
rm -rf /tmp/fleetkrex
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fleetkrex . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/fleetkrex:/tmp/fleetsite KREX_STATE_DIR=/tmp/krexstate-fleet KREX_SHM=/krex-fleet
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
mkdir -p /tmp/fleetwork && cd /tmp/fleetwork
timeout 460 python3 "$REPO/benchmarks/fleet_overhead.py" --device gpu --slots 16 --corpus-slots 8 --serial 40 \
  --trivial 200 --corpus "$REPO/examples/workloads/manifest.py" --timeout 150 --out "$OUT/runs" 2>&1 | tee "$OUT/table.txt" | tail -16
