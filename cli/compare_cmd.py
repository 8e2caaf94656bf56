"""`krex compare`: the click layer over krex.compare (docs/compare.md).

All output lives here (the library never prints). Errors are KrexError subclasses,
mapped to exit codes by cli/main.py's main(). cli/main.py adds the command with
`register(cli)`."""

from __future__ import annotations

import json
from typing import Any

import click

from . import progress_stream

__all__ = ["compare", "register"]


def register(cli_group: click.Group) -> None:
    """Add `compare` to the `krex` group (idempotent)."""
    cli_group.add_command(compare)


@click.command(context_settings={"show_default": True})
@click.argument("candidates", nargs=-1, required=True, metavar="A B [C ...]")
@click.option("--figure", "figure", required=True, metavar="SOURCE",
              help="where each run's figure is: kernelbench, do_bench, pytest-benchmark, json:KEY.PATH or "
                   "re:REGEX (a command may write its output to the file {out} instead of stdout)")
@click.option("--unit", type=click.Choice(["s", "ms", "us", "ns"]), default=None,
              help="the figure's unit (presets know theirs; needed for --pyperf with json:/re:)")
@click.option("--higher-is-better", is_flag=True, help="the figure is a throughput, not a time")
@click.option("--names", default=None, help="comma-separated names of the candidates (default A, B, C, ...)")
@click.option("--confidence", type=float, default=0.95, help="simultaneous over candidates and looks")
@click.option("--min-runs", type=int, default=6, help="runs per candidate before the first look (even)")
@click.option("--max-runs", type=int, default=30, help="runs per candidate at most: the budget")
@click.option("--margin", type=float, default=None,
              help="call a ratio within 1 +- MARGIN equivalent (e.g. 0.01); default: no equivalence")
@click.option("-j", "--jobs", type=int, default=1, help="runs at once (1 balances drift best)")
@click.option("--seed", type=int, default=None, help="the run order's seed (default: random, printed)")
@click.option("--device", type=click.Choice(["auto", "gpu", "sim"]), default="auto")
@click.option("--gpu", type=int, default=None, help="GPU index (default: the least loaded)")
@click.option("--auto-region", default=None, metavar="TARGETS",
              help="KREX_AUTO_REGION for every run (e.g. do_bench, kernelbench)")
@click.option("--nvtx-region", default=None, metavar="PATTERN",
              help="KREX_NVTX_REGION for every run: NVTX ranges whose name matches become regions")
@click.option("--allow-unprotected", is_flag=True,
              help="count runs that made no region (their timing ran unprotected)")
@click.option("--retries", type=int, default=2, help="how often a run whose region was flagged is run again")
@click.option("--timeout", type=float, default=None, help="seconds per run before its tree is killed")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="keep every run's output, report and {out} file here")
@click.option("--pyperf", "pyperf_dir", type=click.Path(file_okay=False), default=None,
              help="write the runs as pyperf JSON, one DIR/<name>.json per candidate")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def compare(candidates: tuple[str, ...], figure: str, unit: str | None, higher_is_better: bool,
            names: str | None, confidence: float, min_runs: int, max_runs: int, margin: float | None,
            jobs: int, seed: int | None, device: str, gpu: int | None, auto_region: str | None,
            nvtx_region: str | None, allow_unprotected: bool, retries: int, timeout: float | None,
            out_dir: str | None,
            pyperf_dir: str | None, as_json: bool) -> None:
    """Is B faster than A? Run the candidates (each a shell command; the first is the
    baseline) interleaved under KREX and report each one's ratio to the first with a
    confidence interval, the probability that the order is wrong, and whether more
    runs would settle it.

    Runs go in randomized palindromic blocks (ABBA, BAAB, ...) until every interval
    excludes 1 or --max-runs is spent. Exit status 0 once the comparison ran, settled
    or not (--json: "settled"); 1 when a candidate's command failed."""
    from pathlib import Path

    from krex.compare.extract import parse_figure
    from krex.compare.run import compare as run_compare
    from krex.executor import Executor

    src = parse_figure(figure, unit, False if higher_is_better else None)
    labels = [n.strip() for n in names.split(",")] if names is not None else None
    err = progress_stream()

    def progress(line: str) -> None:
        click.echo(f"krex compare: {line}", err=True, file=err)

    opts: dict[str, Any] = {}
    if timeout is not None:
        opts["timeout_s"] = timeout
    if auto_region is not None:
        opts["auto_region"] = auto_region
    if nvtx_region is not None:
        opts["nvtx_region"] = nvtx_region
    with Executor(max_workers=jobs, device=device, gpu=gpu,
                  out_dir=Path(out_dir) / "runs" if out_dir else None) as ex:
        cmp = run_compare(ex, list(candidates), src, names=labels, confidence=confidence, min_runs=min_runs,
                          max_runs=max_runs, margin=margin, jobs=jobs, seed=seed,
                          require_region=not allow_unprotected, retries=retries,
                          out_dir=Path(out_dir) / "out" if out_dir else None, progress=progress, **opts)
    written = []
    if pyperf_dir is not None:
        from krex.compare.pyperf_export import write_pyperf

        written = write_pyperf(cmp, pyperf_dir)
    if as_json:
        data = cmp.to_json()
        data["pyperf_files"] = [str(p) for p in written]
        click.echo(json.dumps(data, indent=2))
        return
    for line in cmp.summary_lines():
        click.echo(line)
    if written:
        click.echo(f"pyperf: {' '.join(str(p) for p in written)} "
                   f"(python -m pyperf compare_to {' '.join(str(p) for p in written)})")
