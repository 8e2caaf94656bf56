"""`krex bench`: throughput, timing fidelity and ranking fidelity, side by side.

One invocation runs a corpus of benchmarking commands (examples/workloads/manifest.py)
in several *cells*; a cell is a mode and a concurrency C:

  reference       native, one at a time, ``reference_repeat`` passes (median), only for
                  families whose true order is "measured" (tiling variants): it
                  establishes that true order (``reference_rep_ms`` lengthens the
                  timed loop through KREX_WL_REP_MS; by default it is the commands' own)
  native-serial   no KREX, one command at a time: command-granular exclusivity, the
                  baseline for throughput and the per-command timing reference
  native-repeat   a second, independent native-serial pass: the noise floor
  unprotected-C   C commands at a time, no KREX
  krex-C          C commands at a time, each under ``krex run`` (region-granular exclusivity)

Cells run in an interleaved order (`plan_cells`) so that drift cannot favour one mode.
Every command run appends one line to ``raw.jsonl``; every finished cell one line to
``cells.jsonl``. ``--resume DIR`` skips cells already in ``cells.jsonl`` (runs of a cell
that did not finish are ignored and the cell runs again). At the end the metrics
(krex.bench_metrics) go to ``summary.json`` and ``summary.md``, the plots
(krex.bench_plots) to PNG files.

The library never prints: progress goes to the ``progress`` callback as `BenchEvent`s,
always called on the thread that called `run_bench`. Errors are KrexError subclasses.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.util
import json
import math
import os
import platform
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from krex import bench_metrics as bm
from krex.errors import KrexError, NotFound, UsageError
from krex.node.freezepolicy import POLICIES as FREEZE_POLICIES

__all__ = [
    "MODES",
    "SIM_LABEL",
    "PAPER",
    "BenchConfig",
    "BenchError",
    "BenchEvent",
    "BenchResult",
    "Cell",
    "Workload",
    "compute_summary",
    "default_corpus_path",
    "load_corpus",
    "load_results",
    "parse_concurrency",
    "parse_modes",
    "plan_cells",
    "render_summary_md",
    "run_bench",
]

MODES: tuple[str, ...] = ("reference", "native-serial", "native-repeat", "unprotected", "krex")
CONCURRENT = ("unprotected", "krex")
SIM_LABEL = "SIMULATED GPU - logic demo, not performance evidence"
RAW, CELLS, META = "raw.jsonl", "cells.jsonl", "meta.json"
TICK_S = 0.5
GRACE_S = 5.0
SCHEMA = 1

# The paper's figures (arXiv:2609.30057, NVIDIA H20) and our goals (issue 4).
PAPER: dict[str, Any] = {
    "throughput_ratio": 3.4,
    "native_cpm": 16.0,
    "krex_cpm": 54.8,
    "unprotected_cpm": 41.9,
    "p95_inflation": {">10ms": 0.0030, ">1ms": 0.0158, ">0.1ms": 0.0390},
    "tau": {"krex": 0.857, "native-repeat": 0.820, "unprotected": 0.432},
    "flip_pp": 0.03,
    "critical_fraction_median": 0.12,
}
GOAL_THROUGHPUT = 4.0


class BenchError(KrexError):
    """A bench run could not be done (nothing to run, every command failed, ...)."""

    exit_code = 1


# ------------------------------------------------------------------------------------ corpus


@dataclass(frozen=True)
class Workload:
    name: str
    device: str  # "gpu" or "sim"
    script: Path  # absolute
    args: tuple[str, ...]
    family: str | None = None
    param: float = 0.0
    truth: str | None = None  # "param", "measured" or None
    work: float | None = None
    quick: bool = False
    expect_ms: float = 0.0
    est_wall_s: float = 5.0
    env: tuple[tuple[str, str], ...] = ()  # variables the command runs with, e.g. KREX_AUTO_REGION

    def argv(self, python: str) -> list[str]:
        return [python, str(self.script), *self.args]


def default_corpus_path() -> Path:
    """The corpus that ships with krex: ``krex/workloads/manifest.py`` of an installed
    wheel (package data), else ``examples/workloads/manifest.py`` of the source tree
    this krex runs from (an editable install)."""
    here = Path(__file__).resolve().parent
    tried = [here / "workloads" / "manifest.py", here.parent / "examples" / "workloads" / "manifest.py"]
    for p in tried:
        if p.is_file():
            return p
    raise NotFound(
        f"no workload corpus at {tried[0]} or {tried[1]}",
        "reinstall krex (the corpus ships in the wheel), or pass --corpus PATH/TO/manifest.py",
    )


def _load_manifest(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise NotFound(f"no corpus manifest at {path}", "pass --corpus PATH/TO/manifest.py")
    spec = importlib.util.spec_from_file_location(f"krex_bench_manifest_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path} is not a Python file", "pass the corpus's manifest.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the manifest is user code: report any failure as a usage error
        raise UsageError(f"{path} failed to load: {type(e).__name__}: {e}", "fix the manifest") from e
    items = getattr(mod, "WORKLOADS", None)
    if not isinstance(items, list):
        raise UsageError(f"{path} defines no WORKLOADS list", "define WORKLOADS = [dict(...), ...]")
    return items


def load_corpus(
    path: Path | None, device: str, quick: bool = False, only: Sequence[str] = ()
) -> list[Workload]:
    """The corpus's workloads for ``device`` ("gpu" or "sim"); the ``quick`` subset if
    asked; only names containing one of ``only`` (substrings) if given."""
    path = (path or default_corpus_path()).resolve()
    base = path.parent
    out: list[Workload] = []
    seen: set[str] = set()
    for i, item in enumerate(_load_manifest(path)):
        where = f"{path}: WORKLOADS[{i}]"
        if not isinstance(item, dict) or not {"name", "device", "script", "args"} <= set(item):
            raise UsageError(
                f"{where} needs at least name, device, script and args", "see the manifest's docstring"
            )
        if item["device"] != device:
            continue
        name = str(item["name"])
        if name in seen:
            raise UsageError(f"{where}: duplicate name {name!r}", "give every command a unique name")
        seen.add(name)
        truth = item.get("truth")
        if truth not in (None, "param", "measured"):
            raise UsageError(
                f"{where}: truth must be 'param', 'measured' or None, not {truth!r}", "fix the manifest"
            )
        if truth == "param" and item.get("work") is None:
            raise UsageError(f"{where}: truth 'param' needs 'work'", "give the candidate's relative work")
        script = (base / str(item["script"])).resolve()
        if not script.is_file():
            raise NotFound(f"{where}: script {script} does not exist", "fix the manifest's script path")
        w = Workload(
            name=name,
            device=device,
            script=script,
            args=tuple(str(a) for a in item["args"]),
            family=item.get("family"),
            param=float(item.get("param") or 0.0),
            truth=truth,
            work=None if item.get("work") is None else float(item["work"]),
            quick=bool(item.get("quick", False)),
            expect_ms=float(item.get("expect_ms") or 0.0),
            est_wall_s=float(item.get("est_wall_s") or 5.0),
            env=tuple(sorted((str(k), str(v)) for k, v in (item.get("env") or {}).items())),
        )
        if quick and not w.quick:
            continue
        if only and not any(s in name for s in only):
            continue
        out.append(w)
    if not out:
        what = (
            f"{device} workloads"
            + (" in the --quick subset" if quick else "")
            + (f" matching {','.join(only)}" if only else "")
        )
        raise UsageError(f"{path} has no {what}", "check --device, --quick and --only")
    return out


# ------------------------------------------------------------------------------------- cells


@dataclass(frozen=True, order=True)
class Cell:
    mode: str
    c: int = 1
    freeze: str = ""  # krex cells: the freeze policy their commands ask for ("" = the daemon's)

    @property
    def key(self) -> str:
        base = f"{self.mode}-{self.c}" if self.mode in CONCURRENT else self.mode
        return f"{base}@{self.freeze}" if self.freeze else base

    @staticmethod
    def from_key(key: str) -> Cell:
        if "@" in key:
            base, _, freeze = key.partition("@")
            c = Cell.from_key(base)
            if c.mode != "krex" or freeze not in FREEZE_POLICIES:
                raise UsageError(
                    f"unknown cell {key!r}", "krex-C@POLICY takes a freeze policy: all, gpu, adaptive"
                )
            return Cell(c.mode, c.c, freeze)
        for m in CONCURRENT:
            if key.startswith(m + "-") and key[len(m) + 1 :].isdigit():
                return Cell(m, int(key[len(m) + 1 :]))
        if key in MODES:
            return Cell(key, 1)
        raise UsageError(
            f"unknown cell {key!r}",
            "cells are reference, native-serial, native-repeat, unprotected-C or krex-C",
        )


def parse_modes(text: str | Sequence[str]) -> list[str]:
    """'native-serial,krex' -> ['native-serial', 'krex'] (validated, deduplicated)."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    out: list[str] = []
    for s in items:
        if not s:
            continue
        if s not in MODES:
            raise UsageError(f"unknown mode {s!r}", f"use a comma list of: {', '.join(MODES)}")
        if s not in out:
            out.append(s)
    if not out:
        raise UsageError("no mode given", f"use a comma list of: {', '.join(MODES)}")
    return out


