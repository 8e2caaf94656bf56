"""The `krex` command: a thin click layer over the krex library.

All output and every exit status live here; errors from the library are
KrexError subclasses, mapped to exit codes in one place (`main`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from krex import __version__
from krex.device import DEVICES
from krex.errors import KrexError
from krex.native import lib

from . import quiet
from .bench_cmd import register as register_bench
from .commands_extra import register as register_extra
from .compare_cmd import register as register_compare
from .fleet_cmd import register as register_fleet
from .lean import setup_cli_logging
from .progress import fmt_s

if TYPE_CHECKING:
    from krex.node.shm import Snapshot
    from krex.protocol import StatusReply

DEVICE = click.Choice(DEVICES)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="krex")
@click.option("-v", "--verbose", count=True, help="log what KREX does to stderr (-vv: debug)")
@click.option("-q", "--quiet", is_flag=True, help="only results and errors: no progress or notices")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """KREX: share one GPU among many kernel benchmarks; keep their timings exclusive."""
    if verbose and quiet:
        raise click.UsageError("-v and -q contradict each other")
    ctx.obj = {"quiet": quiet, "verbose": verbose}
    setup_cli_logging(verbose, quiet)




@cli.command()
@click.option(
    "--device",
    type=DEVICE,
    default="auto",
    show_default=True,
    help="sim: also point LD_LIBRARY_PATH at the simulated GPU libraries",
)
@click.option("--export", "export", is_flag=True, help="print `export` lines for eval")
@click.option("--nvtx-region", default=None, metavar="PATTERN",
              help="also KREX_NVTX_REGION: NVTX ranges whose name matches PATTERN become regions")
@click.option("--gpu", "gpu", type=click.IntRange(min=0), default=0, show_default=True,
              help="with krexd running MPS: the GPU whose MPS variables to print")
def env(device: str, export: bool, nvtx_region: str | None, gpu: int) -> None:
    """Print the variables that opt a process into KREX (and, while krexd runs MPS, the
    MPS variables `krex run` gives a command on the GPU)."""
    from krex.device.gpus import discover, sim_gpu_count
    from krex.node.shm import default_name
    from krex.proc.envvars import format_env, mps_env, opt_in_env

    kind = "sim" if device == "sim" else discover(device).kind
    if kind == "sim":
        sim_gpu_count()  # validates KREX_SIM_GPUS now rather than in every opted-in process
    out = opt_in_env("sim" if kind == "sim" else "gpu", default_name())
    out.update(mps_env(gpu))
    if nvtx_region is not None:
        from krex.native import nvtx_path

        nvtx_path()  # NotFound (with the fix) when this installation has no NVTX library
        out["KREX_NVTX_REGION"] = nvtx_region
    click.echo(format_env(out, export))


@cli.command("include-dir")
def include_dir() -> None:
    """Print the directory holding krex.h (the C/C++ region markers)."""
    from krex.native import include_dir as inc

    click.echo(str(inc()))


@cli.command()
@click.option("--gpu", type=int, required=True, help="GPU index")
@click.option(
    "--timeout",
    type=float,
    default=lib.KREX_PAUSE_TIMEOUT_MS / 1e3,
    show_default=True,
    help="seconds to wait for in-flight work and drain acks",
)
@click.option(
    "--for",
    "lease",
    type=float,
    default=lib.KREX_PAUSE_LEASE_MS / 1e3,
    show_default=True,
    help="seconds the pause holds before it lapses by itself",
)
def pause(gpu: int, timeout: float, lease: float) -> None:
    """Stop new GPU work on a GPU until `krex resume` (or until --for runs out).

    Interrupted while it waits (Ctrl-C, SIGTERM, SIGHUP), it reopens the gate."""
    from krex.node.control import pause as do_pause
    from krex.node.shm import Segment

    with Segment.attach() as seg, _signals_interrupt():
        r = do_pause(seg, gpu, timeout, lease)
    click.echo(f"GPU {gpu} paused (holds for {lease:g} s or until `krex resume --gpu {gpu}`)")
    click.echo(f"  waited for in-flight submissions: {fmt_s(r.inflight.seconds)}")
    click.echo(f"  drained {r.drain.count} process(es):     {fmt_s(r.drain.seconds)}")


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP interrupt like Ctrl-C, so `finally` blocks release what they took."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@cli.command()
@click.option("--gpu", type=int, required=True, help="GPU index")
def resume(gpu: int) -> None:
    """Open a paused GPU's gate."""
    from krex.node.control import resume as do_resume
    from krex.node.shm import Segment

    with Segment.attach() as seg:
        opened = do_resume(seg, gpu)
    click.echo(f"GPU {gpu} resumed" if opened else f"GPU {gpu} was not paused")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(as_json: bool) -> None:
    """Show gates, slots, processes and counters."""
    from krex.proc.nodestatus import read_status

    st = read_status()
    snap, live = st.snap, st.live
    if as_json:
        out = {**snap.to_json(), "daemon": live or None}
        if not live:
            out["daemon_error"] = st.daemon_error
        click.echo(json.dumps(out, indent=2))
        return
    lines = [*_status_head(snap, live.get("segment") or {}), *_status_gates(snap)]
    lines += _mps_lines(live.get("mps") or {})
    lines += _status_regions(live) if live else [f"REGIONS: {st.daemon_error}"]
    lines += _status_slots(snap, live) + _status_procs(snap)
    click.echo("".join(f"{line}\n" for line in lines), nl=False)


