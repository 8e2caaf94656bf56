"""What KREX_AUTO_REGION names: the built-in harnesses (one module each), `all`, and
``module:function`` / ``module:Class.method`` targets with an optional ``@strategy``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from krex.errors import UsageError
from krex.proc.autoregion import (
    do_bench,
    do_bench_cudagraph,
    inductor,
    kernelbench,
    pytest_benchmark,
    torch_timer,
)
from krex.proc.autoregion.core import (
    CUDAGRAPH,
    DO_BENCH,
    ENV_VAR,
    KERNELBENCH,
    WHOLE,
    Args,
    Fn,
    Kwargs,
    Target,
    _body_whole,
)

HARNESSES = (do_bench, do_bench_cudagraph, torch_timer, kernelbench, inductor, pytest_benchmark)
BUILTINS: dict[str, tuple[Target, ...]] = {k: v for h in HARNESSES for k, v in h.TARGETS.items()}
_DETAILS: dict[str, str] = {WHOLE: "the whole call is the region"}
_BODIES: dict[str, Callable[[Target, Fn, Args, Kwargs], Any]] = {WHOLE: _body_whole}
for _h in HARNESSES:
    _DETAILS.update(getattr(_h, "DETAILS", {}))
    _BODIES.update(getattr(_h, "BODIES", {}))
_ALL_WORDS = ("all", "1")


_FIX = ("set KREX_AUTO_REGION to a comma list of " + ", ".join(BUILTINS)
        + ", all (or 1), and module:function or module:Class.method")


def parse(value: str) -> list[Target]:
    """Targets named by a KREX_AUTO_REGION value; [] for "" or "0".
    Raises UsageError for a malformed value."""
    raw = value.strip()
    if raw in ("", "0"):
        return []
    out: dict[str, Target] = {}
    for part in raw.split(","):
        item = part.strip()
        if not item:
            continue
        low = item.lower()
        if low in _ALL_WORDS:
            found = [t for group in BUILTINS.values() for t in group]
        elif ":" in item or "@" in item:
            found = [_parse_user(item)]
        elif low in BUILTINS:
            found = list(BUILTINS[low])
        else:
            raise _unknown(item)
        for t in found:
            out.setdefault(t.name, t)
    return list(out.values())


def _dotted(s: str) -> bool:
    return bool(s) and all(p.isidentifier() for p in s.split("."))


_USER_STRATEGIES = {"whole": WHOLE, "do_bench": DO_BENCH, "do_bench_cudagraph": CUDAGRAPH,
                    "kernelbench": KERNELBENCH}


def _parse_user(item: str) -> Target:
    item, at, how = item.partition("@")
    strategy = WHOLE
    if at:
        strategy = _USER_STRATEGIES.get(how.strip().lower(), "")
        if not strategy:
            raise UsageError(f"{ENV_VAR}: {item}@{how}: unknown strategy {how.strip()!r}",
                             "after @ write one of " + ", ".join(_USER_STRATEGIES)
                             + ", e.g. mylib.bench:do_bench@do_bench")
    module, _, qual = item.partition(":")
    module, qual = module.strip(), qual.strip()
    example = "e.g. mybench.timing:run_trials or mybench.timing:Runner.run"
    if ":" in qual:
        raise UsageError(f"{ENV_VAR}: {item!r} has more than one ':'",
                         f"write module:function or module:Class.method, {example}")
    if not module:
        raise UsageError(f"{ENV_VAR}: {item!r} names no module before ':'",
                         f"write module:function or module:Class.method, {example}")
    if not qual:
        raise UsageError(f"{ENV_VAR}: {item!r} names no function after ':'",
                         f"write module:function or module:Class.method, {example}")
    if not _dotted(module):
        raise UsageError(f"{ENV_VAR}: {module!r} (in {item!r}) is not a module name",
                         f"use the dotted name you would import, {example}")
    if not _dotted(qual):
        raise UsageError(f"{ENV_VAR}: {qual!r} (in {item!r}) is not a function or Class.method name",
                         f"use the name as written in the module, {example}")
    if module == "__main__":
        raise UsageError(f"{ENV_VAR}: {item!r}: functions of the __main__ script cannot be wrapped "
                         "(the script defines them after the hook ran)",
                         "move the function into a module and name it as module:function")
    return Target(module, qual, strategy)


def _unknown(item: str) -> UsageError:
    import difflib

    close = difflib.get_close_matches(item.lower(), [*BUILTINS, "all"], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    fix = _FIX
    if "." in item and _dotted(item):
        mod, _, fn = item.rpartition(".")
        fix = f"to wrap a function of your own, separate module and function with ':', e.g. {mod}:{fn}"
    return UsageError(f"{ENV_VAR}: unknown built-in {item!r}{hint}", fix)
