#!/usr/bin/env bash
# Run HERE (a machine with PyPI), from the repo root, before benchmarks/h200_fleet.sh. Fills
# .whl-fleet/ (git-ignored through info/exclude) with what the H200 image lacks for `krex fleet`
# (Python 3.12, manylinux x86_64): Ray, slimmed to fit the device's 64 MiB working-tree limit
# (scripts/slim_wheel.py drops the Java jars: 75.6 -> 43.2 MiB for ray 2.60.0), Ray's
# dependencies missing there (jsonschema and its three), and cffi/pycparser to build KREX.
# ~44 MiB in all: carry .whl-fleet alone (a ziglang wheel beside it would pass the limit).
set -euo pipefail
RAY=${RAY_VERSION:-2.60.0}
D=.whl-fleet
mkdir -p "$D"
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx "/$D/" "$EXCLUDE" 2>/dev/null || echo "/$D/" >> "$EXCLUDE"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$1" "$2"; }
if ! ls "$D"/ray-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  dl "$tmp" "ray==$RAY"
  python3 scripts/slim_wheel.py "$tmp"/ray-*.whl "$D"
  rm -rf "$tmp"
fi
for pkg in jsonschema jsonschema-specifications referencing rpds-py cffi pycparser; do
  stem=$(echo "$pkg" | tr - _)
  ls "$D/$stem"-*.whl >/dev/null 2>&1 || dl "$D" "$pkg"
done
du -ch "$D"/*.whl | tail -1