def parse_concurrency(text: str | Sequence[int]) -> list[int]:
    """'2,4,8' -> [2, 4, 8] (each in 1..64, deduplicated, in the given order)."""
    raw: list[str] = text.split(",") if isinstance(text, str) else [str(x) for x in text]
    out: list[int] = []
    for s in raw:
        s = s.strip()
        if not s:
            continue
        if not s.isdigit() or not 1 <= int(s) <= 64:
            raise UsageError(
                f"bad concurrency {s!r}", "give a comma list of integers in 1..64, e.g. 2,4,8,16"
            )
        if int(s) not in out:
            out.append(int(s))
    if not out:
        raise UsageError("no concurrency given", "give a comma list such as 2,4,8,16")
    return out


def plan_cells(
    modes: Sequence[str], concurrency: Sequence[int], seed: int, freezes: Sequence[str] = ("",)
) -> list[Cell]:
    """The order in which cells run.

    reference first (it only establishes true orders), then native-serial (the
    reference for inflation, so that a partial run is already useful); then, for each
    C in a seeded random order, the unprotected-C and krex-C cells back to back in a
    seeded random order; native-repeat goes into the middle of that sequence so that
    slow drift over the run shows up as native-serial vs native-repeat difference
    (the noise floor) instead of favouring one mode."""
    rng = random.Random(seed)
    head = [Cell(m) for m in ("reference", "native-serial") if m in modes]
    cs = list(concurrency)
    rng.shuffle(cs)
    pairs: list[list[Cell]] = []
    for c in cs:
        pair = [Cell(m, c, f) for m in CONCURRENT if m in modes for f in (freezes if m == "krex" else ("",))]
        rng.shuffle(pair)
        if pair:
            pairs.append(pair)
    middle: list[Cell] = []
    for i, pair in enumerate(pairs):
        if i == len(pairs) // 2 and "native-repeat" in modes:
            middle.append(Cell("native-repeat"))
        middle.extend(pair)
    if "native-repeat" in modes and Cell("native-repeat") not in middle:
        middle.append(Cell("native-repeat"))
    return head + middle


# ------------------------------------------------------------------------------ config, events


@dataclass
class BenchConfig:
    device: str = "auto"  # auto | gpu | sim
    modes: Sequence[str] | None = None  # None: MODES, or what the resumed run first asked for
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
    record: dict[str, Any] | None = None


@dataclass
class BenchResult:
    out_dir: Path
    summary: dict[str, Any]
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


def _append_jsonl(path: Path, rec: dict[str, Any]) -> None:
    line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                v = json.loads(line)
            except ValueError:
                continue  # a torn last line after a crash
            if isinstance(v, dict):
                out.append(v)
    return out


