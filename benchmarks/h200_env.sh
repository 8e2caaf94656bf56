# Source on a device machine with no network: installs the carried wheels (.whl: cffi,
# pycparser, posix_ipc) and builds this checkout into /tmp/krexpkg, then exports the paths.
# Usage: . benchmarks/h200_env.sh   (sets PYTHONPATH, KREX_STATE_DIR, PYTHONUNBUFFERED)
if [ ! -d /tmp/krexpkg/krex ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --target /tmp/krexpkg . > /tmp/krex-install.log 2>&1 || { tail -20 /tmp/krex-install.log; return 1; }
fi
export PYTHONPATH=/tmp/krexpkg:/tmp/site KREX_STATE_DIR=/tmp/krexstate PYTHONUNBUFFERED=1
