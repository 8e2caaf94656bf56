"""The shapes of a bench results directory, each defined once: a command run (a line of
raw.jsonl), a finished cell (a line of cells.jsonl), a throughput row and the summary
(summary.json). They are plain dicts at run time (JSON in, JSON out); these types say
which keys they hold. Nested parts the summary passes on as they are stay dicts."""

from __future__ import annotations

from typing import Any, TypedDict


class RunRecord(TypedDict, total=False):
    """One command run: a line of raw.jsonl (krex.bench.run._Commands.record)."""

    v: int
    run: str  # the invocation's run id of the cell
    ran_in: str | None  # a kept run of an unfinished earlier invocation: the run id it ran in
    cell: str
    mode: str
    c: int
    rep: int
    seq: int
    name: str
    family: str | None
    param: Any
    device: str
    gpu: int | None
    exit_status: int | None
    timed_out: bool
    ok: bool
    wall_s: float | None
    started_at: float | None
    ended_at: float | None
    result: dict[str, Any] | None  # the command's JSON result line
    krex: dict[str, Any] | None  # the compact `krex run` report (krex.bench.runstats)
    error: str | None
    hang: Any
    stderr_tail: str
    stdout_tail: str


class CellRow(TypedDict, total=False):
    """One finished cell: a line of cells.jsonl (krex.bench.run._BenchRun.cell)."""

    v: int
    cell: str
    mode: str
    c: int
    run: str
    n_runs: int
    carried_runs: int
    failures: int
    started_at: float
    ended_at: float
    makespan_s: float
    last_start_s: float
    timeout_s: float
    node_busy: float | None
    krexd_cpu_s: float | None


class ThroughputRow(TypedDict):
    """A cell's throughput in the summary (NaN where there is no figure)."""

    cell: str
    mode: str
    c: int
    n_runs: int
    failures: int
    makespan_s: float
    cmds_per_min: float
    ratio: float
    steady_cmds_per_min: float
    mean_wall_s: float


class GoalRow(TypedDict):
    """A row of the headline table: a goal, the paper's figure and ours (cell "-": the run's)."""

    cell: str
    metric: str
    goal: str
    paper: str
    ours: str
    met: str


class Truth(TypedDict):
    """A family's true order: where it comes from and each candidate's value (lower: faster)."""

    kind: str
    values: dict[str, float]


class Versions(TypedDict):
    """What a results directory ran on (meta.json's and the summary's versions)."""

    krex: str
    python: str
    platform: str
    machine: str
    cpus: int | None
    device: str
    gpu_names: list[str]


# A distribution as summary.json holds it (krex.bench.metrics.Dist.to_json): n, p50, p95,
# max, mean; None where there is no data. A flip rate (FlipRate.to_json): flips, pairs, rate.
DistJson = dict[str, float | int | None]


class CellRanking(TypedDict):
    """A cell's ranking fidelity: Kendall tau per family (one per pass), their median, and
    the flip rate per true-gap class."""

    tau: dict[str, list[float]]
    tau_median: float
    tau_n: int
    flip: dict[str, DistJson]


class Critical(TypedDict):
    """The critical-region fraction of the native runs: its quantiles and Amdahl bound."""

    n: int
    fractions: list[float]
    p10: float
    p25: float
    p50: float
    p75: float
    p90: float
    share_below_25: float
    aggregate: float
    amdahl_bound: float
    median_bound: float
    paper_median: float


class CellRegions(TypedDict):
    """A cell's regions: entry overhead, queue and admission waits, and what KREX could
    not vouch for."""

    client_entry_s: DistJson
    queue_wait_s: DistJson
    protocol_entry_s: DistJson
    admission_wait_s: DistJson
    regions: int
    contaminated: int
    cut: int
    flags: dict[str, int]
    runs_without_region: int
    auto_wrapped: list[str]
    inductor_regions: dict[str, int]


class Failure(TypedDict):
    """A failed run, as the summary lists it."""

    cell: str | None
    name: str | None
    rep: int | None
    exit_status: int | None
    error: str | None
    stderr_tail: str


class Summary(TypedDict):
    """summary.json: every metric of a results directory (krex.bench.summary.compute_summary)."""

    device: str | None
    simulated: bool
    label: str
    quick: bool | None
    seed: int | None
    repeat: int | None
    commands: int
    cold_cache: bool | None
    versions: Versions
    workload_versions: dict[str, list[str]]
    invocations: list[dict[str, Any]]
    cells_done: list[str]
    throughput: list[ThroughputRow]
    native_cpm: float
    reference: dict[str, Any]
    inflation: dict[str, dict[str, Any]]
    inflation_split: dict[str, dict[str, DistJson]]
    inflation_per_gpu: dict[str, dict[str, dict[str, Any]]]
    truth: dict[str, Truth]
    ranking: dict[str, CellRanking]
    critical: Critical
    regions: dict[str, CellRegions]
    headline: dict[str, Any]
    entry: dict[str, Any]
    flags: dict[str, Any]
    flag_thresholds: dict[str, float]
    flag_threshold_source: str
    nvml: dict[str, Any]
    failures: list[Failure]
    notes: list[str]
    paper: dict[str, Any]
