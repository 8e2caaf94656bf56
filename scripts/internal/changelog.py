"""Fold the news fragments (news/<topic>.<type>.md) into CHANGELOG.md's Unreleased section,
grouped by type in Keep a Changelog's order, and delete them.

    python scripts/internal/changelog.py           # fold
    python scripts/internal/changelog.py --check   # exit 1 if a fragment has an unknown type"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"added": "Added", "changed": "Changed", "removed": "Removed", "fixed": "Fixed", "security": "Security"}


def fragments() -> list[tuple[str, Path]]:
    out = []
    for f in sorted((ROOT / "news").glob("*.md")):
        kind = f.name.rsplit(".", 2)[-2] if f.name.count(".") >= 2 else ""
        out.append((kind, f))
    return out


def main() -> int:
    frags = fragments()
    bad = [f.name for kind, f in frags if kind not in TYPES]
    if bad:
        print(f"news fragments with an unknown type (use one of {', '.join(TYPES)}): {', '.join(bad)}")
        return 1
    if "--check" in sys.argv or not frags:
        return 0
    log = ROOT / "CHANGELOG.md"
    text = log.read_text()
    head, sep, rest = text.partition("## [Unreleased]\n")
    if not sep:
        print("CHANGELOG.md has no '## [Unreleased]' section")
        return 1
    block = ""
    for kind, title in TYPES.items():
        items = [f.read_text().strip() for k, f in frags if k == kind]
        if items:
            block += f"\n### {title}\n" + "".join(f"- {i}\n" for i in items)
    log.write_text(head + sep + block + rest)
    for _k, f in frags:
        f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
