"""`krex bench`: the click layer over krex.bench (all output lives here).

cli/main.py adds the command with `register(cli)`. Errors from the library are
KrexError subclasses, mapped to exit codes by cli/main.py's main()."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import click

from krex.device import DEVICES

from . import progress_stream, quiet
from .progress import Progress, bar, fmt_s

if TYPE_CHECKING:
    from krex.bench import BenchResult
    from krex.bench.records import Summary

__all__ = ["bench", "register"]


def register(cli_group: click.Group) -> None:
    """Add `bench` to the `krex` group (idempotent)."""
    cli_group.add_command(bench)


class _Progress:
    """A live status line on a terminal; plain lines (one per finished run) otherwise."""

    def __init__(self, stream: TextIO, tty: bool) -> None:
        self.out = Progress(stream, tty)
        self.cell = ""

    def __call__(self, ev: Any) -> None:  # ev: krex.bench.BenchEvent
        if ev.kind in ("plan", "note", "cell-skip", "cell-start", "cell-done", "report"):
            if ev.cell:
                self.cell = ev.cell
            self.out.line(f"krex bench: {ev.message}")
        elif ev.kind == "run-done" and ev.record is not None:
            r = ev.record
            if not self.out.tty:
                res = r.get("result") or {}
                ms = res.get("ms")
                state = "ok  " if r.get("ok") else "FAIL"
                detail = f"{ms:.4f} ms" if isinstance(ms, (int, float)) else (r.get("error") or "")
                wall = r.get("wall_s")
                if isinstance(wall, (int, float)):
                    detail += f" (wall {wall:.1f} s)"
                self.out.line(
                    f"krex bench: [{ev.done}/{ev.total}] {state} {r.get('cell')} {r.get('name')} {detail}"
                )
            elif not r.get("ok"):
                self.out.line(f"krex bench: FAIL {r.get('cell')} {r.get('name')}: {r.get('error')}")
        if ev.kind in ("run-done", "tick", "cell-start"):
            eta = ""
            if ev.done and ev.total > ev.done:
                eta = f", ~{fmt_s(ev.elapsed_s / ev.done * (ev.total - ev.done))} left"
            self.out.status(
                f"krex bench {bar(ev.done, ev.total)} {ev.done}/{ev.total} runs, {self.cell}, "
                f"{ev.running} running, {ev.failed} failed, {fmt_s(ev.elapsed_s)}{eta}"
            )

    def finish(self) -> None:
        self.out.close()


def _headline_text(summary: Summary) -> str:
    goals = (summary.get("headline") or {}).get("goals") or []
    rows = [("cell", "metric", "goal", "paper (H20)", "ours", "met")] + [
        (g.get("cell", "-"), g["metric"], g["goal"], g["paper"], g["ours"], g["met"]) for g in goals
    ]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(6)]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(str(x)[: widths[i]].ljust(widths[i]) for i, x in enumerate(r)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _throughput_text(summary: Summary) -> str:
    out = [f"{'cell':<16} {'runs':>5} {'failed':>6} {'makespan s':>10} {'cmds/min':>9} {'vs native':>9}"]
    for t in summary.get("throughput") or []:
        ratio = t["ratio"]
        out.append(
            f"{t['cell']:<16} {t['n_runs']:>5} {t['failures']:>6} {t['makespan_s']:>10.1f} "
            f"{t['cmds_per_min']:>9.1f} "
            + (f"{ratio:>8.2f}x" if ratio is not None and math.isfinite(ratio) else f"{'-':>9}")
        )
    return "\n".join(out)


def _parse_prewarms(text: str) -> list[int]:
    from krex.errors import UsageError

    out: list[int] = []
    for part in text.split(","):
        p = part.strip()
        if not p:
            continue
        if not (p.isascii() and p.isdigit()) or not 0 <= int(p) <= 64:
            raise UsageError(f"bad --prewarm {p!r}", "give a comma list of whole numbers in 0..64, e.g. 0,4")
        if int(p) not in out:
            out.append(int(p))
    if not out:
        raise UsageError("--prewarm lists no value", "give a comma list such as 0,4")
    return out


def _parse_gpus(text: str | None, device: str) -> list[int] | None:
    from krex.errors import UsageError

    if text is None:
        return None
    if text.strip() == "all":
        from krex.device.gpus import discover

        return list(range(discover(device).count))
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(
            f"--gpus {text!r} is not a list of GPU numbers", "pass e.g. --gpus 0,1 or --gpus all"
        ) from None


# `krex bench`'s options, in the order --help lists them
_OPTIONS = [
    click.option(
        "--device",
        type=click.Choice(DEVICES),
        default="auto",
        show_default=True,
        help="real GPU (the GPU corpus) or the simulated one (the SIM corpus)",
    ),
    click.option(
        "--concurrency",
        default=None,
        metavar="LIST",
        help="comma list of C for the unprotected and krex cells  [default: 2,4,8,16; --quick: 2,4; "
        "--resume: the resumed run's]",
    ),
    click.option(
        "--modes",
        default=None,
        metavar="LIST",
        help="comma list of modes to run  [default: reference,native-serial,native-repeat,unprotected,krex; "
        "--resume: the resumed run's; also unprotected-mps, krex-mps: under NVIDIA MPS]",
    ),
    click.option("--quick", is_flag=True, default=None, help="the corpus's quick subset (default C 2,4)"),
    click.option(
        "--resume",
        "resume",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="continue the run in DIR: cells already finished there are skipped",
    ),
    click.option(
        "--out",
        "out",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="results directory  [default: ./krex-bench/DEVICE-TIMESTAMP]",
    ),
    click.option(
        "--repeat",
        type=click.IntRange(1, 100),
        default=None,
        help="corpus passes per cell (more ranking trajectories)  [default: 1]",
    ),
    click.option(
        "--seed", type=int, default=None, help="seed of the cell order and command order  [default: 0]"
    ),
    click.option(
        "--only", default=None, metavar="LIST", help="only commands whose name contains one of these"
    ),
    click.option(
        "--corpus",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="the corpus manifest  [default: the one shipped with krex (examples/workloads/ in a checkout)]",
    ),
    click.option(
        "--timeout",
        type=click.FloatRange(1.0),
        default=None,
        help="seconds per command before it is killed  [default: 900 on a GPU, 120 simulated]",
    ),
    click.option(
        "--slots-per-gpu",
        type=click.IntRange(1, 64),
        default=None,
        help="admission limit of the daemon the bench starts  [default: the largest C]",
    ),
    click.option(
        "--reference-repeat",
        type=click.IntRange(1, 100),
        default=5,
        show_default=True,
        help="passes of the reference cell (tiling families; median)",
    ),
    click.option(
        "--reference-rep-ms",
        type=click.FloatRange(1.0),
        default=None,
        help="timed-loop budget of the reference runs  [default: the commands' own, 100 ms]",
    ),
    click.option(
        "--warm-cache", is_flag=True, help="share compiler caches between runs (default: fresh per run)"
    ),
    click.option(
        "--gpus",
        default=None,
        metavar="LIST",
        help="spread the concurrent cells over these GPUs (0,1 or all), C commands on each at once "
        "[default: one GPU]",
    ),
    click.option(
        "--freeze",
        "freezes",
        default=None,
        metavar="LIST",
        help="compare freeze policies: one krex cell per policy (krex-C@all, krex-C@gpu, krex-C@adaptive) "
        "[default: the daemon's policy]",
    ),
    click.option(
        "--prewarm",
        "prewarms",
        default=None,
        metavar="LIST",
        help="compare pre-warmed starts: one krex cell per value N (krex-C+pwN runs C + N commands at "
        "once, N of them waiting at their first GPU call for a slot; 0 is plain krex-C) [default: 0]",
    ),
    click.option(
        "--lend",
        "lends",
        default=None,
        metavar="LIST",
        help="compare krexd's lend_cores: one krex cell per value of off, region, all (krex-C+lend-X), each "
        "under a daemon the bench starts [default: the daemon's setting]",
    ),
    click.option(
        "--nvml-ms",
        type=click.FloatRange(0.0),
        default=25.0,
        show_default=True,
        help="on a real GPU: NVML samples (SM clock, power, temperature) every MS into nvml.jsonl and each "
        "region's record; 0: none",
    ),
    click.option(
        "--inflated-above",
        type=click.FloatRange(0.0),
        default=None,
        metavar="PCT",
        help="flag precision/recall: a krex run is inflated above PCT percent  [default: the native noise "
        "of its duration band]",
    ),
    click.option("--no-plots", is_flag=True, help="skip the PNG plots"),
]


def _options(f: Any) -> Any:
    for o in reversed(_OPTIONS):
        f = o(f)
    return f


@click.command()
@_options
def bench(
    device: str,
    concurrency: str | None,
    modes: str | None,
    quick: bool | None,
    resume: Path | None,
    out: Path | None,
    repeat: int | None,
    seed: int | None,
    only: str | None,
    corpus: Path | None,
    timeout: float | None,
    slots_per_gpu: int | None,
    reference_repeat: int,
    reference_rep_ms: float | None,
    warm_cache: bool,
    no_plots: bool,
    gpus: str | None,
    freezes: str | None,
    prewarms: str | None,
    lends: str | None,
    nvml_ms: float,
    inflated_above: float | None,
) -> None:
    """Measure throughput, timing inflation and ranking fidelity: native serial,
    native repeat, unprotected sharing and KREX, side by side.

    Writes raw.jsonl, summary.md (goal, paper and ours side by side) and PNG plots
    into the results directory. --device sim is a logic demo, labelled as such."""
    from krex.bench import BenchConfig, parse_concurrency, parse_modes, run_bench
    from krex.errors import UsageError

    if resume and out and resume.resolve() != out.resolve():
        raise UsageError("--resume and --out name different directories", "pass only --resume DIR")
    cfg = BenchConfig(
        device=device,
        modes=parse_modes(modes) if modes else None,
        concurrency=parse_concurrency(concurrency) if concurrency else None,
        quick=quick,
        out_dir=resume or out,
        resume=resume is not None,
        seed=seed,
        repeat=repeat,
        reference_repeat=reference_repeat,
        reference_rep_ms=reference_rep_ms,
        corpus=corpus,
        only=[s.strip() for s in only.split(",") if s.strip()] if only else None,
        timeout_s=timeout,
        slots_per_gpu=slots_per_gpu,
        gpus=_parse_gpus(gpus, device),
        freezes=[f.strip() for f in freezes.split(",") if f.strip()] if freezes else None,
        prewarms=_parse_prewarms(prewarms) if prewarms else None,
        lends=[x.strip() for x in lends.split(",") if x.strip()] if lends else None,
        nvml_ms=nvml_ms,
        inflated_above=None if inflated_above is None else inflated_above / 100.0,
        cold_cache=not warm_cache,
        plots=not no_plots,
        argv=["krex", "bench", *sys.argv[sys.argv.index("bench") + 1 :]]
        if "bench" in sys.argv
        else ["krex", "bench"],
    )
    prog = _Progress(progress_stream(), sys.stderr.isatty() and not quiet())

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # run_bench stops its commands (and a daemon it started), then we exit 130

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        res = run_bench(cfg, progress=prog)
    finally:
        prog.finish()
        for sig, h in old.items():
            signal.signal(sig, h)
    _print_result(res)


def _print_result(res: BenchResult) -> None:
    s = res.summary
    if s.get("simulated"):
        click.echo(f"*** {s.get('label')} ***")
    click.echo(_throughput_text(s))
    click.echo("")
    click.echo(_headline_text(s))
    click.echo("")
    from krex.bench import inductor_line

    if inductor_line(s):  # which way Inductor's autotuning became regions (torch's hook or the fallback)
        click.echo(inductor_line(s))
        click.echo("")
    click.echo(
        f"results: {res.out_dir}  (summary.md, raw.jsonl"
        + (", " + ", ".join(p.name for p in res.plots) if res.plots else "")
        + ")"
    )
    if res.plots_note and not quiet():
        click.echo(res.plots_note, err=True)
    if res.failures:
        click.echo(f"{res.failures} command run(s) failed in this invocation; see summary.md", err=True)
