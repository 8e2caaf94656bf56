"""What `krex run` adds per command when N commands start at once, against the bare command.

    python3 benchmarks/run_overhead.py --device gpu -n 16 -r 10
    python3 benchmarks/run_overhead.py --device sim -n 16 -r 10 --cmd "python3 bench.py"

Each round starts N copies of the bare command at once (`python -c pass` with this
interpreter, and the --cmd command if given), waits for all, then the same N under
`krex run --device DEVICE --`; rounds alternate bare/krex so both see the same noise.
Per-command wall time = spawn to exit (os.wait4). A daemon is started first in an
isolated KREX world (own state dir, segment and simulated-GPU names; `--slots-per-gpu N`
so all N are admitted at once) and warmed by one round that is not counted, and stopped
at the end. Needs only the krex package (and its dependencies) and the standard library,
and drives only the `krex` CLI, so the same file measures an older checkout too (before/after).

--journal-mb fills the fresh journal first, as on a node with history (a guardian that reads
the journal pays for its size). --stream M runs M commands through N slots, starting the next
`krex run` as one ends, against keeping K more guardians in flight that wait in admission
with their interpreter and imports done ("pre-warmed starts"); it prints both makespans.

On the H200, one call of about 3-5 minutes (logs and raw times to $OUT):

    python3 benchmarks/run_overhead.py --device gpu -n 16 -r 10 --journal-mb 16 --stream 48

Raw times go to $OUT (or --out) as run_overhead.json; the table is printed last."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _siblings import percentile


def krex_argv(entry: str, given: str | None = None) -> list[str]:
    """How `krex` is called: the console script given, or next to this interpreter (as users
    call it), or `python -m krex.cli.main` (what the library spawned before it had an entry)."""
    if given:
        return [given]
    script = Path(sys.executable).parent / "krex"
    if entry == "script":
        if not script.exists():
            found = shutil.which("krex")
            if not found:
                sys.exit("no `krex` console script next to this python nor on PATH; use --entry module")
            return [found]
        return [str(script)]
    return [sys.executable, "-m", "krex.cli.main"]


def wave(argvs: list[list[str]], env: dict[str, str], timeout: float) -> list[tuple[float, float, int]]:
    """Start every argv at once; return (wall seconds, CPU seconds of it and its reaped
    children, exit status) per command. CPU time does not depend on contention."""
    t0: dict[int, float] = {}
    out: dict[int, tuple[float, float, int]] = {}
    procs = []
    for a in argvs:
        t = time.perf_counter()
        p = subprocess.Popen(a, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        t0[p.pid] = t
        procs.append(p)
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        if time.monotonic() > deadline:
            for p in procs:
                if p.pid not in out:
                    p.kill()
            raise SystemExit(f"a wave did not finish within {timeout:g} s")
        pid, status, ru = os.wait4(-1, 0)
        if pid in t0:
            out[pid] = (time.perf_counter() - t0[pid], ru.ru_utime + ru.ru_stime, os.waitstatus_to_exitcode(status))
    for p in procs:
        p.returncode = out[p.pid][2]  # reaped above; keeps Popen from waiting again
    return [out[p.pid] for p in procs]


def stream(argv: list[str], env: dict[str, str], total: int, inflight: int, timeout: float) -> float:
    """Run `total` copies of argv with at most `inflight` at once, starting the next as one
    ends (as `krex batch -j` does); the makespan in seconds."""
    t0 = time.perf_counter()
    live: set[int] = set()
    started = 0
    deadline = time.monotonic() + timeout
    while started < total or live:
        while started < total and len(live) < inflight:
            p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            p.returncode = 0  # reaped below
            live.add(p.pid)
            started += 1
        if time.monotonic() > deadline:
            raise SystemExit(f"a stream did not finish within {timeout:g} s")
        pid, status, _ru = os.wait4(-1, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"a streamed command failed ({os.waitstatus_to_exitcode(status)}): {argv}")
        live.discard(pid)
    return time.perf_counter() - t0


def fill_journal(path: Path, size: int) -> None:
    """Older region records (slot 63, a day old) up to `size` bytes, as krexd writes them."""
    rec = {"ts": time.time() - 86400, "gpu": 0, "owner_slot": 63, "owner_pid": 1, "tid": 1, "slot": 63,
           "queue_wait_s": 1e-4, "block_s": 1e-4, "inflight_s": 1e-5, "drain_s": 1e-5, "freeze_s": 1e-5,
           "pin_s": 1e-4, "entry_s": 5e-4, "drained": 0, "frozen_slots": [], "freeze_policy": "all",
           "running_slots": [], "freeze_why": [], "reserved_cpus": [1], "contaminated": False, "reasons": [],
           "flags": [], "region_s": 1e-3, "thaw_s": 1e-5, "end": "end", "siblings_frozen": 0, "cut": False,
           "attest": {"nvml": "unavailable"}}
    line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o640)
    try:
        os.write(fd, line * max(1, size // len(line)))
    finally:
        os.close(fd)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (its own threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["sim", "gpu"], default="sim")
    ap.add_argument("-n", type=int, default=16, help="commands started at once (default 16)")
    ap.add_argument("-r", "--repeat", type=int, default=5, help="rounds per case (default 5)")
    ap.add_argument("--cmd", default=None, help="another command to measure the same way (a shell-quoted line)")
    ap.add_argument("--entry", choices=["script", "module"], default="script",
                    help="krex as the console script (default) or `python -m krex.cli.main`")
    ap.add_argument("--krex-bin", default=None, help="the krex console script to measure (a build elsewhere)")
    ap.add_argument("--krex-arg", action="append", default=[],
                    help="extra argument for `krex run` (repeatable), e.g. --krex-arg=--report=/dev/null")
    ap.add_argument("--stream", type=int, default=0, metavar="M",
                    help="also: M commands through -n slots, started as slots free up, without and with "
                    "--prewarm guardians started early (they wait in admission); makespans")
    ap.add_argument("--prewarm", type=int, default=None, metavar="K",
                    help="extra guardians in flight for --stream (default: -n)")
    ap.add_argument("--stream-cmd", default=None,
                    help="the streamed command (default: python -c 'import time; time.sleep(1)')")
    ap.add_argument("--journal-mb", type=float, default=0.0,
                    help="fill the fresh journal with this many MiB of older region records first, as on a "
                    "node with history (a guardian that reads the journal pays for its size)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where to write run_overhead.json")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per wave")
    args = ap.parse_args()

    world = Path(tempfile.mkdtemp(prefix="krex-overhead-"))
    tag = f"{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k not in ("LD_PRELOAD",)}
    env.update(KREX_STATE_DIR=str(world / "state"), KREX_SHM=f"/krex-ovh-{tag}", KREX_SIM_SHM=f"/krex-ovhsim-{tag}")
    if args.device == "sim":
        env["KREX_SIM_TRACE"] = str(world / "trace.jsonl")
    krex = krex_argv(args.entry, args.krex_bin)
    cases: list[tuple[str, list[str]]] = [("python -c pass", [sys.executable, "-c", "pass"])]
    if args.cmd:
        cases.append((args.cmd, shlex.split(args.cmd)))

    start = subprocess.run([*krex, "daemon", "start", "--device", args.device, "--slots-per-gpu", str(args.n)],
                           env=env, capture_output=True, text=True, timeout=60)
    if start.returncode != 0:
        sys.exit(f"krex daemon start failed ({start.returncode}): {start.stderr.strip()}")
    st = subprocess.run([*krex, "daemon", "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
    daemon_pid = int(json.loads(st.stdout)["daemon"]["pid"])
    if args.journal_mb > 0:
        fill_journal(world / "state" / "journal.jsonl", int(args.journal_mb * (1 << 20)))
    raw: dict[str, Any] = {"journal_mb": args.journal_mb, "device": args.device, "n": args.n, "repeat": args.repeat, "krex": krex,
                           "python": sys.executable, "cpus": os.cpu_count(), "cases": {}}
    rows = []
    srow: tuple[str, float, float, int] = ("", 0.0, 0.0, 0)
    try:
        for name, cmd in cases:
            under = [*krex, "-q", "run", "--device", args.device, *args.krex_arg, "--", *cmd]
            wave([under] * args.n, env, args.timeout)  # warm-up: page cache, daemon threads
            wave([cmd] * args.n, env, args.timeout)
            wall: dict[str, list[float]] = {"bare": [], "krex": []}
            cpu: dict[str, list[float]] = {"bare": [], "krex": []}
            bad: list[int] = []
            daemon_cpu = 0.0
            for _ in range(args.repeat):
                for label, argv in (("bare", cmd), ("krex", under)):
                    d0 = proc_cpu_s(daemon_pid)
                    res = wave([argv] * args.n, env, args.timeout)
                    if label == "krex":
                        daemon_cpu += proc_cpu_s(daemon_pid) - d0
                    wall[label].extend(w for w, _c, _rc in res)
                    cpu[label].extend(c for _w, c, _rc in res)
                    bad += [rc for _w, _c, rc in res if rc != 0]
            per_cmd_daemon = daemon_cpu / (args.repeat * args.n)
            raw["cases"][name] = {"wall_s": wall, "cpu_s": cpu, "nonzero_exits": bad, "daemon_cpu_s_per_cmd": per_cmd_daemon}
            mb, mk = statistics.median(wall["bare"]), statistics.median(wall["krex"])
            cb, ck = statistics.median(cpu["bare"]), statistics.median(cpu["krex"])
            rows.append((name, mb, percentile(wall["bare"], 95), mk, percentile(wall["krex"], 95), mk - mb, ck - cb, per_cmd_daemon, len(bad)))
        if args.stream:
            scmd = shlex.split(args.stream_cmd) if args.stream_cmd else [sys.executable, "-c", "import time; time.sleep(1)"]
            sunder = [*krex, "-q", "run", "--device", args.device, *args.krex_arg, "--", *scmd]
            k = args.n if args.prewarm is None else args.prewarm
            spans: dict[str, list[float]] = {"plain": [], "prewarm": []}
            for _ in range(args.repeat):
                for label, inflight in (("plain", args.n), ("prewarm", args.n + k)):
                    spans[label].append(stream(sunder, env, args.stream, inflight, args.timeout * args.stream))
            raw["stream"] = {"cmd": scmd, "total": args.stream, "slots": args.n, "prewarm": k, "makespan_s": spans}
            srow = (" ".join(scmd), statistics.median(spans["plain"]), statistics.median(spans["prewarm"]), k)
    finally:
        subprocess.run([*krex, "daemon", "stop"], env=env, capture_output=True, timeout=60)
        for n in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm" + n).unlink(missing_ok=True)
        shutil.rmtree(world, ignore_errors=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "run_overhead.json").write_text(json.dumps(raw, indent=1))
    print(f"\nkrex run overhead: device {args.device}, {args.n} commands at once, {args.repeat} rounds, "
          f"{os.cpu_count()} CPUs, krex = {' '.join(krex)}"
          + (f", journal prefilled with {args.journal_mb:g} MiB" if args.journal_mb else ""))
    print(f"{'command':<28} {'bare p50':>9} {'bare p95':>9} {'krex p50':>9} {'krex p95':>9} {'added p50':>10} {'added CPU':>10} {'krexd CPU':>10} {'rc!=0':>6}")
    for name, mb, pb, mk, pk, add, addc, dcpu, nbad in rows:
        print(f"{name[:28]:<28} {mb * 1e3:8.1f}ms {pb * 1e3:8.1f}ms {mk * 1e3:8.1f}ms {pk * 1e3:8.1f}ms "
              f"{add * 1e3:9.1f}ms {addc * 1e3:9.1f}ms {dcpu * 1e3:9.1f}ms {nbad:>6}")
    print("added p50: median krex wall - median bare wall per command; added CPU: the same for user+sys "
          "CPU time of the command's process tree (krex: guardian + command); krexd CPU: the daemon's CPU time "
          "per krex command")
    if args.stream:
        name, plain, pre, k = srow
        print(f"\nstream: {args.stream} x `{name[:40]}` through {args.n} slots, {args.repeat} rounds (median makespan)")
        print(f"  plain (next guardian starts when a command ends): {plain:.2f} s, "
              f"{60 * args.stream / plain:.1f} commands/min")
        print(f"  prewarm (+{k} guardians waiting in admission):    {pre:.2f} s, "
              f"{60 * args.stream / pre:.1f} commands/min, gain {100 * (plain / pre - 1):+.1f}%")
    if any(r[8] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