def _status_head(snap: Snapshot, seg_state: dict[str, Any]) -> list[str]:
    from krex.proc.nodestatus import segment_line

    hb = "never" if snap.heartbeat_age_s is None else f"{snap.heartbeat_age_s:.1f} s ago"
    out = [f"segment {snap.name}: {snap.n_gpus} GPU(s), daemon pid {snap.daemon_pid or '-'}, heartbeat {hb}"]
    if seg_state:
        out.append(f"SEGMENT {segment_line(seg_state)}")
        for inc in (seg_state.get("incidents") or [])[-3:]:
            out.append(f"  incident: {'; '.join(inc['problems'])} -> {'; '.join(inc['actions'])}")
    return out


def _status_gates(snap: Snapshot) -> list[str]:
    out = ["GATES"]
    for g in snap.gates:
        state = "open" if not g.closed else f"CLOSED by {g.holder}"
        if g.closed and g.owner_slot >= 0:
            state += f" (owner slot {g.owner_slot})"
        if g.lease_left_s is not None:
            state += f", lease {g.lease_left_s:.0f} s left"
        out.append(f"  gpu {g.gpu}: {state}; closes {g.closes}, fail-opens {g.fail_opens}")
    return out


def _status_regions(live: StatusReply) -> list[str]:
    out = [f"REGIONS ({len(live['regions'])})"]
    for r in live["regions"]:
        state = "granted" if r["granted"] else "entering"
        who = f"slot {r['slot']} pid {r['pid']} tid {r['tid']}"
        who += f" tenant {r['tenant']}" if r.get("tenant") else ""
        out.append(f"  gpu {r['gpu']}: {who} {state}, {r['age_s']:.3f} s")
    for g, q in live["queues"].items():
        if q:
            out.append(
                f"  gpu {g} queue ({live.get('region_queue', 'fifo')}): "
                + ", ".join(f"slot {e['slot']} (pid {e['pid']}, {e.get('tenant') or '-'})" for e in q)
            )
    for g, used in (live.get("tenant_used_s") or {}).items():
        if used:
            out.append(f"  gpu {g} exclusive time by tenant: "
                       + ", ".join(f"{t} {s_:.2f} s" for t, s_ in sorted(used.items())))
    return out


def _status_slots(snap: Snapshot, live: StatusReply) -> list[str]:
    out = [f"SLOTS ({len(snap.slots)})"]
    tenants = {d["slot"]: d.get("tenant") for d in live.get("slots") or []}
    for s in snap.slots:
        out.append(
            f"  slot {s.slot}: gpu {s.gpu}, guardian pid {s.owner_pid}{'' if s.owner_alive else ' (dead)'}"
            + (f", tenant {tenants[s.slot]}" if tenants.get(s.slot) else "")
            + (", pre-warmed: waits for a free slot at its first GPU call" if s.warm else "")
        )
    return out


_PROC_COLS = (
    "pid", "slot", "gpu", "infl", "kernels", "copies", "other", "blocked", "blocked_ms", "fopen", "flags"
)


def _status_procs(snap: Snapshot) -> list[str]:
    out = [f"PROCESSES ({len(snap.procs)})"]
    if snap.procs:
        out.append("  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10} {:>5}  {}".format(*_PROC_COLS))
    for p in snap.procs:
        other = p.submits["memset"] + p.submits["graph"] + p.submits["prefetch"]
        out.append(
            "  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10.1f} {:>5}  {}".format(
                p.pid, p.slot, p.gpu, p.inflight,
                p.submits["kernel"],
                p.submits["copy"],
                other,
                p.blocked,
                p.blocked_ms,
                p.fail_opens,
                ",".join(p.flags) + ("" if p.alive else " dead"),
            )
        )
    return out


