#!/usr/bin/env bash
# On the H200, in one device call (about 3-5 minutes): the zig-built (glibc 2.17)
# shim and extension on the real CUDA stack, discovery, and the harness integrations.
#   1. install KREX as h200_steps.sh does (carry .whl/: setuptools, cffi and, to build with
#      zig as the wheel does, a ziglang wheel; without it gcc builds and the table says so)
#   2. krex doctor: which discovery backend answered, the shim's highest GLIBC_ symbol
#   3. Inductor max-autotune of one matmul with KREX_AUTO_REGION=inductor under krex run:
#      regions in --report, autoregion status (torch's set_gpu_benchmark_lock_context present?)
#   4. pytest-benchmark under krex run, if pytest-benchmark is importable there
# Logs and JSON go to $OUT; the last lines are a short table.
set -uo pipefail
REPO=$PWD; OUTD=${OUT:-/tmp/krex-out}; mkdir -p "$OUTD"
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . \
    > "$OUTD/install.log" 2>&1 || { tail -20 "$OUTD/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate-wheel KREX_SHM=/krex-wheel PYTHONUNBUFFERED=1
KREX="python3 -m krex.cli.main"
cd /tmp
TOOL=$(PYTHONPATH=/tmp/site:$REPO python3 -c 'import krex_build as k; t=k.toolchain(); print(t.kind, " ".join(t.cc[2:]) or t.cc[0])')
GLIBC=$(readelf -V /tmp/krexpkg/krex/_lib/libkrex_interpose.so | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
$KREX doctor --json > "$OUTD/doctor.json" 2> "$OUTD/doctor.err"
GPUS=$(python3 -c 'import json,sys; c={x["name"]:x for x in json.load(open(sys.argv[1]))["checks"]}["gpus"]; print(c["status"], c["finding"][:70])' "$OUTD/doctor.json")

cat > /tmp/wheel_inductor.py <<'PY'
import json, torch, torch._inductor.config as cfg
from krex.proc import autoregion
from torch._inductor.runtime import benchmarking as b
cfg.max_autotune_gemm_backends = "TRITON"
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
f = torch.compile(lambda x: x @ x, mode="max-autotune-no-cudagraphs")
f(a); torch.cuda.synchronize()
st = [e for e in autoregion.status() if e["builtin"] == "inductor"]
print("STATUS " + json.dumps({"torch": torch.__version__, "hook": hasattr(b, "set_gpu_benchmark_lock_context"), "status": st}))
PY
KREX_AUTO_REGION=inductor timeout 300 $KREX run --device gpu --report "$OUTD/inductor.json" -- python3 /tmp/wheel_inductor.py \
  > "$OUTD/inductor.out" 2> "$OUTD/inductor.err"; IRC=$?
IND=$(python3 - "$OUTD" <<'PY'
import json, sys
d = sys.argv[1]
try:
    st = next(json.loads(l[7:]) for l in open(d + "/inductor.out") if l.startswith("STATUS "))
    rep = json.load(open(d + "/inductor.json"))
    s = st["status"][0] if st["status"] else {"state": "?"}
    print(f"torch {st['torch']}, hook {st['hook']}, {s['state']}, regions {len(rep['regions'])}, contaminated {rep['contaminated_regions']}")
except Exception as e:
    print(f"no result ({type(e).__name__}: {e})")
PY
)
if python3 -c 'import pytest_benchmark' 2>/dev/null; then
  mkdir -p /tmp/wheel_pytest_bench && cat > /tmp/wheel_pytest_bench/test_pb.py <<'PY'
import torch
def test_mm(benchmark):
    a = torch.randn(4096, 4096, device="cuda")
    benchmark(lambda: (a @ a, torch.cuda.synchronize()))
PY
  (cd /tmp/wheel_pytest_bench && timeout 180 $KREX run --device gpu --report "$OUTD/pytest.json" -- python3 -m pytest -q -p no:cacheprovider test_pb.py > "$OUTD/pytest.out" 2>&1)
  PB=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("regions", len(r["regions"]), "exit", r["exit_status"])' "$OUTD/pytest.json" 2>&1)
else
  PB="pytest-benchmark not installed here"
fi
$KREX daemon stop > /dev/null 2>&1
tail -30 "$(python3 -c 'import krex.paths as p; print(p.state_dir())')/krexd.log" > "$OUTD/krexd.log.tail" 2>/dev/null
printf '\n%-22s %s\n' "item" "result"
printf '%-22s %s\n' "toolchain" "$TOOL (shim needs $GLIBC)"
printf '%-22s %s\n' "doctor gpus" "$GPUS"
printf '%-22s %s (rc %s)\n' "inductor autotune" "$IND" "$IRC"
printf '%-22s %s\n' "pytest-benchmark" "$PB"
