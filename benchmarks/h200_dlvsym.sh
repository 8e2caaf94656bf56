#!/usr/bin/env bash
# On the H200, one device call (carry .whl .whl-new): does a dlvsym() lookup of a versioned
# libcudart/libcuda symbol reach an ungated entry point under KREX? (benchmarks/gpu_dlvsym.py;
# exit 0: none does.) Build the wheel of this tree first, here:
#   rm -rf .whl-new && python3 -m pip wheel -q --no-deps -w .whl-new .
set -uo pipefail
REPO=$PWD; O=${OUT:-/tmp/krex-out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg \
  .whl-new/krex_gpu-*.whl > "$O/install.log" 2>&1 || { tail -20 "$O/install.log"; exit 1; }
export PYTHONPATH=/tmp/krexpkg:/tmp/site PYTHONUNBUFFERED=1 KREX_STATE_DIR=/tmp/krexstate-dlvsym
cd /tmp
OUT="$O" timeout 300 python3 "$REPO/benchmarks/gpu_dlvsym.py" --device gpu 2>&1 | tee "$O/gpu_dlvsym.log"
rc=${PIPESTATUS[0]}
python3 -m krex.cli.main daemon stop > /dev/null 2>&1
exit "$rc"
