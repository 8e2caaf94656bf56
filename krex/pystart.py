"""How KREX starts Python to run one of its own modules (krexd, its watchdog, the guardian,
the coverage workloads): as `python -m MODULE` would, but with the current directory never
on ``sys.path``. `-m` puts the working directory first, so a directory holding a `krex/`
folder (a clone of KREX, a user's project) would shadow the installed package.

* This interpreter on Python 3.11+: ``python -P -m MODULE`` (-P: no unsafe path prepended).
* Any other interpreter (3.10, or one whose version is not known here): ``python -c BOOT
  MODULE ...``, where BOOT drops the current directory's entry and hands over to runpy the way
  `-m` does (``sys.argv[0]`` becomes the module's file). interpose/guardian.c starts Python
  with this same BOOT text (a test keeps the two equal)."""

from __future__ import annotations

import sys

__all__ = ["BOOT", "module_argv"]

# `-c` puts '' (the current directory) first; an empty PYTHONPATH entry means it too.
# The standard library is imported only once the path is clean.
BOOT = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; import runpy; "
    "runpy._run_module_as_main(sys.argv.pop(1))"
)


def module_argv(module: str, python: str = sys.executable) -> list[str]:
    """argv that runs `module` as `python -m module`, never importing from the current directory."""
    if python == sys.executable and sys.version_info >= (3, 11):
        return [python, "-P", "-m", module]
    return [python, "-c", BOOT, module]