def _run_options(f: Any) -> Any:
    """`krex run`'s options as click options, made from the one table (krex.proc.runopts)."""
    from krex.proc.runopts import RUN

    for o in reversed(RUN):
        kw: dict[str, Any]
        if o.is_flag:
            kw = {"is_flag": True}
        elif o.choices:
            shown = o.default is not None
            kw = {"type": click.Choice(o.choices), "default": o.default, "show_default": shown}
        elif o.path:
            kw = {"type": click.Path(dir_okay=False, writable=True), "default": o.default}
        else:
            kw = {"type": o.type, "default": o.default}
        f = click.option(o.flag, help=o.help, **kw)(f)
    return f


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_run_options
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run(cmd: tuple[str, ...], **opts: Any) -> None:
    """Run CMD under KREX and exit with its exit status.

    Starts the node daemon if none is running. CMD's whole process tree lives in
    a slot of its own; only its marked regions get the GPU exclusively.

    Exit status: CMD's own; 125 when KREX itself failed (the error is printed and,
    with --report, written to the report as `krex_error`); 126/127 when CMD cannot
    be executed / is not found."""
    from krex.proc.launcher import run_command

    notify = (lambda _m: None) if quiet() else (lambda m: click.echo(m, err=True))
    sys.exit(run_command(list(cmd), notify=notify, quiet=quiet(), **opts))


@cli.group()
def daemon() -> None:
    """Start, stop or inspect the node daemon (krexd)."""


class _Setting(click.ParamType):  # type: ignore[type-arg]
    """A krexd setting, checked by its entry in krex.node.config.KEYS; passed on as given."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.name = key.name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            self.key.check(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def _daemon_settings(f: Any) -> Any:
    """krexd's settings as click options, made from the one table (krex.node.config.KEYS)."""
    from krex.node.config import FLAGS

    for key in reversed(FLAGS):
        assert key.flag is not None  # FLAGS: the keys that have one
        bare: dict[str, Any] = {"is_flag": False, "flag_value": key.bare} if key.bare is not None else {}
        f = click.option(
            key.flag, key.name, type=_Setting(key), default=None, metavar=key.metavar(), help=key.help_text(),
            **bare,
        )(f)
    return f


@daemon.command("start")
@click.option("--device", type=DEVICE, default="auto", show_default=True)
@_daemon_settings
@click.option("--foreground", is_flag=True, help="run in this process instead of detaching")
def daemon_start(device: str, foreground: bool, **settings: Any) -> None:
    """Start krexd (krex run starts it on demand anyway).

    Settings not given here come from the environment (KREX_SLOTS_PER_GPU,
    KREX_MAX_REGION, KREX_IDLE_EXIT, KREX_FREEZER, ...) or the config file
    (KREX_CONFIG, ~/.config/krex/krex.toml, /etc/krex/krex.toml); see docs/operating.md."""
    from krex import paths
    from krex.errors import Busy
    from krex.node.config import config_from
    from krex.node.daemon import run as run_daemon
    from krex.proc.client import daemon_alive, start_background

    holder = paths.lock_holder()
    if daemon_alive() or holder is not None:
        raise Busy(
            f"a KREX daemon is already running (pid {holder or '?'}) on {paths.socket_path()}",
            "use it, or stop it first with `krex daemon stop`",
        )
    cfg = config_from(device, settings)  # a bad setting fails here, not in a detached daemon
    if foreground:
        run_daemon(cfg)
        return
    started = start_background(device, settings)
    if not started.ours:  # a concurrent `daemon start` won: report the one that runs
        raise Busy(
            f"a KREX daemon is already running (pid {started.pid}) on {paths.socket_path()}",
            "use it, or stop it first with `krex daemon stop`",
        )
    click.echo(f"krexd started (pid {started.pid}, socket {paths.socket_path()})")