def load_results(out_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(meta, finished cells, raw records of finished cells) of a results directory."""
    mp = out_dir / META
    if not mp.exists():
        raise NotFound(
            f"{out_dir} holds no krex bench results ({META} is missing)",
            "pass the directory an earlier `krex bench` wrote",
        )
    try:
        meta = json.loads(mp.read_text())
    except ValueError as e:
        raise UsageError(
            f"{mp} is not valid JSON: {e}", "restore it, or start a new results directory"
        ) from e
    cells = _read_jsonl(out_dir / CELLS)
    done_runs = {c.get("run") for c in cells}
    recs = [r for r in _read_jsonl(out_dir / RAW) if r.get("run") in done_runs]
    return meta, cells, recs


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


def _kill_tree(pid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM a process and all its descendants (found before anything dies), then
    SIGKILL what is left after ``grace_s``. Frozen processes are killed too (cgroup v2
    delivers SIGKILL to frozen tasks; SIGCONT covers SIGSTOP-frozen ones)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _tree_state(pid: int) -> list[dict[str, Any]]:
    """What a hung command's processes are doing (for the record, before they are killed):
    state, kernel wait channel, cgroup, and the threads' states."""
    import psutil

    out: list[dict[str, Any]] = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        d: dict[str, Any] = {"pid": p.pid}
        with contextlib.suppress(psutil.Error, OSError):
            d["cmd"] = " ".join(p.cmdline())[-160:]
            d["status"] = p.status()
            d["wchan"] = Path(f"/proc/{p.pid}/wchan").read_text().strip()
            d["cgroup"] = Path(f"/proc/{p.pid}/cgroup").read_text().strip().splitlines()[-1:]
            d["threads"] = sorted(
                {Path(f"/proc/{p.pid}/task/{t.id}/wchan").read_text().strip() for t in p.threads()}
            )
        out.append(d)
    return out


def _short(text: str, n: int = 2000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _versions(dev: str, names: list[str]) -> dict[str, Any]:
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


def _corpus_digest(workloads: Sequence[Workload]) -> str:
    h = hashlib.sha256()
    for w in workloads:
        h.update(json.dumps([w.name, list(w.args), w.family, w.truth, w.work]).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------- running


@dataclass
class _Job:
    workload: Workload
    rep: int
    seq: int


class _Runner:
    """Runs command jobs, C at a time, each in a session of its own; kills what is left
    on cancel."""

    def __init__(self, cfg: BenchConfig, dev: str, out_dir: Path, timeout_s: float) -> None:
        self.cfg, self.dev, self.out_dir, self.timeout_s = cfg, dev, out_dir, timeout_s
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.cancelled = threading.Event()

    def env_for(self, cell: Cell, tmp: Path) -> dict[str, str]:
        base = dict(os.environ)
        if (
            cell.mode == "krex"
        ):  # `krex run` sets the rest; keep KREX_SHM/KREX_SOCKET/KREX_STATE_DIR (the daemon's)
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

    def argv_for(self, cell: Cell, w: Workload, report: Path, gpu: int | None = None) -> list[str]:
        cmd = w.argv(self.cfg.python)
        if cell.mode != "krex":
            return cmd
        where = ["--gpu", str(gpu)] if gpu is not None else []
        if cell.freeze:
            where += ["--freeze", cell.freeze]
        return [
            self.cfg.python,
            "-m",
            "krex.cli.main",
            "run",
            "--device",
            self.dev,
            *where,
            "--report",
            str(report),
            "--",
            *cmd,
        ]

    def run_one(self, cell: Cell, run_id: str, job: _Job, gpu: int | None = None) -> dict[str, Any]:
        w = job.workload
        tmp = Path(tempfile.mkdtemp(prefix="krexbench-"))
        report = tmp / "report.json"
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
            if self.cancelled.is_set():
                rec["error"] = "cancelled before start"
                return rec
            argv = self.argv_for(cell, w, report, gpu)
            env = self.env_for(cell, tmp)
            env.update(dict(w.env))
            if gpu is not None and cell.mode != "krex":  # `krex run --gpu` sets it for krex cells
                env["CUDA_VISIBLE_DEVICES"] = _visible_token(gpu)
            t0 = _now()
            p0 = time.perf_counter()
            try:
                proc = subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    cwd=str(w.script.parent),
                    start_new_session=True,
                )
            except OSError as e:
                rec["error"] = f"could not start: {e}"
                return rec
            with self.lock:
                self.procs[proc.pid] = proc
            rec["started_at"] = t0
            try:
                out, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                rec["timed_out"] = True
                rec["hang"] = _tree_state(proc.pid)
                _kill_tree(proc.pid)
                out, err = proc.communicate()
            finally:
                with self.lock:
                    self.procs.pop(proc.pid, None)
            rec["wall_s"] = time.perf_counter() - p0
            rec["ended_at"] = _now()
            rec["exit_status"] = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
            res = _parse_result(stdout)
            rec["result"] = res
            if cell.mode == "krex" and report.exists():
                with contextlib.suppress(OSError, ValueError):
                    rec["krex"] = _compact_report(json.loads(report.read_text()))
            ok = rec["exit_status"] == 0 and res is not None and bool(res.get("correct"))
            if res is not None:
                ms = res.get("ms")
                ok = ok and isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0
            rec["ok"] = ok
            if not ok:
                if rec["timed_out"]:
                    rec["error"] = f"timed out after {self.timeout_s:g} s"
                elif self.cancelled.is_set():
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
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def cancel(self) -> None:
        self.cancelled.set()
        with self.lock:
            pids = list(self.procs)
        threads = [threading.Thread(target=_kill_tree, args=(pid,), daemon=True) for pid in pids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=3 * GRACE_S)


def _compact_report(rep: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "queue_wait_s",
        "block_s",
        "inflight_s",
        "drain_s",
        "freeze_s",
        "pin_s",
        "entry_s",
        "region_s",
        "thaw_s",
        "contaminated",
        "reasons",
        "siblings_frozen",
        "drained",
        "partition_degraded",
        "freezer",
        "freeze_policy",
        "running_slots",
        "freeze_why",
        "cut",
        "flags",
        "label",
        "attest",
    )
    regions = [{k: r.get(k) for k in keys if k in r} for r in rep.get("regions") or [] if isinstance(r, dict)]
    return {
        "slot": rep.get("slot"),
        "gpu": rep.get("gpu"),
        "admission_wait_s": rep.get("admission_wait_s"),
        "gate_blocks": rep.get("gate_blocks"),
        "gate_blocked_ms": rep.get("gate_blocked_ms"),
        "fail_opens": rep.get("fail_opens"),
        "contaminated_regions": rep.get("contaminated_regions"),
        "region_wait_s": rep.get("region_wait_s"),
        "cut_regions": rep.get("cut_regions"),
        "simulated": rep.get("simulated"),
        "leftovers": len(rep.get("leftovers") or []),
        "auto_region": {
            k: (rep.get("auto_region") or {}).get(k) for k in ("value", "wrapped", "auto_regions")
        }
        if rep.get("auto_region")
        else None,
        "regions": regions,
    }


# ----------------------------------------------------------------------------------- daemon


def _daemon_status() -> dict[str, Any] | None:
    from krex.client import Client, daemon_alive

    if not daemon_alive():
        return None
    c = Client.connect()
    try:
        return c.request({"op": "status"})
    finally:
        c.close()


def _start_daemon(dev: str, slots: int) -> None:
    from krex.client import start_background

    start_background(device=dev, settings={"idle_exit_s": 600.0, "slots_per_gpu": max(1, min(64, slots))})


def _stop_daemon() -> None:
    from krex.client import Client, daemon_alive

    with contextlib.suppress(KrexError, OSError):
        c = Client.connect()
        try:
            c.request({"op": "shutdown"})
        finally:
            c.close()
    for _ in range(100):
        if not daemon_alive():
            return
        time.sleep(0.05)


# ------------------------------------------------------------------------------------- main


def _order_jobs(
    cell: Cell, workloads: Sequence[Workload], repeat: int, seed: int, wall_hint: dict[str, float]
) -> list[_Job]:
    """Serial cells: a seeded shuffle per pass. Concurrent cells: longest first (by the
    native-serial wall time, else the manifest's estimate), ties in seeded random order,
    which keeps the end-of-cell tail (fewer than C commands left) short."""
    rng = random.Random(f"{seed}:{cell.key}")
    jobs: list[_Job] = []
    for rep in range(repeat):
        ws = list(workloads)
        rng.shuffle(ws)
        jobs.extend(_Job(w, rep, 0) for w in ws)
    if cell.mode in CONCURRENT:
        jobs.sort(key=lambda j: -wall_hint.get(j.workload.name, j.workload.est_wall_s))
    for i, j in enumerate(jobs):
        j.seq = i
    return jobs


def _carried_runs(out_dir: Path, cell: Cell) -> list[dict[str, Any]]:
    """Finished, successful runs of a serial cell whose invocation stopped before the cell
    did (killed, timed out, interrupted). A serial run does not depend on its neighbours,
    so `--resume` keeps them and runs only the rest; a concurrent cell always runs again
    whole, since its makespan and its contention need all of its commands together."""
    if cell.mode in CONCURRENT:
        return []
    finished = {c.get("run") for c in _read_jsonl(out_dir / CELLS)}
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in _read_jsonl(out_dir / RAW):
        if r.get("cell") == cell.key and r.get("run") not in finished and r.get("ok"):
            best[(str(r.get("name")), int(r.get("rep", 0)))] = r
    return list(best.values())


def _serial_span_s(recs: Iterable[dict[str, Any]]) -> float:
    """Wall time the given runs took, summed over the invocations they ran in
    (``ran_in``): the makespan a serial cell had before it was resumed."""
    spans: dict[str, tuple[float, float]] = {}
    for r in recs:
        a, b = r.get("started_at"), r.get("ended_at")
        if a is None or b is None:
            continue
        k = str(r.get("ran_in") or r.get("run"))
        lo, hi = spans.get(k, (float(a), float(b)))
        spans[k] = (min(lo, float(a)), max(hi, float(b)))
    return sum(hi - lo for lo, hi in spans.values())


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


class _CellPool:
    """The jobs of one cell on ``width`` worker threads (C for concurrent cells, else 1);
    finished records arrive on ``results``."""

    def __init__(self, runner: _Runner, cell: Cell, run_id: str, jobs: Sequence[_Job]) -> None:
        self.runner, self.cell, self.run_id = runner, cell, run_id
        self.pending = list(jobs)
        self.results: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lock = threading.Lock()
        self.running = 0
        self.started_at = _now()
        self.last_start = self.started_at

    def start(self) -> list[threading.Thread]:
        gpus = list(self.runner.cfg.gpus or [])
        concurrent = self.cell.mode in CONCURRENT
        width = (self.cell.c * max(1, len(gpus))) if concurrent else 1
        # Worker i stays on one GPU, so each GPU has exactly C commands at a time; serial
        # cells run on the first GPU.
        threads = [
            threading.Thread(
                target=self._worker,
                args=(gpus[i % len(gpus)] if gpus else None,),
                daemon=True,
                name=f"bench-{i}",
            )
            for i in range(width)
        ]
        for t in threads:
            t.start()
        return threads

    def _worker(self, gpu: int | None) -> None:
        while True:
            with self.lock:
                if not self.pending or self.runner.cancelled.is_set():
                    return
                job = self.pending.pop(0)
                self.running += 1
                self.last_start = _now()
            try:
                rec = self.runner.run_one(self.cell, self.run_id, job, gpu)
            except Exception as e:  # never lose a worker silently
                rec = {
                    "v": SCHEMA,
                    "run": self.run_id,
                    "cell": self.cell.key,
                    "mode": self.cell.mode,
                    "c": self.cell.c,
                    "rep": job.rep,
                    "seq": job.seq,
                    "name": job.workload.name,
                    "ok": False,
                    "error": f"bench error: {type(e).__name__}: {e}",
                }
            with self.lock:
                self.running -= 1
            self.results.put(rec)


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run (or continue) a bench; write raw results, summary and plots; return them."""
    emit: Progress = progress or (lambda _e: None)
    t_start = time.monotonic()
    dev, gpu_names = _resolve_device(cfg.device)

    # ---- results directory and meta
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
    digest = _corpus_digest(workloads)
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
    modes = parse_modes(cfg.modes if cfg.modes is not None else first.get("modes") or MODES)
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
    cfg = replace(cfg, gpus=gpus)

    out_dir.mkdir(parents=True, exist_ok=True)
    invocation = {
        "argv": list(cfg.argv),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "modes": modes,
        "concurrency": conc,
        "freezes": freezes,
    }
    if not meta:
        meta = {
            "schema": SCHEMA,
            "device": dev,
            "quick": quick,
            "seed": seed,
            "repeat": repeat,
            "only": only,
            "corpus": str(corpus_path.resolve()),
            "corpus_digest": digest,
            "corpus_names": [w.name for w in workloads],
            "cold_cache": cfg.cold_cache,
            "reference_repeat": cfg.reference_repeat,
            "reference_rep_ms": cfg.reference_rep_ms,
            "gpus": gpus,
            "created": invocation["started"],
            "versions": _versions(dev, gpu_names),
            "invocations": [],
        }
    meta.setdefault("invocations", []).append(invocation)
    meta.setdefault("notes", [])
    (out_dir / META).write_text(json.dumps(meta, indent=1))

    # ---- plan
    measured = [w for w in workloads if w.truth == "measured"]
    cells = plan_cells(modes, conc, seed, freezes)
    if not measured:
        cells = [c for c in cells if c.mode != "reference"]
    done_keys = {str(c.get("cell")) for c in done_cells}
    todo = [c for c in cells if c.key not in done_keys]
    skipped = [c.key for c in cells if c.key in done_keys]

    def cell_jobs(c: Cell, hint: dict[str, float], carried: list[dict[str, Any]]) -> list[_Job]:
        if c.mode == "reference":
            jobs = _order_jobs(c, measured, cfg.reference_repeat, seed, hint)
        else:
            jobs = _order_jobs(c, workloads, repeat, seed, hint)
        kept = {(str(r["name"]), int(r.get("rep", 0))) for r in carried}
        return [j for j in jobs if (j.workload.name, j.rep) not in kept]

    total = sum(len(cell_jobs(c, {}, _carried_runs(out_dir, c))) for c in todo)
    emit(
        BenchEvent(
            "plan",
            total=total,
            message=f"{len(workloads)} {dev} commands; cells in order: "
            + ", ".join(c.key for c in cells)
            + (f"; already done: {', '.join(skipped)}" if skipped else ""),
        )
    )
    for k in skipped:
        emit(BenchEvent("cell-skip", cell=k, total=total, message=f"{k}: already in {out_dir}, skipped"))

    runner = _Runner(cfg, dev, out_dir, timeout_s)
    done = failed = 0
    ran: list[str] = []
    started_daemon = False

    def event(kind: EventKind, **kw: Any) -> None:
        """Emit an event with this invocation's counters as they are now."""
        emit(
            BenchEvent(
                kind, done=done, total=total, failed=failed, elapsed_s=time.monotonic() - t_start, **kw
            )
        )

    def note(msg: str) -> None:
        # Into meta.json at once: an invocation killed by `timeout` keeps its notes too.
        m = json.loads((out_dir / META).read_text())
        m["notes"] = list(dict.fromkeys([*m.get("notes", []), msg]))
        (out_dir / META).write_text(json.dumps(m, indent=1))
        event("note", message=msg)

    try:
        if todo and any(c.mode == "krex" for c in todo):
            need = max(c.c for c in todo if c.mode == "krex")
            st = _daemon_status()
            if st is None:
                slots = cfg.slots_per_gpu or need
                _start_daemon(dev, slots)
                started_daemon = True
                note(f"started a KREX daemon for the krex cells ({slots} slots per GPU); stopped at the end")
            else:
                have = min(st.get("slots_per_gpu") or [need])
                pid = st.get("daemon", {}).get("pid")
                note(f"using the running KREX daemon (pid {pid}, {have} slots per GPU)")
                if have < need:
                    note(
                        f"the running daemon admits {have} commands per GPU at a time, fewer than C={need}: "
                        "krex cells above that queue at admission"
                    )
        if todo and cfg.warmup:
            w0 = min(workloads, key=lambda w: w.est_wall_s)
            note(f"warm-up: {w0.name} once, natively, not recorded (page cache, driver caches)")
            runner.run_one(Cell("native-serial"), "warmup", _Job(w0, 0, 0))

        for cell in todo:
            _, _, prior = load_results(out_dir)
            hint = {
                r["name"]: float(r["wall_s"])
                for r in prior
                if r.get("mode") == "native-serial" and r.get("wall_s") is not None
            }
            carried = _carried_runs(out_dir, cell)
            jobs = cell_jobs(cell, hint, carried)
            run_id = f"{cell.key}@{_dt.datetime.now().strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            event("cell-start", cell=cell.key, message=f"{cell.key}: {len(jobs)} runs, {cell.c} at a time")
            prior_span = _serial_span_s(carried)
            for r in carried:  # the kept runs join this run id, once the cell is finished
                _append_jsonl(out_dir / RAW, {**r, "run": run_id, "ran_in": r.get("ran_in") or r.get("run")})
            if carried:
                note(f"{cell.key}: kept {len(carried)} runs of an unfinished earlier invocation")
            pool = _CellPool(runner, cell, run_id, jobs)
            c_start = pool.started_at
            cell_failed = 0
            threads = pool.start()
            got = 0
            try:
                while got < len(jobs):
                    try:
                        rec = pool.results.get(timeout=TICK_S)
                    except queue.Empty:
                        if not any(t.is_alive() for t in threads) and pool.results.empty():
                            break
                        event("tick", cell=cell.key, running=pool.running)
                        continue
                    got += 1
                    done += 1
                    if not rec.get("ok"):
                        failed += 1
                        cell_failed += 1
                    _append_jsonl(out_dir / RAW, rec)
                    event("run-done", cell=cell.key, running=pool.running, record=rec)
            except BaseException:
                runner.cancel()
                for t in threads:
                    t.join(timeout=3 * GRACE_S)
                raise
            for t in threads:
                t.join()
            c_end = _now()
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
                "last_start_s": pool.last_start - c_start,
                "timeout_s": timeout_s,
            }
            _append_jsonl(out_dir / CELLS, row)
            ran.append(cell.key)
            event(
                "cell-done",
                cell=cell.key,
                message=f"{cell.key}: {len(jobs)} runs in {c_end - c_start:.1f} s, {cell_failed} failed",
            )
    finally:
        if started_daemon:
            _stop_daemon()

    # ---- report (the notes are in meta.json already)
    meta, cell_rows, recs = load_results(out_dir)
    summary = compute_summary(meta, cell_rows, recs, workloads)
    (out_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1))
    md = out_dir / "summary.md"
    md.write_text(render_summary_md(summary, out_dir))
    plots: list[Path] = []
    plots_note = ""
    if cfg.plots and not plots_available():
        plots_note = PLOTS_MISSING
    elif cfg.plots:
        from krex.bench_plots import write_plots

        plots = write_plots(summary, out_dir)
    event("report", message=f"summary in {md}")
    if done and failed == done:
        raise BenchError(
            f"all {done} command runs of this invocation failed (results are in {out_dir})",
            f"see the Failures table of {md} and stderr_tail in {out_dir / RAW}",
        )
    return BenchResult(out_dir, summary, md, plots, ran, skipped, failed, plots_note)


