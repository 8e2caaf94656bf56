"""Are a command's imports slower under `krex run` than bare, N commands at once?

In whole-corpus runs krex-8's summed import phase was 19-39 s (0.5-1 s a command)
longer than unprotected-8's, while krex-16's was shorter than unprotected-16's. This
experiment times the same child both ways, side by side: each round starts --n copies at
once, bare (`python3 child`), with only the shim preloaded
(inert: no daemon, no gate), in a fresh cgroup of its own as krex's slots put
commands (`--arms bare,cgroup,...`), or under `krex run` (the shim preloaded, the command in
its cgroup and slot), alternating the arms round by round. The child times, on its own clock,
`import torch, torch._dynamo, triton` (import) and its first CUDA call (ctx: context
creation through the shim); the parent times each command's wall from spawn to exit.

    python3 benchmarks/gpu_import_ab.py [--n 8] [--rounds 6]

Prints medians per arm and their ratios; writes $OUT/import_ab.json (every command)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from krex.runner import guardian_argv

CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch, torch._dynamo, triton  # noqa: E401,F401
t1 = time.perf_counter()
torch.zeros(1, device="cuda").sum().item()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "ctx_s": t2 - t1}))
"""


def one_round(arm: str, n: int, device: str = "gpu") -> list[dict[str, Any]]:
    env = dict(os.environ)
    if arm == "preload":  # the shim loaded but inert (no daemon, no gate): the loader's share
        from krex.native import shim_path

        env["LD_PRELOAD"] = str(shim_path())
    child = [sys.executable, "-c", CHILD]
    groups = []
    if arm == "cgroup":  # each command in a fresh cgroup beside krex's own, nothing else of krex
        from krex.node import freezer

        fz = freezer.detect(root_name="krex-import-ab")
        groups = [fz.group(f"ab{i}") for i in range(n)]
    t0 = time.perf_counter()
    procs = []
    for i in range(n):
        # krex: the bench's own launch (`krex run --report`'s lean entry, krex.runner.guardian_argv)
        argv = guardian_argv(child, f"/tmp/import_ab.{i}.json", device) if arm == "krex" else child
        pre = groups[i].preexec() if groups else None
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=pre))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        wall = time.perf_counter() - t0
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not line:
            raise SystemExit(f"{arm}: a command failed (rc {p.returncode}): {out[-500:]}")
        rows.append({**json.loads(line[-1]), "wall_s": wall, "arm": arm})
    for g in groups:
        g.remove()
    if groups:
        fz.remove_root()
    return rows


def where_it_runs() -> str:
    """The cgroup this runs in, the controllers its children get, and the file system torch
    is read from: the shared things that concurrent imports may contend on."""
    import importlib.util

    lines = []
    with open("/proc/self/cgroup") as f:
        lines.append("cgroup: " + f.read().strip().replace("\n", "; "))
    for p in ("/sys/fs/cgroup/cgroup.subtree_control", "/sys/fs/cgroup/unified/cgroup.subtree_control"):
        if os.path.exists(p):
            with open(p) as f:
                lines.append(f"{p}: {f.read().strip()}")
    spec = importlib.util.find_spec("torch")
    where = os.path.dirname(spec.origin) if spec and spec.origin else "/"
    fs = subprocess.run(["findmnt", "-n", "-T", where], capture_output=True, text=True).stdout.strip()
    lines.append(f"torch in {where}: {fs or '(findmnt gave nothing)'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8, help="commands started at once")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per arm (after one warm-up each)")
    ap.add_argument("--device", default="gpu", help="krex run's --device (sim: a logic check only)")
    ap.add_argument(
        "--arms",
        default="bare,preload,krex",
        help="comma list of bare, preload, cgroup (a fresh cgroup per command, as krex's slots), krex",
    )
    a = ap.parse_args()
    arms = tuple(a.arms.split(","))
    if arms[0] != "bare" or not set(arms) <= {"bare", "preload", "cgroup", "krex"}:
        raise SystemExit("--arms: bare first, then any of preload, cgroup, krex")
    print(where_it_runs())
    for arm in arms:  # warm-up: page cache, the daemon's start
        one_round(arm, a.n, a.device)
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:  # ABC, CBA, ...
            rows.extend({**x, "round": r} for x in one_round(arm, a.n, a.device))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "import_ab.json"), "w") as f:
        json.dump({"n": a.n, "rounds": a.rounds, "rows": rows}, f)
    med = {
        arm: {
            k: statistics.median(x[k] for x in rows if x["arm"] == arm)
            for k in ("import_s", "ctx_s", "wall_s")
        }
        for arm in arms
    }
    print(f"{a.n} commands at once, {a.rounds} rounds per arm, medians (s)")
    print(f"{'arm':6} {'import':>8} {'ctx':>8} {'wall':>8}")
    for arm in arms:
        m = med[arm]
        print(f"{arm:6} {m['import_s']:8.3f} {m['ctx_s']:8.3f} {m['wall_s']:8.3f}")
    b = med["bare"]
    for arm in arms[1:]:
        k = med[arm]
        print(
            f"{arm + '/bare':14} {k['import_s'] / b['import_s']:7.2f}x {k['ctx_s'] / b['ctx_s']:7.2f}x "
            f"{k['wall_s'] / b['wall_s']:7.2f}x"
        )
    # Paired by round (the rounds drift: page cache, clocks): each arm's median import over
    # the same round's bare median, one ratio a round.
    for arm in arms[1:]:
        ratios = []
        for r in range(a.rounds):

            def mid(name: str, r: int = r) -> float:
                return float(
                    statistics.median(x["import_s"] for x in rows if x["arm"] == name and x["round"] == r)
                )

            ratios.append(mid(arm) / mid("bare"))
        print(
            f"{arm + '/bare':14} import by round: "
            + " ".join(f"{x:.3f}" for x in ratios)
            + f"  median {statistics.median(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