@daemon.command("stop")
def daemon_stop() -> None:
    """Stop krexd: regions end, siblings thaw, gates open.

    Finds the daemon by its socket, else by its lock (a removed socket). A daemon
    that does not answer (stopped or hung) is sent SIGTERM and SIGCONT."""
    import time

    from krex import paths
    from krex.errors import NotFound, Timeout
    from krex.proc.client import Client, proc_state

    pid: int | None = None
    how = ""
    extra_s = 0.0  # what krexd says its stop may take beyond 10 s (quitting MPS control daemons)
    try:
        c = Client.connect()
        pid = c.daemon_pid
        try:
            extra_s = float(c.request({"op": "shutdown"}, timeout=10.0).get("stop_wait_s") or 0.0)
        finally:
            c.close()
    except Timeout as e:
        how = f" ({e}; sent SIGTERM)"
    except NotFound:
        pid = paths.lock_holder()
        if pid is None:
            raise
        how = " (its socket was missing; sent SIGTERM)"
    if how and pid is not None:
        _signal_daemon(pid)
    deadline = time.monotonic() + 10.0 + extra_s
    while True:
        if pid is None or proc_state(pid) in (None, "Z", "X"):
            click.echo(f"krexd stopped (pid {pid}){how}")
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if extra_s:
        raise Timeout(
            f"krexd (pid {pid}) did not stop within {10.0 + extra_s:g} s{how}: it may still be stopping "
            "its MPS control daemons",
            f"see its log ({paths.log_path()}) and wait for it (`krex daemon status`); `kill -9 {pid}` "
            "leaves its MPS control daemons running (a krexd started with --mps stops them)",
        )
    raise Timeout(f"krexd (pid {pid}) did not stop within 10 s{how}", f"kill -9 {pid}")


def _signal_daemon(pid: int) -> None:
    """SIGTERM a daemon found by its lock, after checking it is one (and ours)."""
    from krex.errors import PermissionDenied

    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return
    if b"krex" not in cmdline:
        raise PermissionDenied(f"pid {pid} holds the KREX lock but is not krexd", f"inspect it: ps -p {pid}")
    try:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a stopped daemon handles SIGTERM once it runs again
    except PermissionError:
        raise PermissionDenied(
            f"krexd pid {pid} belongs to another user", "ask its owner to stop it"
        ) from None


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True)
def daemon_status(as_json: bool) -> None:
    """Show the daemon's pid, socket, uptime, freezer and CPU partition."""
    from krex.proc.client import Client

    c = Client.connect()
    try:
        st = c.request({"op": "status"})
    finally:
        c.close()
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    d = st["daemon"]
    click.echo(f"krexd pid {d['pid']}, socket {d['socket']}, up {d['uptime_s']} s")
    click.echo(f"  device {d['device']} x{d['gpus']}, segment {d['shm']}, freezer {d['freezer']}")
    click.echo(
        f"  regions so far {d['regions_done']}, max region {d['max_region_s']} s, "
        f"slots per GPU {st['slots_per_gpu']}, pre-warmed starts per GPU {st.get('prewarm', 0)}"
    )
    if "idle_exit_s" in d:
        idle = "never" if d["idle_exit_s"] is None else f"{d['idle_exit_s']:g} s"
        click.echo(f"  exits when idle for: {idle}; log {d.get('log', '-')}")
    if d.get("lend_cores_off"):
        click.echo(f"  lend_cores: off ({d['lend_cores_off']})")
    elif "lend_cores" in d:
        watched = "counted" if d.get("region_core_watched") else "not counted"
        click.echo(f"  lend_cores: {d['lend_cores']}; siblings' time on a region core is {watched}")
    for line in _partition_lines(st["partition"]):
        click.echo("  " + line)


def _mps_lines(mps: dict[str, Any]) -> list[str]:
    """Each GPU's MPS control daemon (krex/node/mps.py): on, down, restarting or attached."""
    left = [f"MPS: control daemon pid {d['pid']} left by a previous krexd (pipe {d['pipe_dir']}) still runs "
            f"for {len(d['clients'])} command(s) using it; a krexd started once they ended stops it"
            for d in mps.get("left") or []]
    if mps.get("mode", "off") == "off":
        return left
    out = [f"MPS ({'attached: krexd never stops it' if mps['mode'] == 'attach' else 'started by krexd'})"]
    for m in mps.get("gpus", []):
        line = f"  gpu {m['gpu']}: {m['state']}, pid {m.get('pid') or '-'}, pipe {m['pipe_dir']}"
        line += f", restarted {m['restarts']}x" if m.get("restarts") else ""
        out.append(line + (f"; last error: {m['error']}" if m.get("error") else ""))
    return out + left


