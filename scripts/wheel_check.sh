#!/usr/bin/env bash
# Build KREX's sdist and wheel as a user's `pip`/`python -m build` would, install the
# wheel into a fresh virtual environment and try it from outside the checkout.
#
#   scripts/wheel_check.sh            # x86_64 wheel + smoke test, aarch64 cross build checked
#   WHEEL_CHECK_AARCH64=0 ...         # skip the aarch64 cross build
#   WHEEL_CHECK_DIR=/tmp/wc ...       # keep the work directory (default: a fresh temp dir)
#   WHEEL_PY=python3.10 ...           # interpreter of the fresh venv (default: the oldest of 3.10..3.13 found)
#
# Steps: (1) `python -m build` (sdist, then the wheel built from that sdist) and
# `pip wheel .` from the tree: same tag, same files; (2) the wheel's contents (shim,
# simulated GPU, corpus; highest GLIBC_ symbol per library; tag) and `auditwheel show`;
# (3) a fresh venv gets the wheel alone, then, from another directory, `krex doctor`,
# `krex run --device sim -- ./victim --region`, `krex bench --device sim --quick`, and
# `krex --version` from the checkout (whose krex/ folder must not shadow the wheel's);
# (4) the aarch64 wheel, cross-built with zig, checked by readelf and auditwheel.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
W="${WHEEL_CHECK_DIR:-$(mktemp -d /tmp/krex-wheel-check.XXXXXX)}"
mkdir -p "$W"
HOSTPY="${PYTHON:-python3}"
ARCH="$(uname -m)"
step() { printf '\n=== %s\n' "$*"; }

pick_py() {
  if [ -n "${WHEEL_PY:-}" ]; then echo "$WHEEL_PY"; return; fi
  local root; root="$(pyenv root 2>/dev/null || true)"
  for v in 3.10 3.11 3.12 3.13; do
    for c in "python$v" ${root:+"$root"/versions/$v.*/bin/python$v}; do
      if "$c" -c 'import venv, ensurepip' >/dev/null 2>&1; then echo "$c"; return; fi
    done
  done
  echo "$HOSTPY"
}

step "tools (build, auditwheel) in $W/tools"
[ -x "$W/tools/bin/python" ] || "$HOSTPY" -m venv "$W/tools"
"$W/tools/bin/pip" install -q build auditwheel

step "python -m build: sdist, then the wheel from the sdist"
rm -rf "$W/dist" "$W/pipwheel"
"$W/tools/bin/python" -m build --outdir "$W/dist" "$REPO" >"$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
SDIST="$(ls "$W"/dist/krex_gpu-*.tar.gz)"
WHEEL="$(ls "$W"/dist/krex_gpu-*.whl)"
echo "sdist: $(basename "$SDIST")"
echo "wheel: $(basename "$WHEEL")"

step "pip wheel . (from the tree) builds the same wheel"
"$W/tools/bin/pip" wheel -q --no-deps -w "$W/pipwheel" "$REPO" >"$W/pipwheel.log" 2>&1 || { tail -40 "$W/pipwheel.log"; exit 1; }
PIPWHEEL="$(ls "$W"/pipwheel/krex_gpu-*.whl)"
[ "$(basename "$PIPWHEEL")" = "$(basename "$WHEEL")" ] || { echo "FAIL: pip wheel gave $(basename "$PIPWHEEL")"; exit 1; }
listing() { "$HOSTPY" -c 'import sys, zipfile; print("\n".join(sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if not n.endswith("RECORD"))))' "$1"; }
diff <(listing "$WHEEL") <(listing "$PIPWHEEL") || { echo "FAIL: the sdist's wheel and pip wheel's differ"; exit 1; }
echo "same tag and the same $(listing "$WHEEL" | wc -l) files"

step "wheel contents"
"$HOSTPY" "$REPO/scripts/wheel_contents.py" "$WHEEL" --arch "$ARCH"
step "auditwheel show"
"$W/tools/bin/auditwheel" show "$WHEEL" | tee "$W/auditwheel.txt"
grep -q "manylinux_2_17_$ARCH" "$W/auditwheel.txt" || { echo "FAIL: auditwheel does not agree on manylinux_2_17_$ARCH"; exit 1; }

