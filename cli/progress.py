"""The CLI's one progress and formatting helper (bench, batch, fleet, doctor).

On a terminal, `Progress` keeps one live status line that is rewritten in place
(carriage return, padded with spaces over the previous one: no terminal escape
codes); lines printed with `line` go above it. Without a terminal it prints only
the lines, never a carriage return, so logs and CI output stay plain."""

from __future__ import annotations

import shutil
from typing import TextIO

import click

__all__ = ["Progress", "bar", "fmt_s", "short"]


def fmt_s(s: float | None) -> str:
    """A duration: '-', '12.34 ms', '3.21 s', or '4m05s' from a minute on."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    if s < 60:
        return f"{s:.2f} s"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def short(text: str, n: int = 80) -> str:
    """One line of at most ``n`` characters."""
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def bar(done: int, total: int, width: int = 24) -> str:
    """'[######..........]': ``done`` of ``total``."""
    fill = int(width * done / max(1, total))
    return f"[{'#' * fill}{'.' * (width - fill)}]"


class Progress:
    """A live status line on a terminal (``tty``), plain lines otherwise."""

    def __init__(self, stream: TextIO, tty: bool) -> None:
        self.stream, self.tty = stream, tty
        self._shown = 0  # length of the status line on screen, 0: none

    def _clear(self) -> None:
        if self._shown:
            click.echo("\r" + " " * self._shown + "\r", file=self.stream, nl=False)
            self._shown = 0

    def line(self, text: str) -> None:
        """A line that stays (above the status line on a terminal)."""
        self._clear()
        click.echo(text, file=self.stream)

    def status(self, text: str) -> None:
        """Replace the status line (terminal only; nothing otherwise)."""
        if not self.tty:
            return
        text = text[: max(10, shutil.get_terminal_size((100, 20)).columns - 1)]
        pad = max(0, self._shown - len(text))
        click.echo("\r" + text + " " * pad, file=self.stream, nl=False)
        self._shown = len(text)

    def close(self, keep: bool = False) -> None:
        """Remove the status line, or with ``keep`` end it with a newline so it stays."""
        if keep and self._shown:
            click.echo("", file=self.stream)
            self._shown = 0
        self._clear()
