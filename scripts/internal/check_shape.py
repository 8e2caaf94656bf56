"""Keep the code's shape readable: no module over MODULE_MAX lines, no class over CLASS_MAX,
no function over FUNCTION_MAX, in the Python packages (krex/, cli/) and the C sources
(interpose/: modules only).

A function may be longer where the line just above its `def` says why, as a comment that
starts with `# long:`. The limits of the parts listed in CEILINGS are their sizes when this
check came in, as ceilings: they may shrink, never grow, and each goes once it is split.

    python scripts/internal/check_shape.py          # exit 1 and a list when something is over
    python scripts/internal/check_shape.py --report # the largest module, class and function"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE_MAX, CLASS_MAX, FUNCTION_MAX = 900, 600, 100
# part -> its size (lines) as this check came in: splitting them is pending work.
CEILINGS: dict[str, int] = {
}


def parts() -> list[tuple[str, str, int]]:
    """(kind, name, lines) of every module, class and function."""
    out: list[tuple[str, str, int]] = []
    for pkg in ("krex", "cli"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            text = f.read_text()
            out.append(("module", rel, len(text.splitlines())))
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    n = (node.end_lineno or node.lineno) - first + 1
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    if kind == "function" and first >= 2 and lines[first - 2].strip().startswith("# long:"):
                        continue
                    out.append((kind, f"{rel}:{node.name}", n))
    for f in sorted((ROOT / "interpose").rglob("*.[ch]")):
        out.append(("module", str(f.relative_to(ROOT)), len(f.read_text().splitlines())))
    return out


def main() -> int:
    limit = {"module": MODULE_MAX, "class": CLASS_MAX, "function": FUNCTION_MAX}
    found = parts()
    if "--report" in sys.argv:
        for kind in ("module", "class", "function"):
            k, name, n = max((p for p in found if p[0] == kind), key=lambda p: p[2])
            print(f"largest {kind}: {name} ({n} lines; limit {limit[kind]})")
        return 0
    over = []
    for kind, name, n in found:
        cap = CEILINGS.get(name, limit[kind])
        if n > cap:
            why = "grew past its ceiling" if name in CEILINGS else f"over the {kind} limit of {limit[kind]}"
            over.append(f"{kind} {name}: {n} lines, {why}")
    for name in CEILINGS:
        if not any(p[1] == name for p in found):
            over.append(f"{name} is listed in CEILINGS but no longer exists: remove it from the list")
    for line in over:
        print(line)
    if over:
        print("split what is over (or, for a function, say why above its def with '# long: ...')")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
