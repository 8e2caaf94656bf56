"""`krex bench`: throughput, timing fidelity and ranking fidelity, side by side.

One invocation runs a corpus of benchmarking commands (krex.bench.corpus) in several
*cells*; a cell is a mode and a concurrency C (krex.bench.plan):

  reference       native, one at a time, ``reference_repeat`` passes (median), only for
                  families whose true order is "measured" (tiling variants): it
                  establishes that true order (``reference_rep_ms`` lengthens the
                  timed loop through KREX_WL_REP_MS; by default it is the commands' own)
  native-serial   no KREX, one command at a time: command-granular exclusivity, the
                  baseline for throughput and the per-command timing reference
  native-repeat   a second, independent native-serial pass: the noise floor
  unprotected-C   C commands at a time, no KREX
  krex-C          C commands at a time, each under a KREX guardian (region-granular
                  exclusivity; `krex run`'s library entry, krex.runner.guardian_argv)
  unprotected-mps-C, krex-mps-C
                  the same under NVIDIA MPS (krex.bench.mpscell), only when asked for

Cells run in an interleaved order (`plan_cells`) so that drift cannot favour one mode;
the commands of a cell run through krex.runner.Pool. Every command run appends one line
to ``raw.jsonl``; every finished cell one line to ``cells.jsonl``. ``--resume DIR``
skips cells already in ``cells.jsonl`` (runs of a cell that did not finish are ignored
and the cell runs again). At the end the metrics (krex.bench.summary, .metrics) go to
``summary.json`` and ``summary.md``, the plots (krex.bench.plots) to PNG files.

The library never prints: progress goes to the ``progress`` callback as `BenchEvent`s,
always called on the thread that called `run_bench`. Errors are KrexError subclasses.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from krex.bench.benchdaemon import running as _daemon_status
from krex.bench.benchdaemon import start as _start_daemon
from krex.bench.benchdaemon import started_note as _started_note
from krex.bench.benchdaemon import stop as _stop_daemon
from krex.bench.corpus import Workload, corpus_digest, default_corpus_path, load_corpus
from krex.bench.mpscell import CellControl, cell_control, require_mps
from krex.bench.nvmlsample import Sampler, open_sampler
from krex.bench.plan import (
    CELLS,
    CONCURRENT,
    DEFAULT_MODES,
    KREX_MODES,
    LEND_CHOICES,
    META,
    MPS_MODES,
    RAW,
    SCHEMA,
    Cell,
    Job,
    append_jsonl,
    carried_runs,
    load_results,
    order_jobs,
    parse_concurrency,
    parse_modes,
    plan_cells,
    serial_span_s,
)
from krex.bench.records import RunRecord, Summary, Versions
from krex.bench.runstats import compact_report, node_cpu_s, tree_cpu_s
from krex.bench.summary import compute_summary, json_safe, render_summary_md
from krex.errors import KrexError, UsageError
from krex.node.freezepolicy import POLICIES as FREEZE_POLICIES
from krex.runner import TICK_S, Outcome, Pool, Spec, guardian_argv
from krex.worlds import OwnWorld, daemon_misfit, describe

__all__ = ["BenchConfig", "BenchError", "BenchEvent", "BenchResult", "plots_available", "run_bench"]

GRACE_S = 5.0
_T = TypeVar("_T")


class BenchError(KrexError):
    """A bench run could not be done (nothing to run, every command failed, ...)."""

    exit_code = 1


# ------------------------------------------------------------------------------ config, events


@dataclass
class BenchConfig:
    device: str = "auto"  # auto | gpu | sim
    modes: Sequence[str] | None = None  # None: DEFAULT_MODES, or what the resumed run first asked for
    concurrency: Sequence[int] | None = None  # None: (2, 4, 8, 16), or (2, 4) with quick
    quick: bool | None = None  # None: False, or what the resumed run used
    out_dir: Path | None = None
    resume: bool = False  # out_dir holds an earlier run: skip its finished cells
    seed: int | None = None
    repeat: int | None = None  # corpus passes per cell (trajectories for ranking)
    reference_repeat: int = 5
    reference_rep_ms: float | None = None  # None: the commands' own timed loop (see docs/bench.md)
    corpus: Path | None = None
    only: Sequence[str] | None = None
    timeout_s: float | None = None  # per command; None: 900 s on a GPU, 120 s simulated
    slots_per_gpu: int | None = None  # for a daemon the bench starts; None: max C
    # GPUs (positions among the visible ones) the concurrent cells spread over, C commands per
    # GPU on each; None: today's single-GPU behaviour (one GPU, or the daemon's choice).
    gpus: Sequence[int] | None = None
    # Freeze policies to compare: one krex cell per policy (krex-C@gpu, ...); None: one
    # krex-C cell under the daemon's own policy.
    freezes: Sequence[str] | None = None
    # Pre-warmed starts to compare (krexd's `prewarm`): one krex cell per value (krex-C+pwN;
    # 0 is the plain krex-C cell); the bench starts its own daemon for each. None: (0,).
    prewarms: Sequence[int] | None = None
    # krexd's lend_cores to compare (off, region, all): one krex cell per value
    # (krex-C+lend-X); the bench starts its own daemon for each. None: the daemon's own.
    lends: Sequence[str] | None = None
    nvml_ms: float = 25.0  # NVML sample interval on a real GPU (nvmlsample.py); 0: none
    inflated_above: float | None = None  # stated inflation threshold of the flag scores; None: native noise
    cold_cache: bool = True  # fresh Triton/Inductor/extension caches per run (a new candidate compiles)
    warmup: bool = True
    plots: bool = True
    python: str = field(default_factory=lambda: sys.executable)
    argv: Sequence[str] = ()  # the command line, for the record


EventKind = Literal["plan", "note", "cell-skip", "cell-start", "run-done", "cell-done", "tick", "report"]


@dataclass
class BenchEvent:
    kind: EventKind
    cell: str | None = None
    done: int = 0  # command runs finished in this invocation
    total: int = 0  # command runs this invocation will do
    running: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    message: str = ""
    record: RunRecord | None = None


@dataclass
class BenchResult:
    out_dir: Path
    summary: Summary
    summary_md: Path
    plots: list[Path]
    ran: list[str]
    skipped: list[str]
    failures: int
    plots_note: str = ""  # why no plots were drawn although they were asked for


Progress = Callable[[BenchEvent], None]


# -------------------------------------------------------------------------------- helpers


def _now() -> float:
    return time.time()


def _parse_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if isinstance(v, dict) and "ms" in v:
                return v
    return None


def _strip_krex(env: dict[str, str]) -> dict[str, str]:
    """An environment in which krex.region() is a no-op and no shim is preloaded."""
    out = {
        k: v
        for k, v in env.items()
        if k
        not in (
            "KREX_SHM",
            "KREX_SOCKET",
            "KREX_DAEMON_CMD",
            "KREX_DEVICE",
            "KREX_SLOT",
            "KREX_GPU",
            "KREX_STRICT",
        )
    }
    _drop_shim(out)
    return out


def _drop_shim(env: dict[str, str]) -> None:
    """Remove the KREX shim from LD_PRELOAD, keeping anything else preloaded."""
    pre = [
        p
        for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
        if p and "libkrex_interpose" not in p
    ]
    if pre:
        env["LD_PRELOAD"] = ":".join(pre)
    else:
        env.pop("LD_PRELOAD", None)


def _short(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _versions(dev: str, names: list[str]) -> Versions:
    from krex import __version__

    return {
        "krex": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": dev,
        "gpu_names": names,
    }


# --------------------------------------------------------------------------------- commands


class _Commands:
    """A bench job as a runner Spec (its argv, environment and private temporary directory),
    and a finished run as its raw.jsonl record."""

    def __init__(self, cfg: BenchConfig, dev: str, timeout_s: float) -> None:
        self.cfg, self.dev, self.timeout_s = cfg, dev, timeout_s
        self.sampler: Sampler | None = None  # NVML figures of each region, on a real GPU
        self.mps: CellControl | None = None  # an unprotected-mps cell's control daemons, while it runs

    def around(self, cell: Cell, note: Callable[[str], None], run: Callable[..., _T], *args: Any) -> _T:
        """`run(cell, *args)` (the cell's commands) with what the cell needs around it: an
        unprotected-mps cell's MPS control daemons, started before and quit after, however it ends."""
        with cell_control(cell, self.cfg.gpus, self.cfg.device, self.cfg.out_dir, note) as self.mps:
            return run(cell, *args)

    def env_for(self, cell: Cell, tmp: Path) -> dict[str, str]:
        base = dict(os.environ)
        if cell.mode in KREX_MODES:
            # the guardian sets the rest; keep KREX_SHM/KREX_SOCKET/KREX_STATE_DIR (the daemon's)
            env = {k: v for k, v in base.items() if k not in ("KREX_SLOT", "KREX_GPU")}
            _drop_shim(env)
        else:
            env = _strip_krex(base)
        if self.cfg.cold_cache:
            env["TRITON_CACHE_DIR"] = str(tmp / "triton")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
            env["TORCH_EXTENSIONS_DIR"] = str(tmp / "extensions")
        if cell.mode == "reference" and self.cfg.reference_rep_ms:
            env["KREX_WL_REP_MS"] = f"{self.cfg.reference_rep_ms:g}"
            env["KREX_WL_WARMUP_MS"] = f"{max(25.0, self.cfg.reference_rep_ms / 10):g}"
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def spec(self, cell: Cell, job: Job, gpu: int | None) -> Spec:
        w = job.workload
        tmp = Path(tempfile.mkdtemp(prefix="krexbench-"))
        cmd = w.argv(self.cfg.python)
        report = tmp / "report.json" if cell.mode in KREX_MODES else None
        if report is not None:
            cmd = guardian_argv(cmd, report, self.dev, gpu, cell.freeze or None, self.cfg.python)
        env = self.env_for(cell, tmp)
        env.update(dict(w.env))
        if gpu is not None and cell.mode not in KREX_MODES:  # the guardian's --gpu sets it for krex cells
            env["CUDA_VISIBLE_DEVICES"] = _visible_token(gpu)
        if self.mps is not None and cell.mode == "unprotected-mps":  # clients of the cell's control daemon
            env.update(self.mps.client_env(gpu))
        return Spec(cmd, tmp / "stdout", tmp / "stderr", env, str(w.script.parent), self.timeout_s, report)

    def record(self, cell: Cell, run_id: str, job: Job, gpu: int | None, got: Outcome) -> dict[str, Any]:
        """The raw.jsonl line of a finished run; removes the run's temporary directory."""
        w = job.workload
        rec: dict[str, Any] = {
            "v": SCHEMA,
            "run": run_id,
            "cell": cell.key,
            "mode": cell.mode,
            "c": cell.c,
            "rep": job.rep,
            "seq": job.seq,
            "name": w.name,
            "family": w.family,
            "param": w.param,
            "device": self.dev,
            "gpu": gpu,
            "exit_status": None,
            "timed_out": False,
            "ok": False,
            "wall_s": None,
            "started_at": None,
            "ended_at": None,
            "result": None,
            "krex": None,
            "error": None,
        }
        try:
            if got.start_error:
                rec["error"] = got.start_error
                return rec
            stdout, stderr = got.read()
            rec.update(
                started_at=got.started_at,
                ended_at=got.ended_at,
                wall_s=got.wall_s,
                exit_status=got.exit_status,
                timed_out=got.timed_out,
            )
            if got.hang is not None:
                rec["hang"] = got.hang
            res = _parse_result(stdout)
            rec["result"] = res
            if got.report is not None:
                rec["krex"] = compact_report(got.report)
                if self.sampler is not None:
                    self.sampler.annotate(rec["krex"])
            ok = rec["exit_status"] == 0 and res is not None and bool(res.get("correct"))
            if res is not None:
                ms = res.get("ms")
                ok = ok and isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0
            rec["ok"] = ok
            if not ok:
                if rec["timed_out"]:
                    rec["error"] = f"timed out after {self.timeout_s:g} s"
                elif got.cancelled:
                    rec["error"] = "cancelled"
                elif rec["exit_status"] != 0:
                    rec["error"] = f"exit status {rec['exit_status']}"
                elif res is None:
                    rec["error"] = "no JSON result line on stdout"
                else:
                    rec["error"] = "incorrect result" if not res.get("correct") else "bad ms in the result"
                rec["stderr_tail"] = _short(stderr)
                rec["stdout_tail"] = _short(stdout, 1000)
            return rec
        except Exception as e:  # never lose a run silently
            rec.update(ok=False, error=f"bench error: {type(e).__name__}: {e}")
            return rec
        finally:
            shutil.rmtree(got.spec.stdout.parent, ignore_errors=True)


# ------------------------------------------------------------------------------------- main


def _asked_modes(cfg: BenchConfig, first: dict[str, Any]) -> list[str]:
    """The modes to run: those given, else those the resumed run first asked for, else
    DEFAULT_MODES. An MPS mode where MPS cannot run is a UsageError before anything runs."""
    modes = parse_modes(cfg.modes if cfg.modes is not None else first.get("modes") or DEFAULT_MODES)
    if set(modes) & set(MPS_MODES):
        require_mps(cfg.device)
    return modes


def _visible_token(pos: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of visible GPU number ``pos`` (our own list, if set)."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return str(pos)
    toks = [t.strip() for t in spec.split(",") if t.strip()]
    return toks[pos] if 0 <= pos < len(toks) else str(pos)


def _resolve_device(device: str) -> tuple[str, list[str]]:
    from krex.device.gpus import discover

    info = discover(device)
    return ("sim" if info.kind == "sim" else "gpu"), list(info.names)


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run (or continue) a bench; write raw results, summary and plots; return them."""
    return _BenchRun(cfg, progress or (lambda _e: None)).run()


class _BenchRun:
    """One `run_bench` invocation: its settings, results directory and counters, and one
    method per step (results directory, settings, meta.json, plan, daemon, cells, report)."""

    def __init__(self, cfg: BenchConfig, emit: Progress) -> None:
        self.cfg, self.emit = cfg, emit
        self.t_start = time.monotonic()
        self.dev, self.gpu_names = _resolve_device(cfg.device)
        self.done = self.failed = self.total = 0
        self.ran: list[str] = []
        self.started_daemon = False
        # (slots per GPU, prewarm, lend, MPS) of the daemon the bench started, None while it runs none.
        self.ours: tuple[int, int, str, bool] | None = None
        self.own: OwnWorld | None = None
        self.foreign = False  # a daemon that ran already fits and serves every krex cell

    def run(self) -> BenchResult:
        self.open_results()
        self.settings()
        self.write_meta()
        self.plan()
        self.cmds = _Commands(replace(self.cfg, out_dir=self.out_dir), self.dev, self.timeout_s)
        self.choose_daemon()
        self.run_cells()
        return self.report()

    def open_results(self) -> None:
        """The results directory: the resumed one (its meta and finished cells), or a new one."""
        cfg, dev = self.cfg, self.dev
        if cfg.resume:
            if cfg.out_dir is None:
                raise UsageError("--resume needs the results directory", "pass --resume DIR")
            out_dir = cfg.out_dir
            meta, done_cells, _ = load_results(out_dir)
            if meta.get("device") != dev:
                raise UsageError(
                    f"{out_dir} holds a {meta.get('device')} run; this is {dev}",
                    f"pass --device {meta.get('device')}, or start a new results directory",
                )
        else:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            out_dir = cfg.out_dir or Path.cwd() / "krex-bench" / f"{dev}-{stamp}"
            if (out_dir / META).exists() or (out_dir / RAW).exists():
                raise UsageError(
                    f"{out_dir} already holds bench results",
                    f"continue it with --resume {out_dir}, or pick another --out",
                )
            meta, done_cells = {}, []
        self.out_dir, self.meta, self.done_cells = out_dir, meta, done_cells

    def settings(self) -> None:
        """This invocation's settings: the config's, else the resumed run's, else the defaults;
        a resume that would change the corpus, --repeat or --gpus is refused."""
        cfg, dev, meta, out_dir, gpu_names = self.cfg, self.dev, self.meta, self.out_dir, self.gpu_names
        quick = cfg.quick if cfg.quick is not None else bool(meta.get("quick", False))
        seed = cfg.seed if cfg.seed is not None else int(meta.get("seed", 0))
        repeat = cfg.repeat if cfg.repeat is not None else int(meta.get("repeat", 1))
        only = list(cfg.only) if cfg.only is not None else list(meta.get("only") or [])
        corpus_path = (
            cfg.corpus or (Path(meta["corpus"]) if meta.get("corpus") else None) or default_corpus_path()
        )
        if repeat < 1:
            raise UsageError(f"--repeat {repeat} is not a pass count", "use --repeat 1 or more")
        workloads = load_corpus(corpus_path, dev, quick, only)
        digest = corpus_digest(workloads)
        if meta and meta.get("corpus_digest") != digest:
            raise UsageError(
                f"the corpus differs from the one {out_dir} was run with "
                f"({len(workloads)} commands now, {len(meta.get('corpus_names', []))} then)",
                "resume with the same --quick/--only/--corpus, or start a new results directory",
            )
        if meta and int(meta.get("repeat", 1)) != repeat:
            raise UsageError(
                f"{out_dir} was run with --repeat {meta.get('repeat')}", "resume with the same --repeat"
            )
        # A resumed run keeps the modes and concurrency its first invocation asked for, unless
        # new ones are given: resuming must not run cells nobody asked for.
        first = (meta.get("invocations") or [{}])[0]
        modes = _asked_modes(cfg, first)
        conc = parse_concurrency(
            cfg.concurrency
            if cfg.concurrency is not None
            else first.get("concurrency") or ((2, 4) if quick else (2, 4, 8, 16))
        )
        timeout_s = cfg.timeout_s or (120.0 if dev == "sim" else 900.0)
        freezes = list(cfg.freezes) if cfg.freezes else list(first.get("freezes") or [""])
        for f in freezes:
            if f and f not in FREEZE_POLICIES:
                raise UsageError(
                    f"unknown freeze policy {f!r}", f"use a comma list of: {', '.join(FREEZE_POLICIES)}"
                )
        prewarms = list(cfg.prewarms) if cfg.prewarms else list(first.get("prewarms") or [0])
        for w in prewarms:
            if not 0 <= w <= 64:
                raise UsageError(
                    f"bad --prewarm {w}", "give a comma list of whole numbers in 0..64, e.g. 0,4"
                )
        lends = list(cfg.lends) if cfg.lends else list(first.get("lends") or [""])
        for ln in lends:
            if ln and ln not in LEND_CHOICES:
                raise UsageError(f"bad --lend {ln!r}", f"use a comma list of: {', '.join(LEND_CHOICES)}")
        gpus = list(cfg.gpus) if cfg.gpus is not None else (list(meta["gpus"]) if meta.get("gpus") else None)
        if gpus is not None:
            bad = [g for g in gpus if not 0 <= g < len(gpu_names)]
            if bad or len(set(gpus)) != len(gpus) or not gpus:
                raise UsageError(
                    f"--gpus {','.join(map(str, gpus))}: {len(gpu_names)} {dev} GPU(s) are visible "
                    "(numbered from 0), and each may appear once",
                    f"pick from 0..{len(gpu_names) - 1}",
                )
            if meta and meta.get("gpus") not in (None, gpus):
                raise UsageError(
                    f"{out_dir} was run with --gpus {','.join(map(str, meta['gpus']))}",
                    "resume with the same --gpus, or start a new results directory",
                )
        self.cfg = replace(cfg, gpus=gpus)
        self.quick, self.seed, self.repeat, self.only = quick, seed, repeat, only
        self.corpus_path, self.workloads, self.digest = corpus_path, workloads, digest
        self.modes, self.conc, self.timeout_s = modes, conc, timeout_s
        self.freezes, self.prewarms, self.lends = freezes, prewarms, lends

    def write_meta(self) -> None:
        """meta.json: a new run's settings and versions, and this invocation appended."""
        cfg, meta, out_dir = self.cfg, self.meta, self.out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        invocation = {
            "argv": list(cfg.argv),
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "modes": self.modes,
            "concurrency": self.conc,
            "freezes": self.freezes,
            "prewarms": self.prewarms,
            "lends": self.lends,
        }
        if not meta:
            meta = self.meta = {
                "schema": SCHEMA,
                "device": self.dev,
                "quick": self.quick,
                "seed": self.seed,
                "repeat": self.repeat,
                "only": self.only,
                "corpus": str(self.corpus_path.resolve()),
                "corpus_digest": self.digest,
                "corpus_names": [w.name for w in self.workloads],
                "cold_cache": cfg.cold_cache,
                "reference_repeat": cfg.reference_repeat,
                "reference_rep_ms": cfg.reference_rep_ms,
                "gpus": cfg.gpus,
                "created": invocation["started"],
                "versions": _versions(self.dev, self.gpu_names),
                "invocations": [],
            }
        meta.setdefault("invocations", []).append(invocation)
        meta.setdefault("notes", [])
        if cfg.inflated_above is not None:  # the summary's flag scores read it (a resume may set it)
            meta["inflated_above"] = cfg.inflated_above
        (out_dir / META).write_text(json.dumps(meta, indent=1))

    def plan(self) -> None:
        """The cells in order, those still to run, and the runs they will make."""
        out_dir = self.out_dir
        self.measured = [w for w in self.workloads if w.truth == "measured"]
        cells = plan_cells(self.modes, self.conc, self.seed, self.freezes, self.prewarms, self.lends)
        if not self.measured:
            cells = [c for c in cells if c.mode != "reference"]
        done_keys = {str(c.get("cell")) for c in self.done_cells}
        todo = self.todo = [c for c in cells if c.key not in done_keys]
        skipped = self.skipped = [c.key for c in cells if c.key in done_keys]
        total = self.total = sum(len(self.cell_jobs(c, {}, carried_runs(out_dir, c))) for c in todo)
        self.emit(
            BenchEvent(
                "plan",
                total=total,
                message=f"{len(self.workloads)} {self.dev} commands; cells in order: "
                + ", ".join(c.key for c in cells)
                + (f"; already done: {', '.join(skipped)}" if skipped else ""),
            )
        )
        for k in skipped:
            self.emit(
                BenchEvent("cell-skip", cell=k, total=total, message=f"{k}: already in {out_dir}, skipped")
            )

    def cell_jobs(self, c: Cell, hint: dict[str, float], carried: list[RunRecord]) -> list[Job]:
        if c.mode == "reference":
            jobs = order_jobs(c, self.measured, self.cfg.reference_repeat, self.seed, hint)
        else:
            jobs = order_jobs(c, self.workloads, self.repeat, self.seed, hint)
        kept = {(str(r["name"]), int(r.get("rep", 0))) for r in carried}
        return [j for j in jobs if (j.workload.name, j.rep) not in kept]

    def event(self, kind: EventKind, **kw: Any) -> None:
        """Emit an event with this invocation's counters as they are now."""
        self.emit(
            BenchEvent(
                kind, done=self.done, total=self.total, failed=self.failed,
                elapsed_s=time.monotonic() - self.t_start, **kw
            )
        )

    def note(self, msg: str) -> None:
        # Into meta.json at once: an invocation killed by `timeout` keeps its notes too.
        m = json.loads((self.out_dir / META).read_text())
        m["notes"] = list(dict.fromkeys([*m.get("notes", []), msg]))
        (self.out_dir / META).write_text(json.dumps(m, indent=1))
        self.event("note", message=msg)

    def run_cell(self, cell: Cell, run_id: str, jobs: list[Job]) -> tuple[float, float, int]:
        """Run a cell's jobs; (start, last command start, failures). Raises KeyboardInterrupt
        when cancelled (its commands stopped; the cell never counts)."""
        cmds = self.cmds
        # C commands on each GPU at once: place (lane) i stays on one GPU; serial cells
        # run on the first GPU.
        gpus = list(self.cfg.gpus or [])
        width = (cell.c + cell.prewarm) * max(1, len(gpus)) if cell.mode in CONCURRENT else 1
        pool: Pool[Job] = Pool(
            width, stop_signals=(signal.SIGTERM, signal.SIGKILL), grace_s=GRACE_S, tree=True, tick_s=TICK_S
        )
        gpu_of: dict[int, int | None] = {}
        c_start = last_start = _now()
        cell_failed = 0

        def spec(job: Job, lane: int) -> Spec:
            gpu_of[job.seq] = gpus[lane % len(gpus)] if gpus else None
            return cmds.spec(cell, job, gpu_of[job.seq])

        def started(_job: Job) -> None:
            nonlocal last_start
            last_start = _now()

        def finished(job: Job, got: Outcome) -> None:
            nonlocal cell_failed
            rec = cmds.record(cell, run_id, job, gpu_of.pop(job.seq, None), got)
            if got.cancelled:  # killed by the cancel: the cell did not finish, its runs never count
                return
            self.done += 1
            if not rec.get("ok"):
                self.failed += 1
                cell_failed += 1
            append_jsonl(self.out_dir / RAW, rec)
            self.event("run-done", cell=cell.key, running=pool.running, record=rec)

        def tick() -> None:
            self.event("tick", cell=cell.key, running=pool.running)

        if pool.run(jobs, spec, finished, started, tick):
            raise KeyboardInterrupt  # the runs were stopped; the caller exits 130
        return c_start, last_start, cell_failed

    def warm_up(self, workloads: Sequence[Workload]) -> None:
        """One command of each family or script (its shortest), at once (at most the widest
        cell's width), natively and not recorded: the page cache and the driver's and
        compilers' caches of every code path the corpus takes. With one command only, the
        first cell paid for the rest: on a freshly started H200 the first cell's (krex-8) first
        eight commands ran 17% longer than the next cell's (unprotected-8), where on a warm one
        krex-8's ran 15% shorter."""
        cmds = self.cmds
        firsts: dict[str, Workload] = {}
        for w in sorted(workloads, key=lambda w: w.est_wall_s):
            firsts.setdefault(w.family or str(w.script), w)
        ws = list(firsts.values())
        gpus = list(self.cfg.gpus or [])
        width = min(len(ws), max([c.c for c in self.todo if c.mode in CONCURRENT] or [1]) * max(1, len(gpus)))
        self.note(f"warm-up: {', '.join(w.name for w in ws)}, {width} at a time, natively, not recorded")
        warm = Cell("native-serial")
        pool: Pool[Job] = Pool(
            width,
            stop_signals=(signal.SIGTERM, signal.SIGKILL),
            grace_s=GRACE_S,
            tree=True,
            tick_s=TICK_S,
        )
        failed: list[str] = []

        def done(job: Job, got: Outcome) -> None:
            rec = cmds.record(warm, "warmup", job, None, got)  # (not kept: it removes the run's files)
            if not rec.get("ok") and not got.cancelled:
                failed.append(
                    f"{job.workload.name} ({rec.get('error') or 'exit ' + str(rec.get('exit_status'))})"
                )

        jobs = [Job(w, 0, i) for i, w in enumerate(ws)]
        lane_gpu = (lambda lane: gpus[lane % len(gpus)]) if gpus else (lambda _lane: None)
        if pool.run(
            jobs, lambda job, lane: cmds.spec(warm, job, lane_gpu(lane)), done, lambda _j: None, lambda: None
        ):
            raise KeyboardInterrupt
        self.note(
            f"warm-up done: {len(ws) - len(failed)} of {len(ws)} ran cleanly"
            + (f"; failed: {'; '.join(failed)}" if failed else "")
        )

    def choose_daemon(self) -> None:
        """A daemon that runs already serves the krex cells only if it gives them what they need
        (C slots per GPU, the device, no settings of their own); else a simulated bench runs in
        a world of its own, and a bench on real GPUs is refused (two worlds would not exclude
        each other's regions)."""
        dev = self.dev
        self.need = need = max((c.c for c in self.todo if c.mode in KREX_MODES), default=1)
        krex_cells = [c for c in self.todo if c.mode in KREX_MODES]
        st = _daemon_status() if krex_cells else None
        if st is not None:
            special = sorted({c.key for c in krex_cells if c.prewarm or c.lend or c.mode == "krex-mps"})
            misfit = daemon_misfit(st, dev, need, self.cfg.gpus, special)
            if misfit and dev != "sim":
                raise UsageError(
                    f"krex bench cannot measure its krex cells under {describe(st)}: {misfit}",
                    "stop it once it is idle (`krex daemon stop`) and run the bench again: it then starts a "
                    "daemon with the slots its cells need; or keep --concurrency within what it admits "
                    "(and drop --prewarm/--lend)",
                )
            if misfit:
                own = self.own = OwnWorld("bench").enter()
                self.note(
                    f"{describe(st)} does not fit this bench: {misfit}; the bench runs in a KREX world of "
                    f"its own (state {own.state}, segment {own.shm}, its own simulated GPU), "
                    "removed at the end"
                )
            else:
                # Cells without --freeze run under that daemon's freeze policy (its own, as asked).
                self.note(f"using {describe(st)} for the krex cells")
                self.foreign = True

    def daemon_for(self, cell: Cell) -> None:
        """A daemon that admits this krex cell as asked: C + prewarm commands at once, of which
        only C hold a slot when it pre-warms (slots per GPU = C exactly), else max C."""
        slots = cell.c if cell.prewarm else self.cfg.slots_per_gpu or self.need
        want = (slots, cell.prewarm, cell.lend, cell.mode == "krex-mps") if cell.mode in KREX_MODES else None
        if self.foreign or self.ours == want:
            return
        if self.started_daemon:
            _stop_daemon()
            self.started_daemon, self.ours = False, None
        if want is None:  # another cell: a krexd with MPS on is stopped before it (never idles beside it)
            return
        if not _start_daemon(self.dev, *want):
            raise UsageError(
                f"another KREX daemon started while the bench ran (it needed one with {want[0]} slots "
                f"per GPU, prewarm {want[1]} and lend_cores {want[2] or 'its default'})",
                "run the bench with no other daemon on the node",
            )
        self.started_daemon = True
        self.ours = want
        self.note(_started_note(*want))

    def run_cells(self) -> None:
        """The NVML sampler, the warm-up and every cell still to run; then stop what the bench
        started (sampler, daemon, world of its own), however it ends."""
        cmds, out_dir = self.cmds, self.out_dir
        try:
            if self.todo:
                cmds.sampler, why = open_sampler(self.dev, self.cfg.nvml_ms, out_dir)
                self.note(why)
            if self.todo and self.cfg.warmup:
                self.warm_up(self.workloads)
            for cell in self.todo:
                self.cell(cell)
        finally:
            if cmds.sampler is not None:
                cmds.sampler.stop()
            if self.started_daemon:
                _stop_daemon()
            if self.own is not None:
                self.own.exit(keep_log=out_dir / "krexd-own-world.log")

    def cell(self, cell: Cell) -> None:
        """One cell: its jobs (less the runs kept from an unfinished earlier invocation), its
        daemon, its runs, and its line in cells.jsonl."""
        out_dir = self.out_dir
        _, _, prior = load_results(out_dir)
        hint = {
            r["name"]: float(w)
            for r in prior
            if r.get("mode") == "native-serial" and (w := r.get("wall_s")) is not None
        }
        carried = carried_runs(out_dir, cell)
        jobs = self.cell_jobs(cell, hint, carried)
        if cell.mode in KREX_MODES or (self.ours and self.ours[3]):
            self.daemon_for(cell)
        run_id = f"{cell.key}@{_dt.datetime.now().strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self.event("cell-start", cell=cell.key, message=f"{cell.key}: {len(jobs)} runs, {cell.c} at a time")
        prior_span = serial_span_s(carried)
        for r in carried:  # the kept runs join this run id, once the cell is finished
            append_jsonl(out_dir / RAW, {**r, "run": run_id, "ran_in": r.get("ran_in") or r.get("run")})
        if carried:
            self.note(f"{cell.key}: kept {len(carried)} runs of an unfinished earlier invocation")
        krexd = (_daemon_status() or {}).get("daemon", {}).get("pid") if cell.mode in KREX_MODES else None
        krexd_cpu0 = tree_cpu_s(int(krexd)) if krexd else None
        node0 = node_cpu_s()
        c_start, last_start, cell_failed = self.cmds.around(cell, self.note, self.run_cell, run_id, jobs)
        c_end = _now()
        node1 = node_cpu_s()
        krexd_cpu1 = tree_cpu_s(int(krexd)) if krexd else None
        row = {
            "v": SCHEMA,
            "cell": cell.key,
            "mode": cell.mode,
            "c": cell.c,
            "run": run_id,
            "n_runs": len(jobs) + len(carried),
            "carried_runs": len(carried),
            "failures": cell_failed,
            "started_at": c_start,
            "ended_at": c_end,
            "makespan_s": prior_span + (c_end - c_start),
            "last_start_s": last_start - c_start,
            "timeout_s": self.timeout_s,
            # The node's cores busy over this invocation's part of the cell (0..1), and
            # krexd's own CPU seconds (with its watchdog): None where not measured.
            "node_busy": round((node1[0] - node0[0]) / d, 4) if (d := node1[1] - node0[1]) > 0 else None,
            "krexd_cpu_s": round(krexd_cpu1 - krexd_cpu0, 3)
            if krexd_cpu0 is not None and krexd_cpu1 is not None
            else None,
        }
        append_jsonl(out_dir / CELLS, row)
        self.ran.append(cell.key)
        self.event(
            "cell-done",
            cell=cell.key,
            message=f"{cell.key}: {len(jobs)} runs in {c_end - c_start:.1f} s, {cell_failed} failed",
        )

    def report(self) -> BenchResult:
        """summary.json, summary.md and the plots (the notes are in meta.json already)."""
        out_dir = self.out_dir
        meta, cell_rows, recs = load_results(out_dir)
        summary = compute_summary(meta, cell_rows, recs, self.workloads)
        (out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1))
        md = out_dir / "summary.md"
        md.write_text(render_summary_md(summary, out_dir))
        plots: list[Path] = []
        plots_note = ""
        if self.cfg.plots and not plots_available():
            plots_note = PLOTS_MISSING
        elif self.cfg.plots:
            from krex.bench.plots import write_plots

            plots = write_plots(summary, out_dir)
        self.event("report", message=f"summary in {md}")
        if self.done and self.failed == self.done:
            raise BenchError(
                f"all {self.done} command runs of this invocation failed (results are in {out_dir})",
                f"see the Failures table of {md} and stderr_tail in {out_dir / RAW}",
            )
        return BenchResult(out_dir, summary, md, plots, self.ran, self.skipped, self.failed, plots_note)


PLOTS_MISSING = (
    "no plots: matplotlib is not installed (pip install 'krex-gpu[bench]' draws them; "
    "--no-plots silences this)"
)


def plots_available() -> bool:
    """Whether matplotlib can be imported: the plots are an extra (`krex-gpu[bench]`), the
    numbers never depend on it."""
    return importlib.util.find_spec("matplotlib") is not None
