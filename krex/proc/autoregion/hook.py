"""The import hook: a ``sys.meta_path`` finder that, right after a target module has been
executed, replaces each target function or method with a wrapper (one already imported
is wrapped at once); `install` and `uninstall`."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from krex.proc.autoregion import inductor, torch_timer
from krex.proc.autoregion.core import (
    _MISSING,
    ENV_VAR,
    INDUCTOR,
    STATUS_DIR_ENV,
    TIMER_FIRST,
    TIMER_LOOP,
    TIMER_TIMEIT,
    Target,
    _by_module,
    _dump_locked,
    _is_ours,
    _lock,
    _lookup,
    _make_wrapper,
    _patches,
    _regions,
    _replace,
    _set,
    _status,
    _targets,
    _undo,
    _whole,
)
from krex.proc.autoregion.targets import _BODIES, _DETAILS, parse

_finder: _Finder | None = None


def installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def install(value: str | None = None, implicit: bool = False) -> None:
    """Wrap the targets named by ``value`` (default: $KREX_AUTO_REGION). Does
    nothing for "" or "0". Raises UsageError for a malformed value; never for a
    target that is missing or cannot be wrapped (see status()). ``implicit``: the
    `inductor` that sitecustomize.py turns on by itself, which leaves no status for `krex
    run` and takes soft regions (inductor.soft)."""
    global _finder
    targets = parse(os.environ.get(ENV_VAR, "") if value is None else value)
    if implicit:
        inductor.soft = True
    if not targets:
        return
    with _lock:
        new = [t for t in targets if t.name not in _targets]
        for t in new:
            _targets[t.name] = t
            _by_module.setdefault(t.module, []).append(t)
            _set(t, "pending", f"wrapped when {t.module} is imported")
        if not installed():
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
            if not implicit and os.environ.get(STATUS_DIR_ENV):
                import atexit

                atexit.register(_dump_locked)
        for name in dict.fromkeys(t.module for t in new):
            mod = sys.modules.get(name)
            if mod is not None:
                _patch_module(mod, [t for t in new if t.module == name])


def find_spec(
    fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
) -> ModuleSpec | None:
    """The spec the installed import hook gives `fullname` (None without one)."""
    f = _finder
    spec = f.find_spec(fullname, path, target) if f is not None and installed() else None
    return spec if isinstance(spec, ModuleSpec) else None


def uninstall() -> None:
    """Remove the import hook and put every original back (mostly for tests)."""
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for owner, attr, prev, owned in reversed(_patches):
            try:
                if owned or not isinstance(owner, type):
                    setattr(owner, attr, prev)
                else:
                    delattr(owner, attr)
            except (AttributeError, TypeError):
                pass
        _patches.clear()
        for undo in reversed(_undo):
            with contextlib.suppress(Exception):  # putting back is best effort
                undo()
        _undo.clear()
        _targets.clear()
        _by_module.clear()
        inductor.soft = False
        _status.clear()
        _whole.clear()
        _regions.clear()


class _Finder:
    """sys.meta_path finder: for a target module, let the other finders find it,
    then hand out a loader that patches the module right after executing it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _by_module:
            return None
        try:
            finders = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                spec.loader = _Loader(loader)
            return spec
        return None

    def invalidate_caches(self) -> None:
        pass


class _Loader:
    """Delegates to the real loader, puts it back on the module before executing
    it (so get_source, reload and resource readers see the real one), then
    patches the targets of the freshly executed module."""

    def __init__(self, loader: Any) -> None:
        self._krex_loader = loader

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._krex_loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        real = self._krex_loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = real
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = real
        real.exec_module(module)
        with _lock:
            targets = list(_by_module.get(module.__name__, ()))
        _patch_module(module, targets)

    def __getattr__(self, name: str) -> Any:
        if name == "_krex_loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._krex_loader, name)


def _patch_module(module: ModuleType, targets: list[Target]) -> None:
    for t in targets:
        try:
            with _lock:
                _apply(t, module)
        except Exception as e:  # never break the import
            _set(t, "failed", f"{type(e).__name__}: {e}; the original is left in place")


def _apply(t: Target, module: ModuleType) -> None:
    if t.strategy == INDUCTOR:
        inductor._apply_inductor(t, module)
        return
    *path, attr = t.qualname.split(".")
    owner: Any = module
    for i, p in enumerate(path):
        owner = getattr(owner, p, _MISSING)
        if owner is _MISSING:
            where = ".".join([module.__name__, *path[:i]])
            _set(t, "absent" if t.optional else "missing",
                 f"{where} has no attribute {p!r} in this version; nothing wrapped")
            return
    raw = _lookup(owner, attr)
    if raw is _MISSING:
        where = getattr(owner, "__name__", owner)
        _set(t, "absent" if t.optional else "missing",
             f"{where!r} has no attribute {attr!r} in this version; nothing wrapped")
        return
    if _is_ours(raw):
        _set(t, "wrapped", "already wrapped (the same function under another name)")
        return
    if isinstance(raw, type):
        _set(t, "unsupported", f"{t.name} is a class; name one of its methods (module:Class.method)")
        return
    rewrap: Callable[[Any], Any] | None = None
    func: Any = raw
    if isinstance(raw, (staticmethod, classmethod)):
        rewrap, func = type(raw), raw.__func__
    if not callable(func):
        _set(t, "unsupported", f"{t.name} is a {type(raw).__name__}, not a function; left in place")
        return
    detail = _DETAILS[t.strategy]
    if t.strategy in (TIMER_TIMEIT, TIMER_LOOP, TIMER_FIRST):
        why = torch_timer.prepare(t, owner)
        if why:
            _whole.add(t.name)
            detail = why
    wrapper = _make_wrapper(t, func, _BODIES[t.strategy])
    _replace(owner, attr, rewrap(wrapper) if rewrap is not None else wrapper)
    _set(t, "whole" if t.name in _whole else "wrapped", detail)
