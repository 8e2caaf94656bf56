"""benchmarks/bench_cells.py pools replicate directories: a cell's runs over its summed
makespans, node busy weighted by makespan, krexd CPU summed, entry quantiles over all
regions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cells.py"


def _dir(root: Path, name: str, krex_runs: int, krex_span: float, busy: float, entries: list[float]) -> Path:
    d = root / name
    d.mkdir()
    cells = [
        {"cell": "unprotected-8", "mode": "unprotected", "c": 8, "run": "r1", "n_runs": 10, "failures": 0,
         "makespan_s": 60.0, "node_busy": 0.5},
        {"cell": "krex-8", "mode": "krex", "c": 8, "run": "r1", "n_runs": krex_runs, "failures": 0,
         "makespan_s": krex_span, "node_busy": busy, "krexd_cpu_s": 1.0},
    ]
    (d / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cells))
    raw = [
        {"cell": "unprotected-8", "run": "r1", "name": "a", "family": "f", "ok": True, "wall_s": 10.0},
        {"cell": "krex-8", "run": "r1", "name": "a", "family": "f", "ok": True, "wall_s": 10.0,
         "krex": {"regions": [{"entry_s": e} for e in entries]}},
        # a run of an earlier, unfinished try of the cell: ignored
        {"cell": "krex-8", "run": "old", "name": "a", "family": "f", "ok": True, "wall_s": 99.0},
    ]
    (d / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    return d


def test_pooled_cells_sum_runs_and_makespans(tmp_path: Path) -> None:
    a = _dir(tmp_path, "a", 10, 60.0, 0.4, [0.001, 0.002])
    b = _dir(tmp_path, "b", 8, 60.0, 0.8, [0.2])
    out = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--family", "f"],
                         capture_output=True, text=True, check=True).stdout
    pooled = out[out.index("## pooled: 2 directories"):]
    row = next(ln for ln in pooled.splitlines() if ln.startswith("| krex-8 | 18 "))
    cells = [c.strip() for c in row.split("|")]
    assert cells[4:9] == ["120.0", "9.0", "0.90x", "60%", "2.0"], cells  # makespan, 18 runs over 120 s
    # against 20 runs over 120 s; node busy 0.4 and 0.8 over 60 s each; krexd CPU summed
    entry = next(ln for ln in pooled.splitlines() if ln.startswith("| krex-8 | 3 "))
    assert "| 2/200/200/200 |" in entry, entry  # all three regions, ms
    # each directory's own table comes first
    assert out.index("## " + str(a)) < out.index("## " + str(b)) < out.index("## pooled")
