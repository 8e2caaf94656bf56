"""`krex batch` and `krex doctor`: the click layer over krex.batch and krex.doctor.

All output lives here (the library never prints). Errors are KrexError
subclasses, mapped to exit codes by cli/main.py's main(). cli/main.py adds the
commands with `register(cli)`."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import click

from . import progress_stream, quiet
from .progress import Progress, bar, fmt_s, short

__all__ = ["batch", "doctor", "register"]


def register(cli_group: click.Group) -> None:
    """Add `batch` and `doctor` to the `krex` group (idempotent)."""
    cli_group.add_command(batch)
    cli_group.add_command(doctor)


# ------------------------------------------------------------------------------------- batch


class _BatchProgress:
    """A live status line on a terminal; plain lines (one per finished command) otherwise."""

    def __init__(self, stream: TextIO, tty: bool, header: str = "") -> None:
        self.out = Progress(stream, tty)
        self.header = header  # printed (without a TTY) once the batch really starts

    def __call__(self, ev: Any) -> None:  # ev: krex.batch.BatchEvent
        res = ev.result
        if self.header and not self.out.tty:
            self.out.line(self.header.format(jobs=ev.jobs))
        self.header = ""
        if self.out.tty:
            if ev.kind == "done" and res is not None and not res.ok:
                self.out.line(f"#{res.command.index} failed (exit {res.exit_status}): "
                              f"{short(res.command.display)}")
            text = (f"krex batch {bar(ev.done, ev.total)} {ev.done}/{ev.total} done, "
                    f"{ev.running} running, {ev.failed} failed, {ev.elapsed_s:.1f} s")
            if ev.cancelling:
                text += " - stopping (waiting for the running commands)"
            self.out.status(text)
        elif ev.kind == "done" and res is not None:
            state = "ok  " if res.ok else "FAIL"
            self.out.line(f"krex batch: [{ev.done}/{ev.total}] {state} #{res.command.index} exit "
                          f"{res.exit_status} in {fmt_s(res.wall_s)}: {short(res.command.display)}")

    def close(self) -> None:
        self.out.close(keep=True)


@contextmanager
def _cancel_on_signals(cancel: threading.Event) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP stop the batch in order (results are still written)."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, lambda *_: cancel.set()) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _summary_lines(data: dict[str, Any]) -> list[str]:
    share = data.get("region_share")
    share_txt = "-" if share is None else f"{100 * share:.1f}%"
    waits, adm = data["region_waits"], data["admission_waits"]
    tp = data.get("throughput_per_min")
    lines = [
        f"{data['commands']} commands: {data['succeeded']} ok, {data['failures']} failed"
        + (f", {len(data['not_run'])} not run" if data["not_run"] else "")
        + f" in {fmt_s(data['total_wall_s'])} ({'-' if tp is None else f'{tp:.1f}'} commands/min, "
        f"-j {data['jobs']}, device {data['device']})",
        f"regions: {data['regions']}, {fmt_s(data['region_s'])} in regions = {share_txt} of command wall "
        f"time; contaminated regions: {data['contaminated_regions']}",
        f"region waits: total {fmt_s(waits['total_s'])}, p50 {fmt_s(waits['p50_s'])}, "
        f"p95 {fmt_s(waits['p95_s'])}, max {fmt_s(waits['max_s'])}",
        f"admission waits: total {fmt_s(adm['total_s'])}, p95 {fmt_s(adm['p95_s'])}; "
        f"gate blocks: {data['gate_blocks']}, fail-opens: {data['fail_opens']}",
    ]
    if data.get("partition_degraded"):
        lines.append("note: the CPU partition is degraded (cores are shared); see `krex doctor`")
    if data.get("simulated"):
        lines.append("note: these commands ran on the SIMULATED GPU: the timings prove logic, "
                     "never performance")
    if data.get("cut_regions"):
        lines.append(f"CUT regions (ended by --max-region before their end): {data['cut_regions']}")
    if data.get("region_flags"):
        flags = ", ".join(f"{k} {v}" for k, v in data["region_flags"].items())
        lines.append(f"flagged regions by reason: {flags}")
    if data.get("leftovers"):
        lines.append(f"processes that outlived their command: {data['leftovers']} (see each cmd-N.json)")
    per = data.get("per_command") or []
    shown = [p for p in per if p.get("auto_value") or not p.get("regions")][:20]
    for p in shown:
        auto = ""
        if p.get("auto_value"):
            wrapped = ", ".join(p["auto_wrapped"]) or "none"
            other = ", ".join(f"{t['target']} {t['state']}" for t in p["auto_targets"]
                              if t["target"] not in p["auto_wrapped"])
            auto = f"; KREX_AUTO_REGION={p['auto_value']}: wrapped {wrapped}"
            auto += f"; {other}" if other else ""
        lines.append(f"#{p['index']}: {p['regions']} region(s){auto}")
    if len(per) > len(shown) and shown:
        lines.append("(regions of every command: summary.json per_command)")
    for c in data.get("contaminated", []):
        lines.append(f"CONTAMINATED region of #{c['index']}: {'; '.join(c['reasons'])}")
    lines.append(f"results: {data['dir']}/ (summary.json; cmd-N.json, .stdout, .stderr per command)")
    for f in data["failed"]:
        lines.append(f"failed: #{f['index']} exit {f['exit_status']}: {short(f['command'])}  "
                     f"(stderr: {f['stderr']})")
        if f.get("error"):
            lines.append(f"        {short(f['error'], 160)}")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", metavar="FILE")
@click.option("-j", "--jobs", type=int, default=None, metavar="N",
              help="run at most N commands at a time  [default: as many as the node's daemon admits at once; "
                   "a running daemon that admits fewer than N is refused, one started here gets N slots]")
@click.option("--device", default="auto", show_default=True, metavar="[auto|gpu|sim]",
              help="real GPU or the simulated one (passed to each `krex run`)")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="directory for the results (default: ./krex-batch-<timestamp>/; must be new or empty)")
@click.option("--gpu", type=int, default=None, help="GPU index for every command (default: the least loaded)")
def batch(file: str, jobs: int | None, device: str, out_dir: str | None, gpu: int | None) -> None:
    """Run every command of FILE under KREX, at most N at a time.

    FILE holds one shell command per line (blank lines and # comments are
    skipped; each runs as `/bin/sh -c LINE`), or a JSON list of argv lists such
    as [["python", "bench.py", "--n", "1"], ...]. `-` reads standard input.

    Each command runs like `krex run` would. Its stdout and stderr, and a JSON
    result (argv, exit status, wall time, the run report: regions, waits, gate
    blocks, contamination) go to the output directory, with summary.json at
    the end. Exits 1 if any command failed, 130 if interrupted."""
    from krex.batch import BatchFailed, check_args, load_commands, run_batch

    check_args(jobs, device)
    commands = load_commands(file)
    tty = sys.stderr.isatty()
    header = f"krex batch: {len(commands)} command(s), -j {{jobs}}, device {device}"  # -j once known
    view = _BatchProgress(progress_stream(), tty and not quiet(), header)
    cancel = threading.Event()
    try:
        with _cancel_on_signals(cancel):
            summary = run_batch(commands, jobs, device=device, out_dir=out_dir, gpu=gpu, progress=view,
                                cancel=cancel)
    finally:
        view.close()
    for line in _summary_lines(summary.data):
        click.echo(line)
    n = len(commands)
    if summary.interrupted:
        click.echo(f"krex: batch interrupted: {len(summary.data['not_run'])} of {n} command(s) not run, "
                   f"{summary.failures} failed; results so far in {summary.out_dir}", err=True)
        sys.exit(130)
    if summary.failures:
        first = summary.data["failed"][0]
        raise BatchFailed(f"{summary.failures} of {n} command(s) failed",
                          f"see {summary.out_dir}/summary.json and each failed command's .stderr "
                          f"(first: {first['stderr']})")


# ------------------------------------------------------------------------------------ doctor

_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def _coverage_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["{:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>4}  {}".format(
        "workload", "shim_k", "shim_cp", "graphs", "cupti_k", "cupti_cp", "exp_k", "ok", "note")]
    for r in rows:
        shim, cupti = r.get("shim") or {}, r.get("cupti") or {}
        out.append("{:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>4}  {}".format(
            r.get("workload", "?"), shim.get("kernel", "-"), shim.get("copy", "-"), shim.get("graph", "-"),
            cupti.get("kernel", "-"), cupti.get("memcpy", "-"), r.get("expected_kernels", "-"),
            "yes" if r.get("ok") else "NO", r.get("note", "")))
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("binaries", nargs=-1, metavar="[BINARY]...")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--gpu", "gpu", is_flag=True,
              help="also check interposition coverage against CUPTI on the real GPU (needs torch)")
def doctor(binaries: tuple[str, ...], as_json: bool, gpu: bool) -> None:
    """Check that this node is ready for KREX, and say what is degraded.

    Checks privileges, the freezer backend, the CPU partition, the shim, GPUs
    and NVML, MPS and the daemon; each BINARY is checked for a statically
    linked CUDA runtime (which KREX cannot gate). Exits 0 when no check
    failed (warnings allowed), 1 otherwise."""
    from krex.doctor import run_doctor

    live = Progress(sys.stderr, not as_json and sys.stderr.isatty())

    def progress(name: str) -> None:
        if live.tty:
            live.status(f"krex doctor: checking {name}...")
        elif name.startswith("gpu coverage") and not quiet():
            # Without a terminal too: the coverage workloads run for a minute or more.
            live.line(f"krex doctor: checking {name}...")

    try:
        report = run_doctor(binaries, gpu=gpu, progress=progress)
    finally:
        live.close()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        width = max(len(c.name) for c in report.checks)
        pad = " " * (width + 8)
        for c in report.checks:
            click.echo(f"{_MARK.get(c.status, c.status)}  {c.name:<{width}}  {c.finding}")
            if c.fix:
                click.echo(f"{pad}fix: {c.fix}")
            for line in c.details.get("lines", []) if c.status != "ok" else []:
                click.echo(f"{pad}{line}")
            if c.details.get("rows"):
                for line in _coverage_table(c.details["rows"]):
                    click.echo(f"      {line}")
        n_warn, n_fail = report.count("warn"), report.count("fail")
        verdict = "ready" if report.ok else "NOT ready"
        click.echo(f"krex doctor: {verdict}: {len(report.checks)} checks, {n_warn} warning(s), "
                   f"{n_fail} failure(s)")
    sys.exit(0 if report.ok else 1)
