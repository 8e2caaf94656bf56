"""The library never depends on its own CLI: nothing under krex/ imports `krex.cli` (or
`cli`), and no argv it builds names it (the runner spawns `python -m krex.proc.launcher`)."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import krex
from krex.pystart import BOOT, module_argv
from krex.runner import GUARDIAN_MODULE, guardian_argv, native_guardian

ROOT = Path(krex.__file__).resolve().parent
DOC_HOLDERS = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_cli(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in ("cli", "krex.cli"))


def _trees() -> list[tuple[Path, ast.Module]]:
    files = sorted(p for p in ROOT.rglob("*.py") if "workloads" not in p.parts)
    assert len(files) > 20  # the walk really found the library
    return [(p, ast.parse(p.read_text(), str(p))) for p in files]


def test_library_never_imports_the_cli() -> None:
    bad = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path}:{node.lineno}: {n}" for n in names if _is_cli(n)]
    assert not bad, bad


def test_library_never_spawns_the_cli() -> None:
    """No string in the library (docstrings aside) names the CLI module: an argv such as
    [python, "-m", "krex.cli.main", "run", ...] cannot be built without one."""
    bad = []
    for path, tree in _trees():
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, DOC_HOLDERS) and n.body and isinstance(n.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) and id(node) not in docs else None
            if isinstance(text, str) and ("krex.cli" in text or text.startswith("cli.")):
                bad.append(f"{path}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, bad


def test_the_runner_spawns_the_guardian_entry(tmp_path: Path) -> None:
    """The native guardian where it was built (it hands the rest to the library entry, with
    this Python: interpose/guardian.c `--entry`), else the library entry itself."""
    py = sys.executable
    argv = guardian_argv(["x", "--y"], "/r.json", device="sim", gpu=1, freeze="gpu", python=py)
    native = native_guardian()
    if native is None:
        start = module_argv(GUARDIAN_MODULE, py)  # `py -P -m` or `py -c BOOT`: never the cwd's krex
        assert argv[: len(start)] == start
    else:
        assert argv[:3] == [str(native), "--entry", py] and native.name == "krex"
    # Another Python may have another krex (or none): its own entry, never this native one,
    # even where it is a link to the same interpreter (as every venv's python is).
    assert guardian_argv(["x"], "/r.json", python="py")[:4] == ["py", "-c", BOOT, GUARDIAN_MODULE]
    other = tmp_path / "venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.symlink_to(os.path.realpath(sys.executable))
    assert guardian_argv(["x"], "/r.json", python=str(other))[:4] == [str(other), "-c", BOOT, GUARDIAN_MODULE]
    assert GUARDIAN_MODULE == "krex.proc.launcher"
    assert argv[argv.index("--") + 1 :] == ["x", "--y"]
    assert not any("cli" in a for a in argv)
