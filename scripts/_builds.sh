# Sourced by the H200 scripts that compare builds. `install_builds NAME=WHEELDIR ...`
# installs the cp312 support wheels (.whl) into /tmp/site and each build's krex wheel
# (WHEELDIR/krex_gpu-*.whl) into /tmp/NAME, bytecode compiled (without it every `krex run` would
# compile krex), and writes two wrappers per build: /tmp/py-NAME (python3 with that build
# first on the path) and /tmp/krex-NAME (that build's lean `krex` door). Each build then runs
# with a KREX world of its own; run the wrappers from /tmp, so no checkout shadows them.
install_builds() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || return 1
  local spec v w
  for spec in "$@"; do
    v=${spec%%=*}; w=${spec#*=}
    python3 -m pip install -q --no-index --no-deps --target "/tmp/$v" "$w"/krex_gpu-*.whl || return 1
    printf '#!/bin/sh\nPYTHONPATH=/tmp/%s:/tmp/site${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' "$v" > "/tmp/py-$v"
    printf '#!/bin/sh\nPYTHONPATH=/tmp/%s:/tmp/site exec python3 -P -c "import sys; from krex.cli.lean import main; sys.exit(main())" "$@"\n' "$v" > "/tmp/krex-$v"
    chmod +x "/tmp/py-$v" "/tmp/krex-$v"
    (cd /tmp && "/tmp/py-$v" -c "import krex; print('$v:', krex.__file__)")
  done
}
