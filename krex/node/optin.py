"""What a guardian needs from krexd to start a command, computed ONCE, here: the
opt-in environment (`opt_in_parts`) and the notes `krex run` prints at the end
(`release_notes` and its parts). krexd calls them; the guardian (interpose/guardian.c)
gets their results in krexd's `admit` and `release` replies and only applies or prints
them, and its finisher (krex/proc/finish.py) calls them when krexd went away. Nothing
here reads the caller's environment: the caller passes it."""

from __future__ import annotations

import json
import os
import shlex
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import krex
from krex.native import ffi, lib, shim_path, sim_dir

# An env_prepend entry's separators: ld.so splits LD_PRELOAD at spaces too.
_SEPS = {"LD_PRELOAD": ": "}


def hook_dir() -> Path:
    """The directory to put on PYTHONPATH: its sitecustomize.py installs automatic
    regions when KREX_AUTO_REGION is set, and costs one `import os` otherwise."""
    return Path(krex.__file__).resolve().parent / "proc" / "_hook"


def opt_in_parts(
    device: str, shm_name: str, sock: str, log: str | None
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The variables that put a process under KREX: (set, prepend). `set`: {name: value};
    `prepend`: {name: [value, separators]}: put value first in the variable's list,
    dropping empty entries and other copies of it (`prepend` below applies it).
    `device`: "sim" or "gpu"; `log`: the log of a krexd the shim starts on demand."""
    from krex.node.config import daemon_argv

    log_path = Path(log) if log else None
    put = {
        "KREX_SHM": shm_name,
        "KREX_SOCKET": sock,
        # How a self-registering shim starts krexd when none answers (on-demand, exits when idle).
        # krexd opens its log itself (checked directory, no symlink followed).
        "KREX_DAEMON_CMD": "exec env -u LD_PRELOAD "
        + shlex.join(daemon_argv(device, log_path, on_demand=True)),
    }
    pre = {"LD_PRELOAD": str(shim_path()), "PYTHONPATH": str(hook_dir())}
    if device == "sim":
        pre["LD_LIBRARY_PATH"] = str(sim_dir())
        put["KREX_DEVICE"] = "sim"
    return put, {k: [v, _SEPS.get(k, ":")] for k, v in pre.items()}


def prepend(old: str, value: str, seps: str) -> str:
    """`value` first in the list `old` (split at any of `seps`), empty entries and other
    copies of `value` dropped, joined with ':'. guardian.c's env_prepend is the same rule."""
    parts = [old]
    for s in seps:
        parts = [q for p in parts for q in p.split(s)]
    return ":".join([value, *(p for p in parts if p and p != value)])


def _names(f: Any) -> str:
    return str(ffi.string(f()).decode())


def daemon_cmd_ok(value: str, python_dirs: Iterable[str]) -> bool:
    """Is `value` a KREX_DAEMON_CMD in the one form krexd writes, with a Python of one of
    `python_dirs` (interpose/krex_env.h; guardian.c's daemon_cmd_ok is the same test)?"""
    head, module, safe = (
        _names(f) for f in (lib.krex_daemon_cmd_head, lib.krex_daemon_cmd_module, lib.krex_shell_safe)
    )
    if not value.startswith(head + "/"):
        return False
    rest = value[len(head):]
    n = len(rest) - len(rest.lstrip(safe))
    py, rest = rest[:n], rest[n:]
    safe_path = _names(lib.krex_daemon_cmd_safe_path)
    if rest.startswith(safe_path + " "):
        rest = rest[len(safe_path):]
    if not rest.startswith(module) or rest[len(module):len(module) + 1] not in ("", " "):
        return False
    if set(rest[len(module):]) - set(safe + " "):
        return False
    here = os.path.realpath(os.path.dirname(py))
    return any(here == os.path.realpath(d) for d in python_dirs)


def own_env(
    put: Mapping[str, Any], pre: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """What a guardian takes from krexd's admit reply (env_set `put`, env_prepend `pre`):
    this installation's shim always, its hook and simulated-GPU directories where krexd
    asks for those variables, the data variables of krex_env.h, and KREX_DAEMON_CMD only
    with this Python. Whatever else krexd answers is left out: a daemon never chooses the
    code a command loads. guardian.c's command_env is the rule; this is its reading in
    Python, which the unit tests hold krexd's replies to."""
    import sys

    names = set(_names(lib.krex_daemon_env_names).split())
    out = {k: v for k, v in put.items() if k in names and isinstance(v, str)}
    cmd = put.get("KREX_DAEMON_CMD")
    if isinstance(cmd, str) and daemon_cmd_ok(cmd, [os.path.dirname(sys.executable)]):
        out["KREX_DAEMON_CMD"] = cmd
    own = {"PYTHONPATH": hook_dir, "LD_LIBRARY_PATH": sim_dir}
    ours = {"LD_PRELOAD": [str(shim_path()), _SEPS["LD_PRELOAD"]]}
    ours.update({k: [str(f()), _SEPS.get(k, ":")] for k, f in own.items() if k in pre})
    return out, ours


# ----------------------------------------------------------------------- the notes


def queue_note(slots_busy: object) -> str:
    """What `krex run` says once when its admission has to wait for a slot."""
    return f"krex: waiting for a free slot ({slots_busy} commands are running)..."


SIM_ASKED = "--device sim"
SIM_NO_GPU = "--device auto: no GPU found"
SIM_DAEMON = "--device auto: the KREX daemon was started with --device sim"


def sim_reason(asked: str, daemon_device: str) -> str:
    """Why a command runs on the simulated GPU: it asked for it, `--device auto` found no
    GPU, or the daemon it joined was started on the simulated GPU."""
    if asked == "sim":
        return SIM_ASKED
    return SIM_DAEMON if daemon_device == "sim" else SIM_NO_GPU


def start_notes(
    simulated: bool, warm: bool = False, why: str = SIM_ASKED, cgroup_note: str = ""
) -> list[str]:
    """What `krex run` says once admitted, before its command starts. `why`: sim_reason;
    `cgroup_note`: why the command's cgroup is not below the one `krex run` runs in
    (cgplace.Placement)."""
    out = [cgroup_note] if cgroup_note else []
    if simulated:
        out.append(
            f"krex: running on the SIMULATED GPU ({why}): timings prove KREX's logic, never "
            "performance; nothing ran on a real GPU"
        )
    if warm:
        out.append("krex: every slot is busy: starting pre-warmed; its first GPU call waits for a free slot")
    return out


_STATE_RANK = {
    "wrapped": 6,
    "whole": 5,
    "pending": 4,
    "unsupported": 3,
    "failed": 3,
    "missing": 2,
    "absent": 1,
}


def gate_counters(procs: Iterable[Any]) -> dict[str, Any]:
    """The report's gate counters over a slot's process records (shm.ProcInfo): read after
    the command ended and before its slot is released, by whichever guardian writes it."""
    ps = list(procs)
    return {
        "gate_blocks": sum(p.blocked for p in ps),
        "gate_blocked_ms": round(sum(p.blocked_ms for p in ps), 3),
        "fail_opens": sum(p.fail_opens for p in ps),
        "paced": sum(p.paced for p in ps),
        "paced_ms": round(sum(p.paced_ms for p in ps), 3),
        "held": sum(p.held for p in ps),
        "held_ms": round(sum(p.held_ms for p in ps), 3),
        "submits": {k: sum(p.submits[k] for p in ps) for k in ps[0].submits} if ps else {},
    }


def guardian_members(report: Mapping[str, Any], req: Mapping[str, Any]) -> dict[str, Any]:
    """The native guardian's --report whole: `report` (run_report's), then what only the
    guardian saw, from its release request (krex_req_release): the command's exit status and
    krexd's stall while it ran (`daemon_events`), then its caller's members (`extra`) over
    them all, as Python's {**data, **extra}."""
    out = {**report, "exit_status": int(req.get("exit_status") or 0)}
    events: list[dict[str, Any]] = []
    if req.get("stalled_ts") is not None:
        events.append({"event": "daemon-stalled", "ts": round(float(req["stalled_ts"]), 6)})
        if req.get("stall_age_s") is not None:
            events[0]["heartbeat_age_s"] = round(float(req["stall_age_s"]), 3)
        if req.get("resumed_ts") is not None:
            events.append({"event": "daemon-resumed", "ts": round(float(req["resumed_ts"]), 6)})
    if events:
        out["daemon_events"] = events
    return {**out, **report_extra(req.get("extra"))}


def report_extra(text: object) -> dict[str, Any]:
    """The members a guardian's caller adds to its report (krex.runner's daemon_started),
    from the text krex.proc.launcher.exec_guardian handed it: a JSON object, else none."""
    if not isinstance(text, str) or not text.startswith("{"):
        return {}
    try:
        extra = json.loads(text)
    except ValueError:
        return {}
    return extra if isinstance(extra, dict) else {}


def run_report(
    slot: int,
    gpu: int,
    admission_wait_s: object,
    device: str,
    simulated: bool,
    counters: Mapping[str, Any],
    rel: Mapping[str, Any],
) -> dict[str, Any]:
    """`krex run --report`'s fields from the slot and its `release` reply: one list for krexd,
    which makes it for the guardian (`release` with "report": true), and for the guardian's
    finisher when krexd went away (krex.proc.finish). What only the guardian sees (its exit
    status, daemon events) comes after them (guardian_members, or the finisher's own)."""
    out: dict[str, Any] = {
        "slot": slot,
        "gpu": gpu,
        "admission_wait_s": admission_wait_s,
        "device": "sim" if simulated else device,
        "simulated": simulated,
        **counters,
    }
    if "prewarm_s" in rel:  # started pre-warmed: how long before it was given the GPU
        out["prewarm_s"] = rel["prewarm_s"]
        out["prewarm_given_gpu"] = rel.get("prewarm_given_gpu")
    if rel.get("tenant"):  # whose share of exclusive GPU time its regions used
        out["tenant"] = rel["tenant"]
    if isinstance(rel.get("mps_client_fault"), dict):  # another MPS client killed while it ran
        out["mps_client_fault"] = rel["mps_client_fault"]
    out["leftovers"] = rel.get("leftovers") or []
    out["leftovers_action"] = rel.get("action", "unknown")
    if isinstance(rel.get("cgroup"), dict) and rel["cgroup"]:  # where its cgroup was, and why
        out["cgroup"] = rel["cgroup"]
    if isinstance(rel.get("regions"), list):
        out["regions"] = [r for r in rel["regions"] if isinstance(r, dict)]
        # krexd lists the first regions (up to its cap and what one reply holds): how many
        # more there were, said openly; the counts below cover them all.
        out["regions_dropped"] = int(str(rel.get("regions_dropped") or 0))
        out["regions_cap"] = rel.get("regions_cap")
        if rel.get("regions_unfinished"):
            out["regions_unfinished"] = rel["regions_unfinished"]
        if rel.get("journal_error"):
            out["journal_error"] = str(rel["journal_error"])
        tally = rel.get("region_tally")
        if isinstance(tally, dict):
            region_tally([], out)
            out.update({k: tally[k] for k in TALLY_KEYS if k in tally})
        else:
            region_tally(out["regions"], out)
    return out


# Inductor's autotuning regions, by label (autoregion/core.py: "auto:<module>:<qualname>", plus
# ":whole" for a wrapper around the whole call): torch's own hook, or KREX's fallback wrapper
# of benchmark_gpu on a torch without it (autoregion/inductor.py).
INDUCTOR_LABEL = "auto:torch._inductor.runtime.benchmarking:"
INDUCTOR_PATHS = {
    "hook": "torch's set_gpu_benchmark_lock_context hook",
    "fallback": "KREX's fallback wrapper (benchmark_gpu wrapped whole: this torch has no "
    "set_gpu_benchmark_lock_context)",
}


def inductor_path(label: object) -> str | None:
    """"hook" or "fallback" for a region Inductor's autotuning opened, else None."""
    if not isinstance(label, str) or not label.startswith(INDUCTOR_LABEL):
        return None
    return "fallback" if label.endswith(":whole") else "hook"


# The report's counts (region_tally's keys).
TALLY_KEYS = (
    "region_count", "contaminated_regions", "cut_regions", "region_flags", "region_wait_s", "inductor_regions"
)


def region_tally(regs: Iterable[Mapping[str, Any]], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report's region counts (region_count, contaminated_regions, cut_regions,
    region_flags, region_wait_s, inductor_regions: Inductor's autotuning regions per path)
    over `regs`, added to `into` (krexd keeps one per slot)."""
    t = into if into is not None else {}
    t.setdefault("inductor_regions", {})
    t.setdefault("region_count", 0)
    t.setdefault("contaminated_regions", 0)
    t.setdefault("cut_regions", 0)
    t.setdefault("region_flags", {})
    t.setdefault("region_wait_s", 0.0)
    for r in regs:
        t["region_count"] += 1
        t["contaminated_regions"] += 1 if r.get("contaminated") else 0
        t["cut_regions"] += 1 if r.get("cut") else 0
        fl = r.get("flags")
        flags = [str(f) for f in fl] if isinstance(fl, list) else []
        if r.get("contaminated") and not flags:  # never "not clean ()": its end, else unflagged
            flags = [str(r.get("end") or "unflagged")]
        for f in flags:
            t["region_flags"][f] = t["region_flags"].get(f, 0) + 1
        t["region_wait_s"] = round(t["region_wait_s"] + float(str(r.get("queue_wait_s", 0))), 6)
        path = inductor_path(r.get("label"))
        if path is not None:
            t["inductor_regions"][path] = t["inductor_regions"].get(path, 0) + 1
    return t


def inductor_notes(report: Mapping[str, Any]) -> list[str]:
    """Which way Inductor's autotuning benchmarks became regions, when any did."""
    per = report.get("inductor_regions")
    if not isinstance(per, dict):
        return []
    return [
        f"krex: Inductor autotuning: {n} region(s) through {INDUCTOR_PATHS.get(str(path), path)}"
        for path, n in sorted(per.items())
        if isinstance(n, int) and n > 0
    ]


def leftover_notes(rel: Mapping[str, Any]) -> list[str]:
    """What `krex run` says about processes that outlived the command (a release reply)."""
    left = rel.get("leftovers") or []
    if not isinstance(left, list) or not left:
        return []
    what = ", ".join(f"pid {x.get('pid')} ({x.get('cmd')})" for x in left[:5] if isinstance(x, dict))
    if rel.get("action") == "kept":
        return [
            f"krex: {len(left)} process(es) outlived the command and keep running as a sibling "
            f"(frozen during other commands' regions): {what}"
        ]
    return [f"krex: {len(left)} process(es) outlived the command and were {rel.get('action')}: {what}"]


def trust_notes(report: Mapping[str, object]) -> list[str]:
    """What `krex run` says on stderr about regions it cannot vouch for."""
    out = []
    cut = int(str(report.get("cut_regions") or 0))
    bad = int(str(report.get("contaminated_regions") or 0))
    if cut:
        out.append(
            f"krex: warning: {cut} region(s) were cut by --max-region before their end: what ran after "
            "the cut was not exclusive"
        )
    if bad:
        flags = report.get("region_flags") or {}
        what = ", ".join(f"{k} x{v}" for k, v in flags.items()) if isinstance(flags, dict) else ""
        out.append(f"krex: warning: {bad} region(s) are not clean ({what}); see `krex journal` or the report")
    return out


def _read_status(d: Path, name: str, uid: int | None) -> Any:
    """One process's KREX_AUTO_STATUS_DIR file: a regular file of at most 1 MiB, never
    through a symlink, never blocking (a FIFO is refused). `uid`: krexd reads a directory
    a client named, so only a file of that user."""
    fd = os.open(Path(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid) or st.st_size > 1 << 20:
            raise ValueError("not a status file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return json.loads(f.read((1 << 20) + 1))
    finally:
        os.close(fd)


def auto_region_report(
    value: str,
    d: Path | None,
    regs: list[dict[str, Any]],
    remove: bool = True,
    uid: int | None = None,
    labels: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Which KREX_AUTO_REGION targets were wrapped (whole-call fallbacks included) and how
    many regions each made, merged over every process of the command. `d` None: no process
    left a status (the value was set, nothing loaded the hook). `remove`: delete the
    directory afterwards (its creator does; krexd, reading a client's, never does)."""
    targets: dict[str, dict[str, Any]] = {}
    procs = 0
    try:  # not Path.glob: no pattern compiled on every run
        names = sorted(os.listdir(d)) if d is not None else []
    except OSError:
        names = []
    for n in names:
        if not n.endswith(".json"):
            continue
        try:  # written by the command's processes: anything may be in it
            assert d is not None
            data = _read_status(d, n, uid)
            if not isinstance(data, dict) or not isinstance(data.get("targets") or [], list):
                continue
            ts = [t for t in data.get("targets") or [] if isinstance(t, dict)]
        except (OSError, ValueError, RecursionError):
            continue
        procs += 1
        value = value or str(data.get("value") or "")
        for t in ts:
            name = str(t.get("target"))
            cur = targets.get(name)
            rank = _STATE_RANK.get(str(t.get("state")), 0)
            if cur is None or rank > _STATE_RANK.get(str(cur["state"]), 0):
                targets[name] = {k: t.get(k) for k in ("target", "builtin", "state", "detail")}
    if remove and d is not None:
        try:
            os.rmdir(d)  # empty, the common case: no shutil
        except OSError:
            import shutil

            shutil.rmtree(d, ignore_errors=True)
    return auto_region_counted(
        {
            "value": value,
            "processes": procs,
            "targets": sorted(targets.values(), key=lambda t: str(t["target"])),
            "wrapped": sorted(n for n, t in targets.items() if t["state"] in ("wrapped", "whole")),
        },
        regs,
        labels,
    )


def auto_labels(regs: Iterable[Mapping[str, Any]], into: dict[str, int] | None = None) -> dict[str, int]:
    """How many regions each automatic label ("auto:TARGET", "auto:TARGET:whole") made, added
    to `into` (krexd keeps one per slot: its counts cover regions its list leaves out)."""
    per = into if into is not None else {}
    for r in regs:
        label = str(r.get("label") or "")
        if label.startswith("auto:"):
            per[label] = per.get(label, 0) + 1
    return per


def auto_region_counted(
    auto: dict[str, Any], regs: list[dict[str, Any]], labels: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """`auto` (auto_region_report's) with its region counts made from `labels` (auto_labels'
    counts, krexd's over every region of the command) or else from `regs`: also what the
    native guardian's finisher does to krexd's report when krexd went away."""
    counts = labels if labels is not None else auto_labels(regs)
    per: dict[str, int] = {}
    whole = 0
    for label, n in counts.items():
        name = label[5:].removesuffix(":whole")
        per[name] = per.get(name, 0) + int(n)
        whole += int(n) if label.endswith(":whole") else 0
    for t in auto.get("targets") or []:
        if isinstance(t, dict):
            t["regions"] = per.get(str(t.get("target")), 0)
    auto["auto_regions"] = sum(per.values())
    auto["whole_call_regions"] = whole
    return auto


def auto_region_kept(auto: Mapping[str, Any]) -> bool:
    """Whether a report carries `auto_region`: a process left its status, or KREX_AUTO_REGION
    was set (to anything but 0) in the guardian's environment, made regions or not."""
    return bool(auto.get("processes")) or auto.get("value") not in ("", "0", None)


def auto_region_warning(value: str, auto: object) -> str:
    states = ""
    if isinstance(auto, dict):
        ts = auto.get("targets") or []
        states = "; ".join(f"{t['target']}: {t['state']} ({t['detail']})" for t in ts)
        if not auto.get("processes"):
            states = "no process of the command loaded krex's hook (was the command Python?)"
    return (
        f"krex: warning: KREX_AUTO_REGION={value!r} was set but the command made no region, so nothing "
        f"was timed exclusively. Targets: {states or 'none'}"
    )


def auto_notes(report: Mapping[str, Any]) -> list[str]:
    """The auto-region warning, when KREX_AUTO_REGION was set and no region was made. The
    `inductor` regions KREX adds by itself do not count unless the value names it: a
    harness whose own target never engaged ran its timings unprotected all the same."""
    auto_rep = report.get("auto_region")
    if not isinstance(auto_rep, dict) or auto_rep.get("value") in ("", "0", None):
        return []
    value = str(auto_rep.get("value"))
    made = int(report.get("region_count") or 0)
    if "inductor" not in {v.strip() for v in value.split(",")}:
        made -= sum(
            int(t.get("regions") or 0)
            for t in auto_rep.get("targets") or []
            if isinstance(t, dict) and t.get("builtin") == "inductor"
        )
    return [auto_region_warning(value, auto_rep)] if made <= 0 else []


def release_notes(rel: Mapping[str, Any], report: Mapping[str, Any]) -> list[str]:
    """Every note `krex run` prints after its command, in order: an MPS client's fault it
    may have failed from (krex.node.mps.ClientFault.notice), leftovers, a journal
    error, untrusted regions, an auto-region warning, the Inductor path. `rel`: the release reply;
    `report`: region_tally's counts and, if any, `auto_region`."""
    fault = rel.get("mps_client_fault")
    out = [str(fault["notice"])] if isinstance(fault, dict) and fault.get("notice") else []
    out += leftover_notes(rel)
    if rel.get("journal_error"):
        out.append(f"krex: warning: {rel['journal_error']}")
    return out + trust_notes(report) + auto_notes(report) + inductor_notes(report)