PY="$(pick_py)"
step "fresh venv ($("$PY" -V 2>&1)) with the wheel alone"
rm -rf "$W/venv"
"$PY" -m venv "$W/venv"
"$W/venv/bin/pip" install -q "$WHEEL"
KREX="$W/venv/bin/krex"
mkdir -p "$W/elsewhere"
cd "$W/elsewhere"  # nothing of the checkout on sys.path or in the working directory
"$W/venv/bin/python" - <<'EOF'
import krex, krex.native as n
assert "site-packages" in krex.__file__, krex.__file__
print("krex", krex.__version__, "from", krex.__file__)
print("shim", n.shim_path())
EOF

# An isolated KREX world: own state directory, segment and simulated device.
export KREX_STATE_DIR="$W/state" KREX_SHM="/krex-wc-$$" KREX_SIM_SHM="/krex-wcsim-$$" KREX_SIM_TRACE="$W/trace.jsonl"
unset KREX_SOCKET KREX_SLOT KREX_GPU LD_PRELOAD
cleanup() {
  # From wherever the script stands (the checkout too: KREX starts Python with the current
  # directory off sys.path, so the tree's krex/ never shadows the installed one).
  # (The on-demand daemon of `krex run` may have exited idle meanwhile: nothing to stop.)
  "$KREX" daemon stop >/dev/null 2>"$W/stop.err" || grep -q "no KREX daemon" "$W/stop.err" \
    || { echo "wheel check: krex daemon stop failed:"; cat "$W/stop.err"; }
  rm -f "/dev/shm$KREX_SHM" "/dev/shm$KREX_SHM".krexpin-* "/dev/shm$KREX_SIM_SHM"
  "$W/venv/bin/python" -c "from krex.node.freezer import remove_leftovers as r; r('$KREX_SHM')" || true
}
trap cleanup EXIT

step "krex doctor"
"$KREX" doctor

step "from the checkout: its krex/ folder does not shadow the installed krex"
(cd "$REPO" && "$KREX" --version && "$KREX" env --device sim --export >/dev/null) \
  || { echo "FAIL: krex run from a directory holding a krex/ folder"; exit 1; }

step "krex run --device sim -- ./victim (compiled against the installed simulated GPU)"
LIB="$("$KREX" include-dir)"
cc -O2 -I "$REPO/interpose" -I "$LIB" "$REPO/examples/sim/victim.c" -L "$LIB" -Wl,-rpath,"$LIB" \
  -lcudart -lcuda -l:libamdhip64.so -ldl -o victim
"$KREX" run --device sim -- "$PWD/victim" --us 200 --iters 20 --region | tee run.out
grep -q '"region":true,"region_rc":0' run.out || { echo "FAIL: the victim's region did not succeed"; exit 1; }
"$KREX" journal -n 1

step "krex bench --device sim --quick (no matplotlib: plots degrade with a message)"
"$KREX" bench --device sim --quick --out "$W/elsewhere/bench" 2>bench.err | tee bench.out
grep -q "krex-gpu\[bench\]" bench.err || { cat bench.err; echo "FAIL: no message about the missing plots"; exit 1; }
tail -1 bench.err
[ -s "$W/elsewhere/bench/summary.md" ] || { echo "FAIL: no summary.md"; exit 1; }
cd "$REPO"

if [ "${WHEEL_CHECK_AARCH64:-1}" != 0 ] && [ "$ARCH" = x86_64 ]; then
  step "aarch64 wheel (cross-built with zig; checked by readelf and auditwheel, not run)"
  rm -rf "$W/aarch64"
  KREX_TARGET=aarch64 "$W/tools/bin/pip" wheel -q --no-deps -w "$W/aarch64" "$SDIST" >"$W/aarch64.log" 2>&1 \
    || { tail -40 "$W/aarch64.log"; exit 1; }
  AWHEEL="$(ls "$W"/aarch64/krex_gpu-*.whl)"
  "$HOSTPY" "$REPO/scripts/wheel_contents.py" "$AWHEEL" --arch aarch64
  "$W/tools/bin/auditwheel" show "$AWHEEL" | tee "$W/auditwheel-aarch64.txt"
  grep -q "manylinux_2_17_aarch64" "$W/auditwheel-aarch64.txt" || { echo "FAIL: auditwheel (aarch64)"; exit 1; }
fi

step "wheel check passed (work directory: $W)"
