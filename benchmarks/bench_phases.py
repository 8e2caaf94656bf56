"""Where a krex bench cell's time goes, summed over its commands.

    python3 benchmarks/bench_phases.py [--waves] RESULTS_DIR [RESULTS_DIR ...]

Per cell (native-serial left out): wall (sum of the commands' wall times), in-cmd (the
time the command's own script measured, `t_total_s`), launch (wall - in-cmd: the
guardian, admission, interpreter start and teardown), the script's phases (import,
inputs, compile, check, timed) and frozen-proc-s: the sum over the cell's regions of
region_s x siblings frozen, a lower bound of the process-seconds siblings spent frozen
(it leaves out entry and thaw).

--waves: per concurrent cell, means per command of the first C commands it started (the
longest, started together) and of the rest (each started as one ended): wall, launch,
import, compile, check. The rest's launch is the per-command start and exit cost."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any


def cell_rows(out_dir: Path) -> dict[str, list[dict[str, Any]]]:
    cells: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in (out_dir / "raw.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            cells[rec["cell"]].append(rec)
    return cells


def breakdown(rows: list[dict[str, Any]]) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for rec in rows:
        res = rec.get("result") or {}
        for k, v in (res.get("phases") or {}).items():
            out[k] += v
        out["in-cmd"] += res.get("t_total_s", 0.0)
        out["wall"] += rec["wall_s"]
        k = rec.get("krex")
        if isinstance(k, dict):
            for g in k.get("regions", []):
                out["frozen-proc-s"] += g.get("region_s", 0.0) * g.get("siblings_frozen", 0)
    out["launch"] = out["wall"] - out["in-cmd"]
    return dict(out)


def waves(dirs: list[str]) -> None:
    cols = ["wall", "launch", "import", "compile", "check"]
    head = " ".join(f"{c:>8}" for c in cols)
    print(f"{'run':<14} {'cell':<22} {'n':>3} first C: {head} | {'n':>3} the rest: {head}")
    for d in dirs:
        for cell, rows in sorted(cell_rows(Path(d)).items()):
            c = int(rows[0].get("c") or 1)
            if c < 2:
                continue
            rows = sorted((r for r in rows if r.get("ok")), key=lambda r: r["started_at"])
            line = f"{Path(d).name:<14} {cell:<22}"
            for part in (rows[:c], rows[c:]):
                b = breakdown(part)
                n = max(1, len(part))
                line += f" {len(part):>3} " + " ".join(f"{b.get(k, 0.0) / n:8.2f}" for k in cols) + "  |"
            print(line.rstrip("|"))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--waves"]:
        waves(argv[1:])
        return 0
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cols = ["wall", "in-cmd", "launch", "import", "inputs", "compile", "check", "timed", "frozen-proc-s"]
    print(f"{'run':<14} {'cell':<18} " + " ".join(f"{c:>13}" for c in cols))
    for d in argv:
        for cell, rows in sorted(cell_rows(Path(d)).items()):
            if cell == "native-serial" or cell.startswith("reference"):
                continue
            b = breakdown(rows)
            print(f"{Path(d).name:<14} {cell:<18} " + " ".join(f"{b.get(c, 0.0):13.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
