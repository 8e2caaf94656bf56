"""cli/progress.py: the CLI's one status line and duration format (bench, batch, fleet, doctor)."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
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


def test_doctor_gpu_reports_progress_on_stderr_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """`krex doctor --gpu | tee` (no terminal): the coverage workloads take minutes, so each
    one is announced on stderr as it starts, and stdout keeps only the report."""
    from click.testing import CliRunner
    from krex.cli.main import cli

    from krex.device import gpus
    from krex.doctor import coverage

    real = gpus.discover
    monkeypatch.setattr(
        gpus, "discover", lambda d="auto": gpus.GpuInfo("nvidia", 1, ["H200"], [0], [None], api="nvml")
        if d == "gpu" else real(d)
    )
    seen: list[str] = []

    def run_all(progress: Callable[[str], None] | None = None) -> list[coverage.CoverageRow]:
        rows = []
        for w in ("eager", "triton"):
            if progress is not None:
                progress(w)
            seen.append(w)
            rows.append(coverage.CoverageRow(w, {"kernel": 1}, {"kernel": 1}, 1, 1, True, ""))
        return rows

    monkeypatch.setattr(coverage, "run_all", run_all)
    r = CliRunner().invoke(cli, ["doctor", "--gpu"])
    lines = r.stderr.splitlines()
    assert seen == ["eager", "triton"]
    assert any("gpu coverage" in ln and "eager" in ln and "1/" in ln for ln in lines), r.stderr
    assert any("triton" in ln for ln in lines), r.stderr
    assert "\r" not in r.stderr  # plain lines, no status line
    assert "checking" not in r.stdout and "gpu coverage" in r.stdout  # the report, on stdout
