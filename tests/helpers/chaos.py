"""The chaos test: many commands on the simulated GPU under a private KREX world,
with faults injected at random, then a check of the simulated device's trace.

Commands (each `krex run --device sim` with its own KREX_SIM_TAG, which the simulator
writes into every operation, so the checker knows whose work each operation was
without asking KREX):
  owner     cp_worker.py chaos: regions of a few 100-us kernels; some overstay
            --max-region on purpose (they must come back cut);
  leftover  an owner started as `sh -c 'hammer & exec owner'`: the hammer outlives
            the command (killed by krex run, or kept with --keep-leftovers);
  hammer    cp_worker.py hammer: a sibling that submits all the time;
  escape    a sibling of one of the ESCAPES kinds: a process in its command that the gate
            cannot hold, each queueing kernels in deep batches (tests/c/escape.c,
            tests/c/hiddenrt.c): its shim inactive (`env -u KREX_SHM`), a bad KREX_SLOT,
            another user (setpriv), a setuid() drop in the program, a re-exec of itself
            without LD_PRELOAD, GPU calls from a library loaded with dlmopen (a link-map
            namespace of its own), a statically linked CUDA runtime, no shim at all
            (`env -u LD_PRELOAD`).
Faults, one every `fault_every` seconds on average: pause/resume (krex.node.control),
SIGKILL of an owner or of a hammer, SIGKILL of krexd and a restart, random bytes
over part of the segment, unlink of the segment's name.

The verdict: every region an owner saw end as clean must have no operation of
another command executing inside [t_grant, t_end] (a *false clean* otherwise), and
the same for every journal record that says clean, over the daemon's own
[t_grant_ns, t_end_ns]. A region that overstayed --max-region must be flagged
"cut" (or have failed). Zero false cleans is the pass mark. Flagged regions are
counted by reason; a flagged region with no foreign work inside is a false alarm
(allowed, counted)."""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from helpers import read_jsonl

ALL_FAULTS = ("pause", "kill-owner", "kill-sibling", "kill-daemon", "overwrite", "unlink")
ESCAPES = (
    "inactive-shim",
    "bad-slot",
    "other-user",
    "setuid",
    "reexec",
    "dlmopen",
    "static-runtime",
    "no-shim",
)
POLICIES = ("gpu", "all", "adaptive")
# The unprivileged user the other-user and setuid siblings run as.
OTHER_UID = 65534


@dataclass
class ChaosConfig:
    seconds: float = 40.0  # how long new commands keep coming
    target_regions: int = 0  # or: until this many owner regions (0: by time only)
    seed: int = 1
    owners: int = 3  # owner commands at once
    hammers: int = 1  # hammer commands at once
    regions_per_cmd: int = 30
    kernels: int = 2
    kernel_us: int = 100
    max_region: float = 0.3
    cut_p: float = 0.02
    cut_s: float = 0.45
    leftover_p: float = 0.25
    keep_p: float = 0.3  # of those: --keep-leftovers
    fault_every: float = 1.0
    faults: tuple[str, ...] = ALL_FAULTS
    slots: int = 8
    escapes: tuple[str, ...] = ()  # kinds of escaping siblings (ESCAPES), taken in turn
    escape_at_once: int = 1  # escaping sibling commands at once (when `escapes`)
    escape_us: int = 200  # their kernels' length
    escape_depth: int = 20  # kernels they queue before each wait
    freeze: str = ""  # krexd's freeze policy (KREX_FREEZE_POLICY); "": the test default
    env: tuple[tuple[str, str], ...] = ()  # more settings for krexd and every command


@dataclass
class Cmd:
    tag: str
    kind: str
    popen: subprocess.Popen[bytes]
    started: float


