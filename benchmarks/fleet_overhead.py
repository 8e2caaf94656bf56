"""What Ray adds per command: `krex fleet` (a local one-node Ray cluster) against `krex batch`
on the same commands and the same node daemon.

    python3 benchmarks/fleet_overhead.py --device gpu --slots 16 --corpus-slots 8 --out DIR

Cases (each: batch, then fleet; the corpus case in the order batch, fleet, fleet, batch):
  serial   --serial N  `true` commands, one at a time (-j 1 / 1 slot). The per-command cost
           is the median cycle: the time from one command's start to the next one's start.
           fleet's cycle minus batch's = what Ray adds per command in steady state.
  parallel --trivial N `true` commands at --slots at a time: throughput.
  corpus   the `krex bench` corpus (--quick unless --full) at --corpus-slots: throughput, mean
           command wall, and the commands' own measured ms (fleet against batch).
The one-off cost of starting Ray is the CLI wall minus the run wall (summary's total_wall_s).
Logs and every run's results go to --out; a short table is printed last."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KREX = [sys.executable, "-m", "krex.cli.main"]


def run(args: list[str], log: Path, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            p = subprocess.run([*KREX, *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def results(d: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(d.glob("cmd-*.json"))]


def median_cycle(rs: list[dict[str, Any]]) -> float | None:
    starts = sorted(float(r["started_at"]) for r in rs if r.get("started_at"))
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return statistics.median(gaps[1:]) if len(gaps) > 2 else None  # the first one warms Ray's workers


def one(tool: str, case: str, cmds: Path | None, slots: int, device: str, out: Path, timeout: float,
        extra: list[str] | None = None) -> dict[str, Any]:
    d = out / f"{case}-{tool}-{int(time.time() * 1000) % 10**8}"
    if tool == "batch":
        args = ["batch", str(cmds), "-j", str(slots), "--device", device, "--out", str(d)]
    else:
        args = ["fleet", *([str(cmds)] if cmds else []), "--slots-per-gpu", str(slots), "--device", device,
                "--out", str(d), *(extra or [])]
    rc, wall = run(args, out / f"{d.name}.log", timeout)
    row: dict[str, Any] = {"case": case, "tool": tool, "slots": slots, "rc": rc, "cli_wall_s": wall, "dir": str(d)}
    try:
        s = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        return row
    rs = results(d)
    ran = [r for r in rs if r.get("exit_status") is not None]
    row.update(cmds=s["commands"], ok=s["succeeded"], run_wall_s=s["total_wall_s"],
               per_min=s["throughput_per_min"], mean_wall_s=statistics.mean(r["wall_s"] for r in ran) if ran else None,
               cycle_s=median_cycle(rs), dispatch_p50_s=(s.get("dispatch_s") or {}).get("p50_s"),
               ms={r["index"]: (r.get("result") or _parse(r)).get("ms") for r in ran})
    return row


def _parse(r: dict[str, Any]) -> dict[str, Any]:
    """batch keeps stdout in a file: its last JSON line (what a benchmark prints)."""
    try:
        lines = Path(r["stdout"]).read_text().splitlines()
    except (OSError, KeyError, TypeError):
        return {}
    for ln in reversed(lines):
        if ln.strip().startswith("{"):
            try:
                v = json.loads(ln)
            except ValueError:
                continue
            return v if isinstance(v, dict) else {}
    return {}


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--corpus-slots", type=int, default=8)
    ap.add_argument("--serial", type=int, default=40)
    ap.add_argument("--trivial", type=int, default=200)
    ap.add_argument("--no-corpus", action="store_true")
    ap.add_argument("--full", action="store_true", help="the whole corpus, not --quick")
    ap.add_argument("--corpus", default=None, help="manifest.py (default: the source tree's)")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", default="fleet-overhead")
    a = ap.parse_args()
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    from krex.fleet import PYTHON, corpus_commands

    # One daemon for both tools, with the most slots any case uses (krex batch would start one
    # with the default slots; the fleet uses a running daemon as it is).
    subprocess.run([*KREX, "daemon", "stop"], capture_output=True)
    subprocess.run([*KREX, "daemon", "start", "--device", a.device, "--slots-per-gpu",
                    str(max(a.slots, a.corpus_slots))], check=True)
    rows: list[dict[str, Any]] = []
    serial = out / "serial.txt"
    serial.write_text("true\n" * a.serial)
    trivial = out / "trivial.txt"
    trivial.write_text("true\n" * a.trivial)
    for tool in ("batch", "fleet"):
        rows.append(one(tool, "serial", serial, 1, a.device, out, a.timeout))
    for tool in ("batch", "fleet"):
        rows.append(one(tool, "parallel", trivial, a.slots, a.device, out, a.timeout))
    if not a.no_corpus:
        cmds = corpus_commands(a.corpus, a.device, quick=not a.full)
        corpus = out / "corpus.json"
        corpus.write_text(json.dumps([[sys.executable if x == PYTHON else x for x in c.argv] for c in cmds]))
        extra = ["--corpus", a.corpus or "default", *([] if a.full else ["--quick"])]
        for tool in ("batch", "fleet", "fleet", "batch"):
            rows.append(one(tool, "corpus", None if tool == "fleet" else corpus, a.corpus_slots, a.device, out,
                            a.timeout * 2, extra if tool == "fleet" else None))
    subprocess.run([*KREX, "daemon", "stop"], capture_output=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))

    print(f"\n== krex fleet vs krex batch ({a.device}, {os.cpu_count()} CPUs); logs in {out}")
    print(f"{'case':<9} {'tool':<6} {'slots':>5} {'cmds':>5} {'ok':>5} {'cli_s':>7} {'run_s':>7} {'cmd/min':>8} "
          f"{'mean_wall_s':>11} {'cycle_ms':>9} {'disp_p50_ms':>11}")
    for r in rows:
        print(f"{r['case']:<9} {r['tool']:<6} {r['slots']:>5} {fmt(r.get('cmds')):>5} {fmt(r.get('ok')):>5} "
              f"{fmt(r['cli_wall_s']):>7} {fmt(r.get('run_wall_s')):>7} {fmt(r.get('per_min'), 1):>8} "
              f"{fmt(r.get('mean_wall_s'), 3):>11} "
              f"{fmt(None if r.get('cycle_s') is None else 1e3 * r['cycle_s'], 1):>9} "
              f"{fmt(None if r.get('dispatch_p50_s') is None else 1e3 * r['dispatch_p50_s'], 1):>11}")
    by = {(r["case"], r["tool"]): r for r in rows}
    sb, sf = by.get(("serial", "batch"), {}), by.get(("serial", "fleet"), {})
    if sb.get("cycle_s") and sf.get("cycle_s"):
        print(f"Ray per command (serial, median cycle fleet - batch): {1e3 * (sf['cycle_s'] - sb['cycle_s']):+.1f} ms")
    if sb.get("run_wall_s") and sf.get("run_wall_s"):
        print(f"Ray one-off start+stop (fleet cli - run wall, minus batch's): "
              f"{(sf['cli_wall_s'] - sf['run_wall_s']) - (sb['cli_wall_s'] - sb['run_wall_s']):.2f} s")
    pb, pf = by.get(("parallel", "batch"), {}), by.get(("parallel", "fleet"), {})
    if pb.get("per_min") and pf.get("per_min"):
        print(f"parallel throughput fleet/batch: {pf['per_min'] / pb['per_min']:.3f}")
    cb = [r for r in rows if r["case"] == "corpus" and r["tool"] == "batch" and r.get("per_min")]
    cf = [r for r in rows if r["case"] == "corpus" and r["tool"] == "fleet" and r.get("per_min")]
    if cb and cf:
        tb, tf = statistics.mean(r["per_min"] for r in cb), statistics.mean(r["per_min"] for r in cf)
        print(f"corpus throughput fleet/batch (mean of 2 runs each): {tf / tb:.3f}")
        devs = []
        for i, ms_b in cb[0]["ms"].items():
            vals_b = [r["ms"].get(i) for r in cb if r["ms"].get(i)]
            vals_f = [r["ms"].get(i) for r in cf if r["ms"].get(i)]
            if ms_b and vals_b and vals_f:
                devs.append(abs(statistics.mean(vals_f) / statistics.mean(vals_b) - 1))
        if devs:
            print(f"corpus measured ms, |fleet/batch - 1|: median {100 * statistics.median(devs):.2f}%, "
                  f"max {100 * max(devs):.2f}% over {len(devs)} commands")
    return 0 if all(r["rc"] in (0,) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
