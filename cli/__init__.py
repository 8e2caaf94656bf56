"""The `krex` command line: a thin click layer over the krex library."""

from __future__ import annotations

import io
import sys
from typing import TextIO


def quiet() -> bool:
    """Whether `krex -q` was given: results and errors only, no progress or notices."""
    import click  # here, not above: `krex run` (cli/lean.py) never loads click

    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx else None
    return bool(isinstance(obj, dict) and obj.get("quiet"))


def progress_stream() -> TextIO:
    """Where progress lines go: stderr, or nowhere under -q."""
    return io.StringIO() if quiet() else sys.stderr
