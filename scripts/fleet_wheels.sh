#!/usr/bin/env bash
# Run HERE (a machine with PyPI), from the repo root, before scripts/h200_fleet.sh: puts into .whl/
# what the H200 image lacks for `krex fleet` (Python 3.12, manylinux x86_64): Ray, slimmed to fit the
# device's 64 MiB working-tree limit (scripts/slim_wheel.py drops the Java jars: 75.6 -> 43.2 MiB for
# ray 2.60.0), and Ray's dependencies missing there (jsonschema and its three) plus cffi/pycparser for
# KREX itself, each only if .whl/ has no wheel of that name yet (two versions stop the install).
set -euo pipefail
RAY=${RAY_VERSION:-2.60.0}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo /.whl/ >> .git/info/exclude
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$1" "$2"; }
tmp=$(mktemp -d)
if ! ls .whl/ray-*.whl >/dev/null 2>&1; then
  dl "$tmp" "ray==$RAY"
  python3 scripts/slim_wheel.py "$tmp"/ray-*.whl .whl
fi
for pkg in jsonschema jsonschema-specifications referencing rpds-py cffi pycparser; do
  stem=$(echo "$pkg" | tr - _)
  ls .whl/"$stem"-*.whl >/dev/null 2>&1 || dl .whl "$pkg"
done
rm -rf "$tmp"
du -ch .whl/*.whl | tail -1
