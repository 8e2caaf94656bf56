"""`krex bench`: throughput, timing fidelity and ranking fidelity, side by side.

The parts: `corpus` (the manifest's commands), `plan` (cells, their order, the results
directory and resuming), `run` (running the cells through krex.runner), `mpscell` (the
cells under NVIDIA MPS), `benchdaemon` (the krexd it starts), `metrics`
(pure metric functions), `summary` (summary.json / summary.md: the paper's figures
beside ours) and `plots` (PNGs, matplotlib). The names the CLI and callers use are
re-exported here."""

from krex.bench.corpus import Workload, default_corpus_path, load_corpus
from krex.bench.plan import (
    DEFAULT_MODES,
    MODES,
    MPS_MODES,
    Cell,
    load_results,
    parse_concurrency,
    parse_modes,
    plan_cells,
)
from krex.bench.run import BenchConfig, BenchError, BenchEvent, BenchResult, plots_available, run_bench
from krex.bench.summary import PAPER, SIM_LABEL, compute_summary, inductor_line, render_summary_md

__all__ = [
    "DEFAULT_MODES",
    "MODES",
    "MPS_MODES",
    "PAPER",
    "SIM_LABEL",
    "BenchConfig",
    "BenchError",
    "BenchEvent",
    "BenchResult",
    "Cell",
    "Workload",
    "compute_summary",
    "default_corpus_path",
    "inductor_line",
    "load_corpus",
    "load_results",
    "parse_concurrency",
    "parse_modes",
    "plan_cells",
    "plots_available",
    "render_summary_md",
    "run_bench",
]
