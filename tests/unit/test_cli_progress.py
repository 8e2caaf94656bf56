"""cli/progress.py: the CLI's one status line and duration format (bench, batch, fleet, doctor)."""

from __future__ import annotations

import io

from krex.cli.progress import Progress, bar, fmt_s, short


def test_fmt_s_one_format_for_every_command() -> None:
    assert fmt_s(None) == "-"
    assert fmt_s(0.58158) == "581.58 ms"
    assert fmt_s(2.5) == "2.50 s"
    assert fmt_s(125.0) == "2m05s"


def test_without_a_terminal_only_plain_lines() -> None:
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.status("krex batch [...] 1/2")
    p.line("krex batch: [1/2] ok")
    p.close(keep=True)
    assert out.getvalue() == "krex batch: [1/2] ok\n"


def test_on_a_terminal_the_status_line_is_rewritten_without_escape_codes() -> None:
    out = io.StringIO()
    p = Progress(out, tty=True)
    p.status("a long status line")
    p.status("short")
    p.line("a failure")
    p.status("again")
    p.close()
    text = out.getvalue()
    assert "\x1b" not in text
    # "short" overwrites the longer line: padded with spaces to its length.
    assert "\rshort" + " " * (len("a long status line") - len("short")) in text
    # A line clears the status line first; close() leaves nothing behind on it.
    assert "\r" + " " * len("short") + "\ra failure\n" in text
    assert text.endswith("\r" + " " * len("again") + "\r")


def test_bar_and_short() -> None:
    assert bar(3, 6, width=4) == "[##..]"
    assert bar(0, 0, width=2) == "[..]"
    assert short("x" * 100, 10) == "xxxxxxx..." and short("a\nb") == "a\\nb"