@dataclass
class ChaosResult:
    config: dict[str, Any]
    wall_s: float
    commands: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    regions: int = 0
    clean: int = 0
    flagged: int = 0
    errors: int = 0
    flags: Counter[str] = field(default_factory=Counter)
    false_clean: list[str] = field(default_factory=list)
    true_flags: int = 0
    false_alarms: int = 0
    long_regions: int = 0
    long_not_flagged: list[str] = field(default_factory=list)
    journal_regions: int = 0
    journal_clean: int = 0
    life_frozen: int = 0  # journal regions whose entry froze a sibling inside a LIFE call
    journal_false_clean: list[str] = field(default_factory=list)
    ops: int = 0
    daemon_tracebacks: int = 0
    kept: str = ""  # where the evidence of a failed run was copied
    escape_ops: Counter[str] = field(default_factory=Counter)  # kind -> its operations in the trace
    false_clean_by_kind: Counter[str] = field(default_factory=Counter)  # kind whose work was inside

    @property
    def ok(self) -> bool:
        return not self.false_clean and not self.journal_false_clean and not self.long_not_flagged

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("commands", "faults", "flags", "escape_ops", "false_clean_by_kind"):
            d[k] = dict(getattr(self, k))
        d["false_clean"] = self.false_clean[:20]
        d["journal_false_clean"] = self.journal_false_clean[:20]
        d["long_not_flagged"] = self.long_not_flagged[:20]
        d["false_clean_count"] = len(self.false_clean)
        d["journal_false_clean_count"] = len(self.journal_false_clean)
        d["ok"] = self.ok
        d["device"] = "simulated GPU (krex/_lib): proves logic, never performance"
        return d


def open_world(kx: Any, victims: dict[str, Path]) -> None:
    """What escaping siblings need from a test's KREX world (helpers.krex_world.Krex): their
    executables, its output folder and the simulator's trace reachable by another user
    (the other-user and setuid kinds run as OTHER_UID)."""
    for d in {victims["escape"].parent, kx.base}:
        os.chmod(d, 0o755)
    os.chmod(kx.out, 0o777)
    kx.trace.touch()
    os.chmod(kx.trace, 0o666)


def escape_argv(
    kind: str, victims: dict[str, Path], seconds: float, us: int, depth: int, arg: str = ""
) -> list[str]:
    """The command line of an escaping sibling of `kind` (ESCAPES), or of "held": the same
    program with nothing taken away. `arg`: the re-exec's delay in ms."""
    load = [f"{seconds:.2f}", str(us), str(depth)]
    esc = str(victims["escape"])
    plain = [esc, "plain", *load]
    return {
        "held": plain,
        "inactive-shim": ["env", "-u", "KREX_SHM", *plain],
        "bad-slot": ["env", "KREX_SLOT=x", *plain],
        "other-user": ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *plain],
        "setuid": [esc, "setuid", *load, str(OTHER_UID)],
        "reexec": [esc, "reexec", *load, arg or "600"],
        "dlmopen": [esc, "dlmopen", *load, str(victims["libnsgpu"])],
        "static-runtime": [str(victims["hiddenrt"]), *load],
        "no-shim": ["env", "-u", "LD_PRELOAD", *plain],
    }[kind]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


