"""Where a krex bench cell's time goes, summed over its commands (issue 11's breakdown).

    python3 scripts/bench_phases.py RESULTS_DIR [RESULTS_DIR ...]

Per cell (native-serial left out): wall (sum of the commands' wall times), in-cmd (the
time the command's own script measured, `t_total_s`), launch (wall - in-cmd: the
guardian, admission, interpreter start and teardown), the script's phases (import,
inputs, compile, check, timed) and frozen-proc-s: the sum over the cell's regions of
region_s x siblings frozen, a lower bound of the process-seconds siblings spent frozen
(it leaves out entry and thaw)."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def cell_rows(out_dir: Path) -> dict[str, list[dict]]:
    cells: dict[str, list[dict]] = collections.defaultdict(list)
    for line in (out_dir / "raw.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            cells[rec["cell"]].append(rec)
    return cells


def breakdown(rows: list[dict]) -> dict[str, float]:
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


def main(argv: list[str]) -> int:
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