PLOTS_MISSING = (
    "no plots: matplotlib is not installed (pip install 'krex[bench]' draws them; --no-plots silences this)"
)


def plots_available() -> bool:
    """Whether matplotlib can be imported: the plots are an extra (`krex[bench]`), the
    numbers never depend on it."""
    return importlib.util.find_spec("matplotlib") is not None


# ----------------------------------------------------------------------------------- metrics


def _json_safe(v: Any) -> Any:
    if isinstance(v, float):
        return None if not math.isfinite(v) else v
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def _ms(r: dict[str, Any]) -> float | None:
    res = r.get("result")
    if not r.get("ok") or not isinstance(res, dict):
        return None
    v = res.get("ms")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _cell_sort_key(key: str) -> tuple[int, int, str]:
    c = Cell.from_key(key)
    return MODES.index(c.mode), c.c, c.freeze


def compute_summary(
    meta: dict[str, Any],
    cells: Sequence[dict[str, Any]],
    recs: Sequence[dict[str, Any]],
    workloads: Sequence[Workload],
) -> dict[str, Any]:
    """Every metric of a results directory, as one JSON-able dict (see docs/bench.md)."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        by_cell[str(r.get("cell"))].append(r)
    cell_rows = {str(c["cell"]): c for c in cells}
    keys = sorted(cell_rows, key=_cell_sort_key)
    notes: list[str] = list(meta.get("notes", []))
    wl = {w.name: w for w in workloads}

    # Reference per command: median ms and wall over the native-serial cell.
    ref_ms: dict[str, float] = {}
    ref_wall: dict[str, float] = {}
    ns = by_cell.get("native-serial", [])
    for name in {r["name"] for r in ns}:
        xs = [m for r in ns if r["name"] == name and (m := _ms(r)) is not None]
        walls_n = [float(r["wall_s"]) for r in ns if r["name"] == name and r.get("ok") and r.get("wall_s")]
        if xs:
            ref_ms[name] = bm.median(xs)
        if walls_n:
            ref_wall[name] = bm.median(walls_n)
    if not ref_ms:
        notes.append("no native-serial results: inflation and the throughput ratio are not available")

    # Throughput.
    ns_cpm = math.nan
    if "native-serial" in cell_rows:
        row = cell_rows["native-serial"]
        n_ok = sum(1 for r in by_cell.get("native-serial", []) if r.get("ok"))
        ns_cpm = bm.throughput_per_min(n_ok, float(row["makespan_s"]))
    thr: list[dict[str, Any]] = []
    for k in keys:
        row = cell_rows[k]
        if row["mode"] == "reference":
            continue
        rs = by_cell.get(k, [])
        n_ok = sum(1 for r in rs if r.get("ok"))
        cpm = bm.throughput_per_min(n_ok, float(row["makespan_s"]))
        walls = [float(r["wall_s"]) for r in rs if r.get("wall_s")]
        last = float(row.get("last_start_s") or 0.0)
        t0 = float(row["started_at"])
        steady = math.nan
        if last > 0 and row["mode"] in CONCURRENT:
            n_in = sum(
                1 for r in rs if r.get("ok") and r.get("ended_at") and float(r["ended_at"]) - t0 <= last
            )
            if n_in >= int(row["c"]):
                steady = 60.0 * n_in / last
        thr.append(
            {
                "cell": k,
                "mode": row["mode"],
                "c": int(row["c"]),
                "n_runs": int(row["n_runs"]),
                "failures": int(row["failures"]),
                "makespan_s": float(row["makespan_s"]),
                "cmds_per_min": cpm,
                "ratio": cpm / ns_cpm if ns_cpm and math.isfinite(ns_cpm) else math.nan,
                "steady_cmds_per_min": steady,
                "mean_wall_s": sum(walls) / len(walls) if walls else math.nan,
            }
        )

    # Inflation vs native-serial.
    infl: dict[str, dict[str, Any]] = {}
    for k in keys:
        if k in ("native-serial", "reference"):
            continue
        pairs = [
            (ref_ms[r["name"]], m)
            for r in by_cell.get(k, [])
            if r["name"] in ref_ms and (m := _ms(r)) is not None
        ]
        bands = bm.inflation_by_band(pairs)
        infl[k] = {b: {**bm.dist(v).to_json(), "values": v} for b, v in bands.items()}

    # Fidelity per GPU, when the concurrent cells were spread over several (--gpus).
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}
    if len(meta.get("gpus") or []) > 1:
        for k in keys:
            if cell_rows[k]["mode"] not in CONCURRENT:
                continue
            by_gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for r in by_cell.get(k, []):
                if r["name"] in ref_ms and (m := _ms(r)) is not None and r.get("gpu") is not None:
                    by_gpu[str(r["gpu"])].append((ref_ms[r["name"]], m))
            per_gpu[k] = {
                g: {"n": len(p), **{b: bm.dist(v).to_json() for b, v in bm.inflation_by_band(p).items()}}
                for g, p in sorted(by_gpu.items())
            }

    # Ranking: true order per family.
    fams: dict[str, list[Workload]] = defaultdict(list)
    for w in workloads:
        if w.family:
            fams[w.family].append(w)
    truth: dict[str, dict[str, Any]] = {}
    refc = by_cell.get("reference", [])
    for fam, ws in sorted(fams.items()):
        kind = ws[0].truth
        if kind == "param":
            truth[fam] = {"kind": "param", "values": {w.name: float(w.work or 0.0) for w in ws}}
            continue
        src = [r for r in refc if r.get("family") == fam]
        how = "reference"
        if not src:
            src = [
                r
                for r in by_cell.get("native-serial", []) + by_cell.get("native-repeat", [])
                if r.get("family") == fam
            ]
            how = "native passes"
            if src:
                notes.append(
                    f"family {fam}: no reference pass; true order taken from the native passes "
                    "(native ranking figures for it are then not independent)"
                )
        vals: dict[str, float] = {}
        for w in ws:
            xs = [m for r in src if r["name"] == w.name and (m := _ms(r)) is not None]
            if xs:
                vals[w.name] = bm.median(xs)
        if len(vals) >= 2:
            truth[fam] = {"kind": f"measured ({how})", "values": vals}
        else:
            notes.append(f"family {fam}: no true order (no measurements); left out of the ranking metrics")

    ranking: dict[str, dict[str, Any]] = {}
    for k in keys:
        if k == "reference":
            continue
        rs = by_cell.get(k, [])
        taus: dict[str, list[float]] = {}
        flip_pairs: list[tuple[float, bool]] = []
        for fam, t in truth.items():
            per_rep: dict[int, dict[str, float]] = defaultdict(dict)
            for r in rs:
                if r.get("family") == fam and r["name"] in t["values"] and (m := _ms(r)) is not None:
                    per_rep[int(r.get("rep", 0))][r["name"]] = m
            taus[fam] = []
            for _rep, got in sorted(per_rep.items()):
                names = [n for n in t["values"] if n in got]
                if len(names) < 3:
                    continue
                tv = [t["values"][n] for n in names]
                mv = [got[n] for n in names]
                tau = bm.kendall_tau(tv, mv)
                if math.isfinite(tau):
                    taus[fam].append(tau)
                flip_pairs.extend(bm.pairwise_flips(tv, mv))
        all_t = [x for v in taus.values() for x in v]
        ranking[k] = {
            "tau": taus,
            "tau_median": bm.median(all_t) if all_t else math.nan,
            "tau_n": len(all_t),
            "flip": {c: fr.to_json() for c, fr in bm.flip_rates(flip_pairs).items()},
        }

    # Critical fraction (native-serial, else any native pass).
    src = ns or by_cell.get("native-repeat", [])
    fr_list: list[float] = []
    reg_sum = tot_sum = 0.0
    for r in src:
        res = r.get("result")
        if not r.get("ok") or not isinstance(res, dict):
            continue
        tr, tt = float(res.get("t_region_s") or 0.0), float(res.get("t_total_s") or 0.0)
        if tt > 0:
            fr_list.append(bm.critical_fraction(tr, tt))
            reg_sum += tr
            tot_sum += tt
    agg = reg_sum / tot_sum if tot_sum > 0 else math.nan
    critical = {
        "n": len(fr_list),
        "fractions": fr_list,
        **{f"p{q}": bm.percentile(fr_list, q) if fr_list else math.nan for q in (10, 25, 50, 75, 90)},
        "share_below_25": (sum(1 for f in fr_list if f < 0.25) / len(fr_list)) if fr_list else math.nan,
        "aggregate": agg,
        "amdahl_bound": bm.amdahl_bound(agg) if math.isfinite(agg) else math.nan,
        "median_bound": bm.amdahl_bound(bm.median(fr_list)) if fr_list else math.nan,
        "paper_median": PAPER["critical_fraction_median"],
    }

    # Region entry overhead and queue wait.
    regions: dict[str, dict[str, Any]] = {}
    for k in keys:
        rs = [r for r in by_cell.get(k, []) if isinstance(r.get("result"), dict)]
        if not rs:
            continue
        client = [float(r["result"].get("region_entry_s") or 0.0) for r in rs]
        qw: list[float] = []
        proto: list[float] = []
        adm: list[float] = []
        contaminated = nreg = cut = no_region = 0
        flags: dict[str, int] = {}
        wrapped: set[str] = set()
        for r in rs:
            kr = r.get("krex") or {}
            if r.get("krex") is not None and not kr.get("regions"):
                no_region += 1
            for w in (kr.get("auto_region") or {}).get("wrapped") or []:
                wrapped.add(str(w))
            for g in kr.get("regions") or []:
                nreg += 1
                contaminated += int(bool(g.get("contaminated")))
                cut += int(bool(g.get("cut")))
                for f in g.get("flags") or []:
                    flags[str(f)] = flags.get(str(f), 0) + 1
                if g.get("queue_wait_s") is not None:
                    qw.append(float(g["queue_wait_s"]))
                if g.get("entry_s") is not None:
                    proto.append(float(g["entry_s"]))
            if kr.get("admission_wait_s") is not None:
                adm.append(float(kr["admission_wait_s"]))
        regions[k] = {
            "client_entry_s": bm.dist(client).to_json(),
            "queue_wait_s": bm.dist(qw).to_json(),
            "protocol_entry_s": bm.dist(proto).to_json(),
            "admission_wait_s": bm.dist(adm).to_json(),
            "regions": nreg,
            "contaminated": contaminated,
            # Trust: what KREX could not vouch for (attestation flags included).
            "cut": cut,
            "flags": flags,
            "runs_without_region": no_region,
            "auto_wrapped": sorted(wrapped),
        }

    failures = [
        {
            "cell": r.get("cell"),
            "name": r.get("name"),
            "rep": r.get("rep"),
            "exit_status": r.get("exit_status"),
            "error": r.get("error"),
            "stderr_tail": (r.get("stderr_tail") or "")[-400:],
        }
        for r in recs
        if not r.get("ok")
    ]

    headline = _headline(thr, infl, ranking, critical, ns_cpm)
    sim = meta.get("device") == "sim"
    return {
        "device": meta.get("device"),
        "simulated": sim,
        "label": SIM_LABEL if sim else "",
        "quick": meta.get("quick"),
        "seed": meta.get("seed"),
        "repeat": meta.get("repeat"),
        "commands": len(workloads),
        "cold_cache": meta.get("cold_cache"),
        "versions": meta.get("versions", {}),
        "workload_versions": _workload_versions(recs),
        "invocations": meta.get("invocations", []),
        "cells_done": keys,
        "throughput": thr,
        "native_cpm": ns_cpm,
        "reference": {"ms": ref_ms, "wall_s": ref_wall, "expect_ms": {n: w.expect_ms for n, w in wl.items()}},
        "inflation": infl,
        "inflation_per_gpu": per_gpu,
        "truth": truth,
        "ranking": ranking,
        "critical": critical,
        "regions": regions,
        "headline": headline,
        "failures": failures,
        "notes": list(dict.fromkeys(notes)),
        "paper": PAPER,
    }


def _workload_versions(recs: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        res = r.get("result")
        if isinstance(res, dict):
            for k in ("torch", "triton"):
                if res.get(k):
                    out[k].add(str(res[k]))
    return {k: sorted(v) for k, v in out.items()}


def _headline(
    thr: list[dict[str, Any]],
    infl: dict[str, dict[str, Any]],
    ranking: dict[str, dict[str, Any]],
    critical: dict[str, Any],
    ns_cpm: float,
) -> dict[str, Any]:
    krex_cells = [t for t in thr if t["mode"] == "krex" and math.isfinite(t["cmds_per_min"])]
    best = max(krex_cells, key=lambda t: t["cmds_per_min"]) if krex_cells else None
    h: dict[str, Any] = {"krex_cell": best["cell"] if best else None, "native_cpm": ns_cpm}
    goals: list[dict[str, Any]] = []

    def fmt_pct(x: float) -> str:
        return "-" if not math.isfinite(x) else f"{100 * x:.2f}%"

    def met(ok: bool | None) -> str:
        return "n/a" if ok is None else ("yes" if ok else "NO")

    unp = None
    if best:
        unp = next((t for t in thr if t["mode"] == "unprotected" and t["c"] == best["c"]), None)
        h.update(krex_cpm=best["cmds_per_min"], throughput_ratio=best["ratio"], krex_c=best["c"])
    unp_best = max(
        (t for t in thr if t["mode"] == "unprotected" and math.isfinite(t["cmds_per_min"])),
        key=lambda t: t["cmds_per_min"],
        default=None,
    )
    ratio = best["ratio"] if best else math.nan
    goals.append(
        {
            "metric": "throughput vs native serial (best krex-C)",
            "goal": f">= {GOAL_THROUGHPUT:.1f}x",
            "paper": f"{PAPER['throughput_ratio']}x ({PAPER['native_cpm']} -> {PAPER['krex_cpm']} cmds/min)",
            "ours": "-"
            if not best
            else f"{ratio:.2f}x ({ns_cpm:.1f} -> {best['cmds_per_min']:.1f} cmds/min, {best['cell']})",
            "met": met(None if not math.isfinite(ratio) else ratio >= GOAL_THROUGHPUT),
        }
    )
    amd = float(critical.get("amdahl_bound", math.nan))
    if not math.isfinite(amd):
        amd_txt = "-"
    else:
        amd_txt = f"{amd:.1f}x (aggregate critical fraction {fmt_pct(float(critical['aggregate']))})"
        if math.isfinite(ratio):
            amd_txt += f"; krex reaches {ratio / amd:.0%} of it"
    goals.append(
        {
            "metric": "Amdahl bound 1/(critical fraction)",
            "goal": "-",
            "paper": f"{1 / PAPER['critical_fraction_median']:.1f}x (median fraction 12%)",
            "ours": amd_txt,
            "met": "-",
        }
    )
    goals.append(
        {
            "metric": "unprotected sharing throughput",
            "goal": "-",
            "paper": f"{PAPER['unprotected_cpm']} cmds/min "
            f"({PAPER['unprotected_cpm'] / PAPER['native_cpm']:.1f}x), below KREX",
            "ours": "-"
            if not unp_best
            else f"{unp_best['cmds_per_min']:.1f} cmds/min ({unp_best['ratio']:.2f}x, {unp_best['cell']})",
            "met": "-",
        }
    )
    p95: dict[str, float] = {}
    for band, paper_v in PAPER["p95_inflation"].items():
        d = (infl.get(best["cell"]) or {}).get(band) if best else None
        v = float(d["p95"]) if d and d.get("p95") is not None else math.nan
        p95[band] = v
        nr = (infl.get("native-repeat") or {}).get(band) or {}
        nr_v = float(nr["p95"]) if nr.get("p95") is not None else math.nan
        ours = (
            "-"
            if not math.isfinite(v)
            else f"{fmt_pct(v)} (n={d['n'] if d else 0}; native repeat {fmt_pct(nr_v)})"
        )
        goals.append(
            {
                "metric": f"p95 timing inflation, kernels {band}",
                "goal": f"<= {fmt_pct(paper_v)}",
                "paper": fmt_pct(paper_v),
                "ours": ours,
                "met": met(None if not math.isfinite(v) else v <= paper_v),
            }
        )
    h["p95_inflation"] = p95
    tau = {
        "krex": ranking.get(best["cell"], {}).get("tau_median", math.nan) if best else math.nan,
        "native-repeat": ranking.get("native-repeat", {}).get("tau_median", math.nan),
        "native-serial": ranking.get("native-serial", {}).get("tau_median", math.nan),
        "unprotected": ranking.get(unp["cell"], {}).get("tau_median", math.nan) if unp else math.nan,
    }
    h["tau"] = tau

    def f3(x: float) -> str:
        return "-" if not math.isfinite(x) else f"{x:.3f}"

    goals.append(
        {
            "metric": "Kendall tau (median per family and pass), krex",
            "goal": ">= native repeat",
            "paper": f"{PAPER['tau']['krex']:.3f}",
            "ours": f3(tau["krex"]),
            "met": met(
                None
                if not (math.isfinite(tau["krex"]) and math.isfinite(tau["native-repeat"]))
                else tau["krex"] >= tau["native-repeat"] - 1e-12
            ),
        }
    )
    goals.append(
        {
            "metric": "Kendall tau, native repeat",
            "goal": "-",
            "paper": f"{PAPER['tau']['native-repeat']:.3f}",
            "ours": f3(tau["native-repeat"]),
            "met": "-",
        }
    )
    goals.append(
        {
            "metric": "Kendall tau, unprotected (same C)",
            "goal": "-",
            "paper": f"{PAPER['tau']['unprotected']:.3f}",
            "ours": f3(tau["unprotected"]),
            "met": "-",
        }
    )
    flips: dict[str, dict[str, float]] = {}
    kr = ranking.get(best["cell"], {}).get("flip", {}) if best else {}
    nr_f = ranking.get("native-repeat", {}).get("flip", {})
    un_f = ranking.get(unp["cell"], {}).get("flip", {}) if unp else {}
    for label, _, _ in bm.GAP_CLASSES:
        a = (kr.get(label) or {}).get("rate")
        b = (nr_f.get(label) or {}).get("rate")
        u = (un_f.get(label) or {}).get("rate")
        fa = math.nan if a is None else float(a)
        fb = math.nan if b is None else float(b)
        fu = math.nan if u is None else float(u)
        flips[label] = {"krex": fa, "native-repeat": fb, "unprotected": fu}
        if (kr.get(label) or {}).get("pairs", 0) == 0 and (nr_f.get(label) or {}).get("pairs", 0) == 0:
            continue
        ok = None if not (math.isfinite(fa) and math.isfinite(fb)) else fa <= fb + PAPER["flip_pp"] + 1e-12
        goals.append(
            {
                "metric": f"pairwise flip rate, true gap {label}",
                "goal": "<= native repeat + 3 pp",
                "paper": "within 3 pp of native repeat",
                "ours": f"{fmt_pct(fa)} (native repeat {fmt_pct(fb)}, unprotected {fmt_pct(fu)})",
                "met": met(ok),
            }
        )
    h["flips"] = flips
    h["goals"] = goals
    return h


# ----------------------------------------------------------------------------------- summary.md


def _pct(x: Any, digits: int = 2) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if not math.isfinite(v) else f"{100 * v:.{digits}f}%"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if not math.isfinite(v) else fmt.format(v)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_summary_md(s: dict[str, Any], out_dir: Path | None = None) -> str:
    """summary.md: the goal, the paper's figures and ours side by side, then details."""
    L: list[str] = ["# krex bench results", ""]  # noqa: N806
    if s.get("simulated"):
        L += [
            f"> **{SIM_LABEL}.** The simulated GPU models time-slicing only; every number below shows "
            "whether the logic works, never how a real GPU performs.",
            "",
        ]
    v = s.get("versions", {})
    wv = s.get("workload_versions", {})
    L += [
        f"- device: **{s.get('device')}** ({', '.join(v.get('gpu_names') or []) or '-'}); "
        f"{v.get('cpus')} CPUs; {v.get('platform')}",
        f"- krex {v.get('krex')}, Python {v.get('python')}"
        + (f", torch {', '.join(wv['torch'])}" if wv.get("torch") else "")
        + (f", triton {', '.join(wv['triton'])}" if wv.get("triton") else ""),
        f"- corpus: {s.get('commands')} commands{' (--quick)' if s.get('quick') else ''}, "
        f"{s.get('repeat')} pass(es) per cell, seed {s.get('seed')}, "
        f"{'fresh compiler caches per run' if s.get('cold_cache') else 'shared compiler caches'}",
        f"- cells done: {', '.join(s.get('cells_done') or []) or '-'}",
    ]
    for inv in s.get("invocations", []):
        L.append(f"- run {inv.get('started')}: `{' '.join(inv.get('argv') or []) or 'krex bench'}`")
    L += [""]

    h = s.get("headline", {})
    L += ["## Headline: goal, paper (NVIDIA H20) and ours", ""]
    if h.get("krex_cell"):
        L += [
            f"Ours are the krex cell with the highest throughput ({h['krex_cell']}), and the native-repeat "
            "and the unprotected cell of the same C beside it.",
            "",
        ]
    L += _table(
        ["metric", "goal", "paper", "ours", "goal met"],
        [[g["metric"], g["goal"], g["paper"], g["ours"], g["met"]] for g in h.get("goals", [])],
    )
    L += [""]

    L += [
        "## Throughput",
        "",
        "Commands per minute = runs / makespan of the cell (first start to last end). "
        "`steady` counts only the runs that ended while the cell still had commands waiting to start.",
        "",
    ]
    L += _table(
        [
            "cell",
            "C",
            "runs",
            "failed",
            "makespan s",
            "cmds/min",
            "vs native-serial",
            "steady cmds/min",
            "mean wall s",
        ],
        [
            [
                t["cell"],
                str(t["c"]),
                str(t["n_runs"]),
                str(t["failures"]),
                _num(t["makespan_s"], "{:.1f}"),
                _num(t["cmds_per_min"], "{:.1f}"),
                _num(t["ratio"], "{:.2f}x"),
                _num(t["steady_cmds_per_min"], "{:.1f}"),
                _num(t["mean_wall_s"], "{:.2f}"),
            ]
            for t in s.get("throughput", [])
        ],
    )
    L += [""]

    L += [
        "## Timing inflation against native-serial",
        "",
        "Inflation = measured ms / the same command's native-serial ms - 1, signed. Bands are nested, by "
        "native-serial duration (a 20 ms kernel counts in all three), as in the paper.",
        "",
    ]
    rows = []
    for k, bands in s.get("inflation", {}).items():
        for band, _ in bm.BANDS:
            d = bands.get(band) or {}
            rows.append(
                [
                    k,
                    band,
                    str(d.get("n", 0)),
                    _pct(d.get("p50")),
                    _pct(d.get("p95")),
                    _pct(d.get("max")),
                    _pct(PAPER["p95_inflation"][band]),
                ]
            )
    L += _table(["cell", "band", "n", "p50", "p95", "max", "paper p95 (krex)"], rows) + [""]
    if s.get("inflation_per_gpu"):
        L += ["### Per GPU (C commands on each GPU at once)", ""]
        rows = []
        for k, gs in s["inflation_per_gpu"].items():
            for g, bands in gs.items():
                for band, _ in bm.BANDS:
                    d = bands.get(band) or {}
                    if d.get("n"):
                        rows.append([k, g, band, str(d["n"]), _pct(d.get("p50")), _pct(d.get("p95"))])
        L += _table(["cell", "gpu", "band", "n", "p50", "p95"], rows) + [""]

    L += ["## Ranking fidelity", ""]
    truth = s.get("truth", {})
    L += _table(
        ["family", "true order from", "candidates (fastest first)"],
        [
            [f, t["kind"], ", ".join(sorted(t["values"], key=lambda n: t["values"][n]))]
            for f, t in truth.items()
        ],
    ) + [""]
    fams = list(truth)
    L += ["### Kendall tau per family (mean over passes) and median over all (family, pass)", ""]
    rows = []
    for k, r in s.get("ranking", {}).items():
        cols = []
        for f in fams:
            xs = r["tau"].get(f) or []
            cols.append(_num(sum(xs) / len(xs), "{:.3f}") if xs else "-")
        rows.append([k, *cols, _num(r.get("tau_median"), "{:.3f}")])
    L += _table(["cell", *fams, "median"], rows) + [""]
    L += [
        "### Pairwise flip rate per true-gap class",
        "",
        "A flip: the measured order of two candidates of a family disagrees with the true order.",
        "",
    ]
    rows = []
    for k, r in s.get("ranking", {}).items():
        cols = []
        for label, _, _ in bm.GAP_CLASSES:
            f = r["flip"].get(label) or {}
            cols.append(
                "-" if not f.get("pairs") else f"{_pct(f.get('rate'), 1)} ({f['flips']}/{f['pairs']})"
            )
        rows.append([k, *cols])
    L += _table(["cell", *[g[0] for g in bm.GAP_CLASSES]], rows) + [""]

    c = s.get("critical", {})
    L += [
        "## Critical-region fraction (native-serial)",
        "",
        "fraction = t_region_s / t_total_s per command (time inside `krex.region()` over the process's "
        "whole life). Amdahl bound on the throughput gain = total command time / total region time.",
        "",
    ]
    L += _table(
        ["n", "p10", "p25", "p50", "p75", "p90", "share < 25%", "aggregate", "Amdahl bound", "paper median"],
        [
            [
                str(c.get("n", 0)),
                _pct(c.get("p10"), 1),
                _pct(c.get("p25"), 1),
                _pct(c.get("p50"), 1),
                _pct(c.get("p75"), 1),
                _pct(c.get("p90"), 1),
                _pct(c.get("share_below_25"), 0),
                _pct(c.get("aggregate"), 1),
                _num(c.get("amdahl_bound"), "{:.1f}x"),
                _pct(c.get("paper_median"), 0),
            ]
        ],
    ) + [""]

    L += [
        "## Region entry overhead and queue wait",
        "",
        "client entry: time from `with krex.region()` to its body (queue wait + protocol), per command. "
        "queue wait and protocol entry (block, catch stragglers, drain, freeze, pin) come from the daemon's "
        "journal via `krex run --report`. Native and unprotected cells enter no-op regions.",
        "",
    ]
    rows = []
    for k, r in s.get("regions", {}).items():
        ce, qw, pe, ad = r["client_entry_s"], r["queue_wait_s"], r["protocol_entry_s"], r["admission_wait_s"]
        rows.append(
            [
                k,
                _num(ce.get("p50"), "{:.4f}"),
                _num(ce.get("p95"), "{:.4f}"),
                _num(qw.get("p50"), "{:.4f}"),
                _num(qw.get("p95"), "{:.4f}"),
                _num(pe.get("p50"), "{:.5f}"),
                _num(pe.get("p95"), "{:.5f}"),
                _num(ad.get("p95"), "{:.4f}"),
                str(r["regions"]),
                str(r["contaminated"]),
                str(r.get("cut", 0)),
                ", ".join(f"{f} {n}" for f, n in (r.get("flags") or {}).items()) or "-",
                str(r.get("runs_without_region", 0)),
                ", ".join(r.get("auto_wrapped") or []) or "-",
            ]
        )
    L += _table(
        [
            "cell",
            "client entry p50 s",
            "p95 s",
            "queue wait p50 s",
            "p95 s",
            "protocol entry p50 s",
            "p95 s",
            "admission wait p95 s",
            "regions",
            "contaminated",
            "cut",
            "flagged by reason",
            "runs without a region",
            "auto targets wrapped",
        ],
        rows,
    ) + [""]

    fails = s.get("failures", [])
    L += ["## Failures", ""]
    if fails:
        L += _table(
            ["cell", "command", "pass", "exit", "error"],
            [
                [str(f["cell"]), str(f["name"]), str(f["rep"]), str(f["exit_status"]), str(f["error"])]
                for f in fails[:50]
            ],
        )
        if len(fails) > 50:
            L.append(f"... and {len(fails) - 50} more (raw.jsonl has them all)")
    else:
        L.append("None.")
    L += [""]
    if s.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    L += [
        "## Files",
        "",
        "- `raw.jsonl`: one line per command run (cell, mode, C, pass, wall times, the command's JSON line, "
        "the `krex run` report)",
        "- `cells.jsonl`: one line per finished cell (makespan); `meta.json`: configuration and versions",
        "- `summary.json`: every metric below in machine-readable form",
        "- `throughput.png`, `inflation_cdf.png`, `flip_rates.png`, `critical_fraction.png`",
        "",
    ]
    if s.get("simulated"):
        L += [f"**{SIM_LABEL}.**", ""]
    return "\n".join(L)