class Chaos:
    def __init__(self, cfg: ChaosConfig, log: Any = None) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
        from helpers.krex_world import KREX, WORKER, Krex

        self.KREX, self.WORKER = KREX, WORKER
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.kx = Krex()
        # A daemon that a client starts on demand (after a kill) gets the test's settings too.
        base_env = self.kx.env
        settings = {"KREX_MAX_REGION": str(cfg.max_region), "KREX_SLOTS_PER_GPU": str(cfg.slots)}
        if cfg.freeze:
            settings["KREX_FREEZE_POLICY"] = cfg.freeze
        settings.update(cfg.env)
        self.kx.env = lambda **extra: base_env(**settings, **extra)  # type: ignore[method-assign]
        self.cmds: list[Cmd] = []
        self.done: list[Cmd] = []
        self.n = 0
        self.res = ChaosResult(asdict(cfg), 0.0)
        self.log = log or (lambda _m: None)
        self.tag_kind: dict[str, str] = {}  # command tag -> its kind (escape kinds by name)
        self.n_escapes = 0
        if cfg.escapes:
            self._prepare_escapes()

    def _prepare_escapes(self) -> None:
        from helpers import victims

        unknown = set(self.cfg.escapes) - set(ESCAPES)
        if unknown:
            raise ValueError(f"unknown escaping sibling kinds {sorted(unknown)}; known: {', '.join(ESCAPES)}")
        self.victims = victims()
        open_world(self.kx, self.victims)

    # ------------------------------------------------------------------ commands
    def _spawn(self, kind: str) -> None:
        self.n += 1
        tag = f"c{self.n}"
        c, py, out = self.cfg, sys.executable, str(self.kx.out)
        owner = [
            py, str(self.WORKER), "chaos", out, "--name", tag, "-n", str(c.regions_per_cmd),
            "--kernels", str(c.kernels), "--us", str(c.kernel_us), "--cut-p", str(c.cut_p),
            "--cut-s", str(c.cut_s), "--pause-ms", str(self.rng.choice([0, 2, 10])),
        ]  # fmt: skip
        run = [*self.KREX, "run", "--device", "sim"]
        if kind == "escape":
            kind = self.cfg.escapes[self.n_escapes % len(self.cfg.escapes)]
            self.n_escapes += 1
            argv = [*run, "--", *self._escape_argv(kind)]
            self.tag_kind[tag] = kind
        elif kind == "hammer":
            argv = [*run, "--", py, str(self.WORKER), "hammer", out, "--name", tag, "--us", str(c.kernel_us),
                    "--seconds", str(self.rng.uniform(2, 8))]  # fmt: skip
        elif kind == "owner":
            argv = [*run, "--", *owner]
        else:  # a leftover: the hammer lives on after the owner (the command) exits
            ham = f"{py} {self.WORKER} hammer {out} --name {tag}-lo --us {c.kernel_us} --seconds 6"
            keep = ["--keep-leftovers"] if kind == "keep-leftover" else []
            script = f"{ham} >/dev/null 2>&1 & exec {' '.join(owner)}"
            argv = [*run, *keep, "--", "sh", "-c", script]
        logf = open(self.kx.out / f"{tag}.log", "wb")  # noqa: SIM115 - handed to the child
        try:
            p = subprocess.Popen(
                argv,
                env=self.kx.env(KREX_SIM_TAG=tag),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            logf.close()
        self.kx.popens.append(p)
        self.cmds.append(Cmd(tag, "escape" if tag in self.tag_kind else kind, p, time.monotonic()))
        self.res.commands[kind] += 1

    def _escape_argv(self, kind: str) -> list[str]:
        c = self.cfg
        arg = {"reexec": str(self.rng.choice([300, 600, 900]))}.get(kind, "")
        return escape_argv(kind, self.victims, self.rng.uniform(2, 6), c.escape_us, c.escape_depth, arg)

    def _reap(self) -> None:
        for c in list(self.cmds):
            if c.popen.poll() is not None:
                self.cmds.remove(c)
                self.done.append(c)

    def _running(self, *kinds: str) -> list[Cmd]:
        return [c for c in self.cmds if c.kind in kinds and c.popen.poll() is None]

    # ------------------------------------------------------------------ faults
    def _fault(self) -> None:
        f = self.rng.choice(self.cfg.faults)
        done = getattr(self, "_f_" + f.replace("-", "_"))()
        if done:
            self.res.faults[f] += 1

    def _f_pause(self) -> bool:
        from krex.errors import KrexError
        from krex.node import control
        from krex.node.shm import Segment

        try:
            with Segment.attach(self.kx.shm) as seg:
                control.pause(seg, 0, timeout=2.0, lease_s=5.0, wait_s=0.5)
                time.sleep(self.rng.uniform(0.01, 0.1))
                control.resume(seg, 0)
            return True
        except KrexError:
            return False

    def _kill_worker(self, kinds: tuple[str, ...]) -> bool:
        cands = self._running(*kinds)
        if not cands:
            return False
        c = self.rng.choice(cands)
        kids = _children(c.popen.pid)
        if not kids:
            return False
        with contextlib.suppress(OSError):
            os.kill(kids[0], signal.SIGKILL)
        return True

    def _f_kill_owner(self) -> bool:
        return self._kill_worker(("owner", "leftover", "keep-leftover"))

    def _f_kill_sibling(self) -> bool:
        return self._kill_worker(("hammer", "escape"))

    def _daemon_pid(self) -> int:
        lock = self.kx.sock.with_suffix(".lock")
        with contextlib.suppress(OSError):
            raw = lock.read_text().strip()
            if raw.isdigit() and os.path.exists(f"/proc/{raw}"):
                return int(raw)
        return 0

    def _f_kill_daemon(self) -> bool:
        """SIGKILL whichever daemon runs (the test's, or one a client started on demand with
        the same settings), then start one again unless a client already did."""
        pid = self._daemon_pid()
        if not pid:
            return False
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.kx.daemon is not None and self.kx.daemon.pid == pid:
            self.kx.daemon.wait(10)
        time.sleep(self.rng.uniform(0.05, 0.3))
        self._restart()
        return True

    def _restart(self) -> None:
        from krex.proc.client import daemon_alive

        for _ in range(50):
            if daemon_alive(self.kx.sock):
                return  # a client started one on demand (same settings through KREX_* variables)
            with contextlib.suppress(AssertionError):
                self.kx.start_daemon(slots=self.cfg.slots, max_region=self.cfg.max_region)
                return
            time.sleep(0.1)
        raise AssertionError("no daemon came back after a restart")

    def _f_overwrite(self) -> bool:
        path = Path("/dev/shm" + self.kx.shm)
        try:
            size = path.stat().st_size
            off = self.rng.choice([0, self.rng.randrange(0, 4096), self.rng.randrange(0, size - 512)])
            n = self.rng.randrange(8, 512)
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(bytes(self.rng.getrandbits(8) for _ in range(n)))
        except OSError:
            return False
        return True

    def _f_unlink(self) -> bool:
        try:
            Path("/dev/shm" + self.kx.shm).unlink()
        except OSError:
            return False
        return True

    # ------------------------------------------------------------------ run
    def _owner_regions(self) -> int:
        return sum(
            sum(1 for _ in open(p))
            for p in self.kx.out.glob("*.regions.jsonl")  # noqa: SIM115
        )

    def run(self) -> ChaosResult:
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            self.kx.start_daemon(slots=cfg.slots, max_region=cfg.max_region)
            next_fault = t0 + self.rng.expovariate(1 / cfg.fault_every)
            last_count = 0.0
            while True:
                now = time.monotonic()
                self._reap()
                if cfg.target_regions:
                    if now - last_count > 2:
                        last_count = now
                        if self._owner_regions() >= cfg.target_regions:
                            break
                elif now - t0 > cfg.seconds:
                    break
                while len(self._running("owner", "leftover", "keep-leftover")) < cfg.owners:
                    r = self.rng.random()
                    kind = "owner"
                    if r < cfg.leftover_p:
                        kind = "keep-leftover" if self.rng.random() < cfg.keep_p else "leftover"
                    self._spawn(kind)
                while len(self._running("hammer")) < cfg.hammers:
                    self._spawn("hammer")
                while cfg.escapes and len(self._running("escape")) < cfg.escape_at_once:
                    self._spawn("escape")
                if cfg.faults and now >= next_fault:
                    self._fault()
                    next_fault = time.monotonic() + self.rng.expovariate(1 / cfg.fault_every)
                time.sleep(0.02)
            # Let the running commands finish (no new ones, no more faults).
            deadline = time.monotonic() + 120
            while (
                self._running("owner", "leftover", "keep-leftover", "hammer", "escape")
                and time.monotonic() < deadline
            ):
                self._reap()
                time.sleep(0.1)
            for c in self.cmds:
                if c.popen.poll() is None:
                    self.log(f"command {c.tag} ({c.kind}) still runs at the end: killed")
            self.res.wall_s = round(time.monotonic() - t0, 1)
            self.res.daemon_tracebacks = self.kx.daemon_log().count("Traceback")
            self.check()
            if self.res.false_clean or self.res.journal_false_clean:
                # Keep the evidence (trace, journal, logs, commands' outputs) for a post-mortem.
                keep = Path(f"/tmp/krex-chaos-kept-{os.getpid()}-{int(time.time())}")
                with contextlib.suppress(OSError, shutil.Error):
                    shutil.copytree(self.kx.base, keep, symlinks=True, ignore_dangling_symlinks=True)
                    self.res.kept = str(keep)
        finally:
            self.kx.cleanup()
        return self.res

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        ops = [e for e in read_jsonl(self.kx.trace) if e.get("ev") == "op" and "tag" in e]
        self.res.ops = len(ops)
        ops.sort(key=lambda o: o["start"])
        starts = [o["start"] for o in ops]
        max_len = max((o["end"] - o["start"] for o in ops), default=0)
        pid_tag = {o["pid"]: o["tag"] for o in ops}
        for o in ops:
            if o["tag"] in self.tag_kind:
                self.res.escape_ops[self.tag_kind[o["tag"]]] += 1

        def foreign(tag: str, a: int, b: int) -> list[dict[str, Any]]:
            """Operations of other commands that executed inside [a, b]."""
            lo = bisect.bisect_left(starts, a - max_len)
            hi = bisect.bisect_right(starts, b)
            # (An op of no duration, a drain helper's context retain, occupies the GPU for no time.)
            busy = [o for o in ops[lo:hi] if o["end"] > o["start"]]
            return [o for o in busy if o["tag"] != tag and o["start"] < b and o["end"] > a]

        for path in sorted(self.kx.out.glob("*.regions.jsonl")):
            tag = path.name.split(".")[0]
            for r in read_jsonl(path):
                self.res.regions += 1
                bad = foreign(tag, r["t_grant"], r["t_end"]) if r.get("t_grant") else []
                if r.get("long"):
                    self.res.long_regions += 1
                if r.get("error"):
                    self.res.errors += 1
                    self.res.flags["error"] += 1
                elif r.get("clean"):
                    self.res.clean += 1
                    if bad:
                        o = bad[0]
                        for k in {self.tag_kind.get(b["tag"], "other") for b in bad}:
                            self.res.false_clean_by_kind[k] += 1
                        self.res.false_clean.append(
                            f"{tag} region {r['i']} [{r['t_grant']}, {r['t_end']}] clean, yet {len(bad)} "
                            f"op(s) of others ran inside, e.g. {o['tag']} pid {o['pid']} {o['api']} "
                            f"[{o['start']}, {o['end']}]"
                        )
                    if r.get("long"):
                        self.res.long_not_flagged.append(f"{tag} region {r['i']} overstayed and was not cut")
                else:
                    self.res.flagged += 1
                    for f in r.get("flags") or ["?"]:
                        self.res.flags[f] += 1
                    # An overstayed region must say it was cut, unless its daemon was lost under it.
                    if r.get("long") and not {"cut", "daemon-lost"} & set(r.get("flags") or []):
                        self.res.long_not_flagged.append(
                            f"{tag} region {r['i']} overstayed; flags {r.get('flags')}"
                        )
                if not r.get("clean"):
                    if bad:
                        self.res.true_flags += 1
                    else:
                        self.res.false_alarms += 1
        for rec in read_jsonl(self.kx.state / "journal.jsonl"):
            if not rec.get("t_grant_ns"):
                continue
            self.res.journal_regions += 1
            self.res.life_frozen += bool(rec.get("life_frozen"))
            if rec.get("contaminated"):
                continue
            self.res.journal_clean += 1
            tag = pid_tag.get(rec["owner_pid"])
            if tag is None:
                continue  # the owner never submitted: nothing to tell its work from others'
            bad = foreign(tag, rec["t_grant_ns"], rec["t_end_ns"])
            if bad:
                o = bad[0]
                self.res.journal_false_clean.append(
                    f"journal: pid {rec['owner_pid']} ({tag}) region [{rec['t_grant_ns']}, "
                    f"{rec['t_end_ns']}] clean, yet {o['tag']} pid {o['pid']} {o['api']} ran "
                    f"[{o['start']}, {o['end']}]"
                )


def run_chaos(cfg: ChaosConfig, log: Any = None) -> ChaosResult:
    return Chaos(cfg, log).run()


def summary_table(res: ChaosResult) -> str:
    d = res.to_json()
    rows = [
        ("wall time", f"{d['wall_s']} s"),
        ("commands", ", ".join(f"{k} {v}" for k, v in sorted(d["commands"].items()))),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(d["faults"].items()))),
        ("owner regions", d["regions"]),
        ("  clean", d["clean"]),
        ("  flagged", d["flagged"]),
        ("  failed (error at begin/end)", d["errors"]),
        ("  flags", ", ".join(f"{k} {v}" for k, v in sorted(d["flags"].items()))),
        ("  overstayed --max-region", f"{d['long_regions']} (not flagged: {len(d['long_not_flagged'])})"),
        ("flagged with foreign work inside", d["true_flags"]),
        ("flagged without (false alarms)", d["false_alarms"]),
        ("journal regions (daemon view)", f"{d['journal_regions']} ({d['journal_clean']} clean)"),
        ("  froze a sibling inside a LIFE call", str(d["life_frozen"])),
        ("FALSE CLEAN (owner view)", d["false_clean_count"]),
        ("FALSE CLEAN (journal)", d["journal_false_clean_count"]),
        *(
            [
                (
                    "  by whose work was inside",
                    ", ".join(f"{k} {v}" for k, v in sorted(d["false_clean_by_kind"].items())),
                )
            ]
            if d["false_clean_by_kind"]
            else []
        ),
        *(
            [
                (
                    "escaping siblings' operations",
                    ", ".join(f"{k} {v}" for k, v in sorted(d["escape_ops"].items())),
                )
            ]
            if d["escape_ops"] or d["config"].get("escapes")
            else []
        ),
        ("operations in the trace", d["ops"]),
        ("daemon tracebacks", d["daemon_tracebacks"]),
        ("verdict", "PASS" if d["ok"] else "FAIL"),
        *([("evidence kept in", d["kept"])] if d.get("kept") else []),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


if __name__ == "__main__":  # pragma: no cover - scripts/chaos.py is the entry point
    print(json.dumps(run_chaos(ChaosConfig(seconds=10)).to_json(), indent=1))
