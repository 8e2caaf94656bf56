"""KREX bootstrap for automatic regions (see docs/auto-regions.md).

This directory goes on PYTHONPATH (`krex env` puts it there). Python imports
the first sitecustomize it finds on sys.path at start-up; this one

1. does nothing else but `import os` and a look at KREX_AUTO_REGION when the
   variable is "0", or unset outside KREX (no krex import, no import hook);
2. unset (or empty) under KREX: puts one small finder in front of the import system
   that waits for Inductor's benchmarker and only then installs the `inductor`
   target (each autotuning benchmark in a region of its own);
3. otherwise imports krex.proc.autoregion and installs the import hook, and under KREX
   the same finder as in 2 unless the setting names `inductor` itself;
4. in every case runs the next sitecustomize on sys.path, if there is one, so a
   sitecustomize of the user's or the distribution's is never hidden.

An error (a malformed KREX_AUTO_REGION, krex not importable by this
interpreter) is raised after the chained sitecustomize has run; Python's site
module reports it on stderr as "Error in sitecustomize" and the program goes
on, without automatic regions."""

import os

if False:  # for type checkers only: nothing more is imported at start-up
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType


def _candidate(entry: str) -> bool:
    """Cheap check: could sys.path entry `entry` hold a module named sitecustomize?"""
    d = entry or "."
    if not os.path.isdir(d):
        return os.path.isfile(d)  # a zip or egg: let the real finder decide
    import _imp

    names = ["sitecustomize.py", "sitecustomize.pyc", os.path.join("sitecustomize", "__init__.py")]
    names += ["sitecustomize" + suffix for suffix in _imp.extension_suffixes()]
    return any(os.path.exists(os.path.join(d, n)) for n in names)


def _chain() -> None:
    import sys

    def paths(resolve: bool) -> "tuple[str, list[str]]":  # (quoted: this file runs on any Python 3)
        norm = os.path.realpath if resolve else os.path.abspath
        here = os.path.normcase(norm(os.path.dirname(os.path.abspath(__file__))))
        return here, [os.path.normcase(norm(p or ".")) if isinstance(p, str) else "" for p in sys.path]

    here, normed = paths(False)  # cheap; resolve symlinks only when that does not find us
    if here not in normed:
        here, normed = paths(True)
    start = normed.index(here) + 1 if here in normed else 0
    later = [sys.path[i] for i in range(start, len(normed)) if normed[i] and normed[i] != here]
    if not any(_candidate(p) for p in later):
        return
    mine = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    later = [p for p in later if os.path.realpath(p or ".") != mine]  # our dir under another name
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    spec = PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` would have given
    spec.loader.exec_module(module)


# Inductor times its autotuning candidates outside any region; a candidate whose benchmark
# waited at a closed gate (another command's region) looks slow, and Inductor builds
# another kernel. H200: 5 of 12 runs of a 0.29 ms torch.compile'd layer norm + GELU built
# one 22% slower; 0 of 12 with these regions (docs/results/autotune-regions/).
_INDUCTOR = "torch._inductor.runtime.benchmarking"


class _ImplicitInductor:
    """sys.meta_path finder that installs the `inductor` target when its module is first
    imported, and stays out of every other import."""

    def find_spec(  # string annotations: this file runs on any Python 3
        self, fullname: "str", path: "Sequence[str] | None", target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname != _INDUCTOR:
            return None
        import sys

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from krex.proc import autoregion
            from krex.proc.autoregion import hook

            autoregion.install("inductor", implicit=True)
            return hook.find_spec(fullname, path, target)
        except Exception:  # noqa: BLE001 - never break the program's import: no regions then
            return None


def _implicit_inductor() -> None:
    import sys

    sys.meta_path.insert(0, _ImplicitInductor())


def _main() -> None:
    err: BaseException | None = None
    value = os.environ.get("KREX_AUTO_REGION", "").strip()
    if not value and os.environ.get("KREX_SHM"):
        _implicit_inductor()
    elif value and value != "0":
        try:
            from krex.proc import autoregion
        except ImportError as e:
            import sys

            err = ImportError(f"KREX_AUTO_REGION is set but {sys.executable} cannot import krex ({e}); "
                              "install krex into this environment or unset KREX_AUTO_REGION")
        else:
            try:
                autoregion.install(value)
                # A harness's own target (do_bench, kernelbench) does not cover autotuning:
                # H200, cpu-heavy family with KREX_AUTO_REGION=do_bench, 2 of 12 krex runs
                # built a kernel 16.6% slower (the cause: docs/results/autotune-regions/). "0" turns it off.
                named = any(e.get("builtin") == "inductor" for e in autoregion.status())
                if os.environ.get("KREX_SHM") and not named:
                    _implicit_inductor()
            except Exception as e:
                fix = getattr(e, "fix", "")
                if fix:
                    e.args = (f"{e.args[0] if e.args else e}\n  fix: {fix}",)
                err = e
    try:
        _chain()
    finally:
        if err is not None:
            raise err


_main()
