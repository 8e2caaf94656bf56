#!/usr/bin/env bash
# KREX on a machine with 2+ H200s, in one device call (carry .whl: cffi, pycparser,
# posix_ipc cp312 wheels). Topology and the partition krex doctor chose, per-GPU independence
# (time series + PNG), context creation with 8/16/32 commands at once, then krex bench with C
# commands per GPU on one GPU against all GPUs. Everything lands in $OUT (multigpu.tgz + tables).
#   env: C (commands per GPU, default 8), STEPS (default "topo indep ctx bench")
set -uo pipefail
REPO=$PWD; OUTD=${OUT:-/tmp/krex-out}; L=/tmp/mg; mkdir -p "$L" "$OUTD"
trap 'cp "$L"/*.png "$OUTD"/ 2>/dev/null; tar czf "$OUTD/multigpu.tgz" -C "$L" .' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/krexpkg . > "$L/install.log" 2>&1 || { tail -20 "$L/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate PYTHONUNBUFFERED=1 OUT=$L
K="python3 -m krex.cli.main"; C=${C:-8}; STEPS=" ${STEPS:-topo indep ctx bench} "
cd /tmp
case $STEPS in *" topo "*)
  { nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv; nvidia-smi topo -m; lscpu;
    for n in /sys/devices/system/node/node*; do echo "$n cpus $(cat $n/cpulist)"; done;
    for g in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader); do x=${g,,}; echo "gpu $g numa_node $(cat /sys/bus/pci/devices/${x: -12}/numa_node 2>&1)"; done;
    python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"gpus",torch.cuda.device_count())'; } > "$L/topology.txt" 2>&1
  timeout 60 $K doctor > "$L/doctor.txt" 2>&1; timeout 60 $K doctor --json > "$L/doctor.json" 2>&1
  echo "== partition krex doctor chose"; grep -i -A6 "cpus" "$L/doctor.txt" | head -12 ;;
esac
case $STEPS in *" indep "*|*" ctx "*)
  $K daemon start --device gpu --slots-per-gpu 32 > /dev/null || exit 1
  $K daemon status --json > "$L/daemon_status.json" 2>&1
  case $STEPS in *" indep "*) echo "== independence"; timeout 150 python3 "$REPO/benchmarks/gpu_multigpu.py" independence 2>"$L/indep.err" || tail -5 "$L/indep.err";; esac
  case $STEPS in *" ctx "*) echo "== context creation"; timeout 200 python3 "$REPO/benchmarks/gpu_multigpu.py" ctx 2>"$L/ctx.err" || tail -5 "$L/ctx.err";; esac
  $K daemon stop > /dev/null ;;
esac
case $STEPS in *" bench "*)
  echo "== krex bench, C=$C per GPU: GPU 0 alone (with native-serial), then all GPUs"
  A=$L/bench-1gpu; B=$L/bench-allgpu
  timeout 280 $K bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" --quick --modes native-serial,krex --concurrency $C --gpus 0 --timeout 200 --out $A > "$L/bench-1gpu.log" 2>&1; echo "bench A exit $?"
  timeout 150 $K bench --device gpu --corpus "$REPO/examples/workloads/manifest.py" --quick --modes krex --concurrency $C --gpus all --repeat 2 --timeout 120 --out $B > "$L/bench-allgpu.log" 2>&1; echo "bench B exit $?"
  BENCH_A=$A BENCH_B=$B python3 "$REPO/benchmarks/gpu_multigpu.py" scaling 2>&1 | tail -8 ;;
esac
echo "== tables"; for f in independence ctx scaling; do [ -f $L/$f.json ] && echo "($f.json written)"; done