def _partition_lines(part: dict[str, Any]) -> list[str]:
    out = [f"CPU partition: housekeeping {part.get('housekeeping')}"]
    for s in part.get("slices", []):
        out.append(f"  gpu {s['gpu']}: shared {s['shared']}, region cores {s['reserved']}")
    if part.get("degraded"):
        out.append(f"  DEGRADED: {part.get('reason')}")
    return out


@cli.command()
@click.option("-n", "last", type=int, default=20, show_default=True, help="how many recent regions")
@click.option("--json", "as_json", is_flag=True)
@click.option("--fleet", "fleet", is_flag=True, help="every KREX node of a Ray cluster (`krex fleet`)")
@click.option("--address", default=None, help="with --fleet: the Ray cluster (default: $RAY_ADDRESS or auto)")
@click.option("--node-root", default=None, help="with --fleet: the --node-root the fleet ran with")
def journal(last: int, as_json: bool, fleet: bool, address: str | None, node_root: str | None) -> None:
    """Print recent regions from the journal (of every node with --fleet)."""
    from krex import paths
    from krex.node import journal as jr

    if fleet:
        from .fleet_cmd import journal_fleet

        journal_fleet(address, node_root, last, as_json)
        return

    got = jr.read_counted(paths.journal_path(), last)
    recs = got.records
    if got.skipped:
        click.echo(f"krex: note: {got.skipped} malformed line(s) skipped in {paths.journal_path()}", err=True)
    if as_json:
        click.echo(json.dumps(recs, indent=2))
        return
    row = "{:<14} {:>8} {:>3} {:>4} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>6}  {:<11} {:<16} {}"
    click.echo(
        row.format(
            "time",
            "pid",
            "gpu",
            "slot",
            "wait_ms",
            "entry_ms",
            "drain_ms",
            "frz_ms",
            "pin_ms",
            "region_ms",
            "frozen",
            "end",
            "label",
            "command",
        )
    )
    ms = ("queue_wait_s", "entry_s", "drain_s", "freeze_s", "pin_s", "region_s")
    for r in recs:
        if r.get("event"):  # not a region: something krexd did to a command
            who = f"{jr.when(r)} {r.get('guardian_pid', 0):>8} {r.get('gpu', 0):>3} {r.get('slot', 0):>4}"
            click.echo(f"{who}  {_event_line(r)}")
            continue
        click.echo(
            row.format(
                jr.when(r),
                r.get("owner_pid", 0),
                r.get("gpu", 0),
                r.get("owner_slot", 0),
                *(f"{1e3 * (r.get(k) or 0):.2f}" for k in ms),
                r.get("siblings_frozen", 0),
                str(r.get("end", "")),
                jr.one_line(r.get("label")) or "-",
                jr.one_line(r.get("cmd")) or "-",
            )
        )
        if r.get("contaminated"):
            click.echo(f"{'':<14} CONTAMINATED: " + "; ".join(r.get("reasons", [])))


def _event_line(r: dict[str, Any]) -> str:
    if r.get("event") == "guardian-lost":
        procs = r.get("processes") or []
        what = ", ".join(str(x.get("pid")) for x in procs[:8] if isinstance(x, dict)) or "none left"
        return (
            f"EVENT: guardian pid {r.get('guardian_pid')} of slot {r.get('slot')} died ({r.get('why')}); "
            f"its command was {r.get('action')} (pids {what})"
        )
    if r.get("event") == "mps-client-fault":
        from krex.node import journal as jr

        return (
            f"EVENT: MPS client pid {r.get('pid')} (`{jr.one_line(r.get('command'))}`) of slot "
            f"{r.get('slot')} was killed by {r.get('signal')}: its GPU's regions until the MPS server "
            "restarts are flagged mps-client-fault"
        )
    return f"EVENT: {r.get('event')}"


register_extra(cli)
register_bench(cli)
register_fleet(cli)
register_compare(cli)


def main(argv: list[str] | None = None) -> Any:
    try:
        return cli.main(args=argv, prog_name="krex", standalone_mode=False)
    except KrexError as e:
        click.echo(f"krex: error: {e}", err=True)
        if e.fix:
            click.echo(f"  fix: {e.fix}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("krex: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        ctx = getattr(e, "ctx", None)
        # A bad option of `krex run` is KREX failing, not the command: 125 (see `krex run --help`).
        sys.exit(125 if ctx is not None and ctx.command.name == "run" else e.exit_code)


if __name__ == "__main__":
    main()
