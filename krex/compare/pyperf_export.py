"""A comparison's runs in pyperf's JSON format (version "1.0", what ``pyperf compare_to``,
``pyperf stats`` and ``pyperf show`` read).

One file per candidate, ``<dir>/<name>.json``, each a suite of one benchmark with the same
name, so that ``python -m pyperf compare_to A.json B.json`` compares them. Each counted
KREX run is one pyperf run with one value: the run's figure in seconds. Runs left out of
the statistics (flagged regions) are left out here too. The suite metadata names the
candidate, its command and the figure; each run's metadata has its date, its duration
(the command's wall time), its region time and its block.

The layout, as pyperf's loader (pyperf/_bench.py) reads it::

    {"version": "1.0",
     "metadata": {...suite metadata: str, int or float values...},
     "benchmarks": [{"metadata": {"name": ..., "unit": "second", "loops": 1},
                     "runs": [{"metadata": {"date": ..., "duration": ...}, "values": [v]}, ...]}]}
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from krex.compare.extract import UNITS
from krex.errors import PermissionDenied, UsageError

if TYPE_CHECKING:
    from krex.compare.run import Comparison

__all__ = ["PYPERF_VERSION", "pyperf_documents", "write_pyperf"]

PYPERF_VERSION = "1.0"


def _text(v: str) -> str:
    """pyperf metadata text: one line, not empty."""
    s = " ".join(v.split())
    return s or "-"


def pyperf_documents(cmp: Comparison, name: str = "krex-compare") -> dict[str, dict[str, Any]]:
    """{candidate name: its pyperf JSON document}."""
    unit = cmp.figure.unit
    if unit not in UNITS:
        raise UsageError(
            f"the figure {cmp.figure.name} has no known unit, and pyperf files hold seconds",
            f"give the figure's unit (--unit {'|'.join(UNITS)}) to export pyperf JSON",
        )
    if not cmp.figure.lower_is_better:
        raise UsageError(
            "pyperf reads its values as times (lower is better); this figure is higher-is-better",
            "export pyperf JSON only for time figures",
        )
    scale = UNITS[unit]
    docs: dict[str, dict[str, Any]] = {}
    for i, cand in enumerate(cmp.names):
        runs = []
        for r in cmp.runs:
            if r.candidate != i or r.value is None:
                continue
            when = r.result.started_at if r.result is not None else cmp.started_at
            runs.append({
                "metadata": {
                    "date": datetime.datetime.fromtimestamp(when).isoformat(" "),
                    "duration": round(max(r.wall_s, 0.0), 6),
                    "krex_region_s": round(r.region_s, 6),
                    "krex_block": r.block,
                },
                "values": [r.value * scale],
            })
        if not runs:
            raise UsageError(f"candidate {cand} has no counted run to export",
                             "see the runs' left_out reasons")
        docs[cand] = {
            "version": PYPERF_VERSION,
            "metadata": {
                "krex_candidate": _text(cand),
                "krex_command": _text(" ".join(cmp.commands[i]))[:1000],
                "krex_figure": _text(cmp.figure.name),
                "krex_simulated": "yes" if cmp.simulated else "no",
            },
            "benchmarks": [{"metadata": {"name": _text(name), "unit": "second", "loops": 1}, "runs": runs}],
        }
    return docs


def write_pyperf(cmp: Comparison, out_dir: str | Path, name: str = "krex-compare") -> list[Path]:
    """Write ``<out_dir>/<candidate>.json`` per candidate; returns the paths."""
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionDenied(f"cannot create {d}: {e.strerror}", "give a writable directory") from e
    out = []
    for cand, doc in pyperf_documents(cmp, name).items():
        p = d / (re.sub(r"[^A-Za-z0-9_.-]", "_", cand) + ".json")
        p.write_text(json.dumps(doc, indent=1) + "\n")
        out.append(p)
    return out
