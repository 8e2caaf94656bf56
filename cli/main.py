"""The `krex` command: a thin click layer over the krex library.

All output and every exit status live here; errors from the library are
KrexError subclasses, mapped to exit codes in one place (`main`)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click

from krex import __version__
from krex.errors import KrexError

from . import quiet
from .bench_cmd import register as register_bench
from .commands_extra import register as register_extra
from .fleet_cmd import register as register_fleet

DEVICE = click.Choice(["auto", "gpu", "sim"])


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


def setup_cli_logging(verbose: int, quiet: bool) -> None:
    """The library logs to the `krex` logger (NullHandler by default); the CLI shows
    warnings, -v info, -vv debug, -q errors only."""
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    lg = logging.getLogger("krex")
    if not any(getattr(h, "_krex_cli", False) for h in lg.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("krex: %(levelname)s %(name)s: %(message)s"))
        h._krex_cli = True  # type: ignore[attr-defined]
        lg.addHandler(h)
    lg.setLevel(level)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


@cli.command()
@click.option(
    "--device",
    type=DEVICE,
    default="auto",
    show_default=True,
    help="sim: also point LD_LIBRARY_PATH at the simulated GPU libraries",
)
@click.option("--export", "export", is_flag=True, help="print `export` lines for eval")
def env(device: str, export: bool) -> None:
    """Print the variables that opt a process into KREX."""
    from krex.envvars import format_env, opt_in_env
    from krex.gpus import discover, sim_gpu_count
    from krex.shm import default_name

    kind = "sim" if device == "sim" else discover(device).kind
    if kind == "sim":
        sim_gpu_count()  # validates KREX_SIM_GPUS now rather than in every opted-in process
    click.echo(format_env(opt_in_env("sim" if kind == "sim" else "gpu", default_name()), export))


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
    default=10.0,
    show_default=True,
    help="seconds to wait for in-flight work and drain acks",
)
@click.option(
    "--for",
    "lease",
    type=float,
    default=600.0,
    show_default=True,
    help="seconds the pause holds before it lapses by itself",
)
def pause(gpu: int, timeout: float, lease: float) -> None:
    """Stop new GPU work on a GPU until `krex resume` (or until --for runs out)."""
    from krex.control import pause as do_pause
    from krex.shm import Segment

    with Segment.attach() as seg:
        r = do_pause(seg, gpu, timeout, lease)
    click.echo(f"GPU {gpu} paused (holds for {lease:g} s or until `krex resume --gpu {gpu}`)")
    click.echo(f"  waited for in-flight submissions: {_fmt_s(r.inflight.seconds)}")
    click.echo(f"  drained {r.drain.count} process(es):     {_fmt_s(r.drain.seconds)}")


@cli.command()
@click.option("--gpu", type=int, required=True, help="GPU index")
def resume(gpu: int) -> None:
    """Open a paused GPU's gate."""
    from krex.control import resume as do_resume
    from krex.shm import Segment

    with Segment.attach() as seg:
        opened = do_resume(seg, gpu)
    click.echo(f"GPU {gpu} resumed" if opened else f"GPU {gpu} was not paused")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(as_json: bool) -> None:
    """Show gates, slots, processes and counters."""
    from krex.client import Client
    from krex.shm import Segment

    with Segment.attach() as seg:
        snap = seg.snapshot()
    live: dict[str, Any] = {}
    try:  # regions and queues live in the daemon, not in shared memory
        c = Client.connect()
        live = c.request({"op": "status"})
        c.close()
    except KrexError:
        live = {}
    if as_json:
        click.echo(json.dumps({**snap.to_json(), "daemon": live or None}, indent=2))
        return
    hb = "never" if snap.heartbeat_age_s is None else f"{snap.heartbeat_age_s:.1f} s ago"
    click.echo(
        f"segment {snap.name}: {snap.n_gpus} GPU(s), daemon pid {snap.daemon_pid or '-'}, heartbeat {hb}"
    )
    click.echo("GATES")
    for g in snap.gates:
        state = "open" if not g.closed else f"CLOSED by {g.holder}"
        if g.closed and g.owner_slot >= 0:
            state += f" (owner slot {g.owner_slot})"
        if g.lease_left_s is not None:
            state += f", lease {g.lease_left_s:.0f} s left"
        click.echo(f"  gpu {g.gpu}: {state}; closes {g.closes}, fail-opens {g.fail_opens}")
    if live:
        click.echo(f"REGIONS ({len(live['regions'])})")
        for r in live["regions"]:
            state = "granted" if r["granted"] else "entering"
            who = f"slot {r['slot']} pid {r['pid']} tid {r['tid']}"
            click.echo(f"  gpu {r['gpu']}: {who} {state}, {r['age_s']:.3f} s")
        for g, q in live["queues"].items():
            if q:
                click.echo(f"  gpu {g} queue: " + ", ".join(f"slot {e['slot']} (pid {e['pid']})" for e in q))
    else:
        click.echo("REGIONS: no daemon running")
    click.echo(f"SLOTS ({len(snap.slots)})")
    for s in snap.slots:
        click.echo(
            f"  slot {s.slot}: gpu {s.gpu}, guardian pid {s.owner_pid}{'' if s.owner_alive else ' (dead)'}"
        )
    click.echo(f"PROCESSES ({len(snap.procs)})")
    if snap.procs:
        click.echo(
            "  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10} {:>5}  {}".format(
                "pid",
                "slot",
                "gpu",
                "infl",
                "kernels",
                "copies",
                "other",
                "blocked",
                "blocked_ms",
                "fopen",
                "flags",
            )
        )
    for p in snap.procs:
        other = p.submits["memset"] + p.submits["graph"] + p.submits["prefetch"]
        click.echo(
            "  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10.1f} {:>5}  {}".format(
                p.pid,
                p.slot,
                p.gpu,
                p.inflight,
                p.submits["kernel"],
                p.submits["copy"],
                other,
                p.blocked,
                p.blocked_ms,
                p.fail_opens,
                ",".join(p.flags) + ("" if p.alive else " dead"),
            )
        )


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--device", type=DEVICE, default="auto", show_default=True, help="real GPU or the simulated one"
)
@click.option("--gpu", type=int, default=None, help="GPU index (default: the least loaded)")
@click.option(
    "--report",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="write a JSON report: regions, waits, gate blocks, contamination",
)
@click.option(
    "--no-daemon", is_flag=True, help="claim a slot directly in shared memory (no regions, no freezing)"
)
@click.option(
    "--freeze",
    type=click.Choice(["all", "gpu", "adaptive"]),
    default=None,
    help="which siblings this command's regions freeze (default: the daemon's policy)",
)
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run(
    device: str,
    gpu: int | None,
    report: str | None,
    no_daemon: bool,
    freeze: str | None,
    cmd: tuple[str, ...],
) -> None:
    """Run CMD under KREX and exit with its exit status.

    Starts the node daemon if none is running. CMD's whole process tree lives in
    a slot of its own; only its marked regions get the GPU exclusively."""
    from krex.gpus import discover
    from krex.launcher import resolve_command, run_direct, run_guarded

    resolve_command(list(cmd))  # fail on a bad command before touching anything
    info = discover(device)
    kind = "sim" if info.kind == "sim" else "gpu"
    if gpu is not None and not 0 <= gpu < info.count:
        from krex.errors import NotFound

        # Checked here so a refused command never starts a daemon.
        raise NotFound(
            f"unknown GPU {gpu}: this node has {info.count} GPU(s) (0..{info.count - 1})",
            "pick a GPU index from `krex status`",
        )
    if no_daemon:
        sys.exit(run_direct(list(cmd), kind, gpu, info.count))
    res = run_guarded(
        list(cmd), kind, gpu, notify=lambda m: None if quiet() else click.echo(m, err=True), freeze=freeze
    )
    if report:
        with open(report, "w") as f:
            json.dump(res.report, f, indent=2)
    sys.exit(res.exit_status)


@cli.group()
def daemon() -> None:
    """Start, stop or inspect the node daemon (krexd)."""


@daemon.command("start")
@click.option("--device", type=DEVICE, default="auto", show_default=True)
@click.option(
    "--slots-per-gpu",
    type=click.IntRange(1, 64),
    default=None,
    help="admission limit per GPU (default: from the GPU's CPU slice)",
)
@click.option(
    "--max-region",
    type=click.FloatRange(0.001),
    default=None,
    help="seconds after which a region is ended by force  [default: 60, or KREX_MAX_REGION / config file]",
)
@click.option(
    "--idle-exit", type=click.FloatRange(0.1), default=None, help="exit after this many idle seconds"
)
@click.option(
    "--freezer",
    type=click.Choice(["cgroup2", "cgroup1", "signal"]),
    default=None,
    help="force a freezer backend (default: the first that works)",
)
@click.option(
    "--freeze-policy",
    type=click.Choice(["all", "gpu", "adaptive"]),
    default=None,
    help="which siblings a region freezes: all, only those the gate cannot hold (gpu), "
    "or by the region's launch rate (adaptive)  [default: all, or KREX_FREEZE_POLICY / config file]",
)
@click.option("--foreground", is_flag=True, help="run in this process instead of detaching")
def daemon_start(
    device: str,
    slots_per_gpu: int | None,
    max_region: float | None,
    idle_exit: float | None,
    freezer: str | None,
    freeze_policy: str | None,
    foreground: bool,
) -> None:
    """Start krexd (krex run starts it on demand anyway).

    Settings not given here come from the environment (KREX_SLOTS_PER_GPU,
    KREX_MAX_REGION, KREX_IDLE_EXIT, KREX_FREEZER, ...) or the config file
    (KREX_CONFIG, ~/.config/krex/krex.toml, /etc/krex/krex.toml); see docs/operating.md."""
    from krex import paths
    from krex.client import daemon_alive, start_background
    from krex.daemon import config_from
    from krex.daemon import run as run_daemon
    from krex.errors import Busy

    if daemon_alive():
        raise Busy(
            f"a KREX daemon is already running on {paths.socket_path()}",
            "use it, or stop it first with `krex daemon stop`",
        )
    overrides = {
        "slots_per_gpu": slots_per_gpu,
        "max_region_s": max_region,
        "idle_exit_s": idle_exit,
        "freezer": freezer,
        "freeze_policy": freeze_policy,
    }
    cfg = config_from(device, overrides)  # a bad setting fails here, not in a detached daemon
    if foreground:
        run_daemon(cfg)
        return
    extra = ["--max-region", str(max_region)] if max_region is not None else []
    if slots_per_gpu:
        extra += ["--slots-per-gpu", str(slots_per_gpu)]
    if freezer:
        extra += ["--freezer", freezer]
    if freeze_policy:
        extra += ["--freeze-policy", freeze_policy]
    pid = start_background(device, idle_exit, extra)
    click.echo(f"krexd started (pid {pid}, socket {paths.socket_path()})")


@daemon.command("stop")
def daemon_stop() -> None:
    """Stop krexd: regions end, siblings thaw, gates open."""
    import time

    from krex.client import Client, daemon_alive

    c = Client.connect()
    c.request({"op": "shutdown"})
    c.close()
    for _ in range(100):
        if not daemon_alive():
            click.echo("krexd stopped")
            return
        time.sleep(0.05)
    click.echo("krexd is stopping")


@daemon.command("status")
@click.option("--json", "as_json", is_flag=True)
def daemon_status(as_json: bool) -> None:
    """Show the daemon's pid, socket, uptime, freezer and CPU partition."""
    from krex.client import Client

    c = Client.connect()
    st = c.request({"op": "status"})
    c.close()
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    d = st["daemon"]
    click.echo(f"krexd pid {d['pid']}, socket {d['socket']}, up {d['uptime_s']} s")
    click.echo(f"  device {d['device']} x{d['gpus']}, segment {d['shm']}, freezer {d['freezer']}")
    click.echo(
        f"  regions so far {d['regions_done']}, max region {d['max_region_s']} s, "
        f"slots per GPU {st['slots_per_gpu']}"
    )
    if "idle_exit_s" in d:
        idle = "never" if d["idle_exit_s"] is None else f"{d['idle_exit_s']:g} s"
        click.echo(f"  exits when idle for: {idle}; log {d.get('log', '-')}")
    for line in _partition_lines(st["partition"]):
        click.echo("  " + line)


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
    from krex import journal as jr
    from krex import paths

    if fleet:
        from .fleet_cmd import journal_fleet

        journal_fleet(address, node_root, last, as_json)
        return

    recs = jr.read(paths.journal_path(), last)
    if as_json:
        click.echo(json.dumps(recs, indent=2))
        return
    click.echo(
        "{:>8} {:>3} {:>4} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>6}  {}".format(
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
            "end / contamination",
        )
    )
    for r in recs:
        note = r.get("end", "")
        if r.get("contaminated"):
            note += " CONTAMINATED: " + "; ".join(r.get("reasons", []))
        click.echo(
            "{:>8} {:>3} {:>4} {:>8.2f} {:>9.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>9.2f} {:>6}  {}".format(
                r.get("owner_pid", 0),
                r.get("gpu", 0),
                r.get("owner_slot", 0),
                1e3 * r.get("queue_wait_s", 0),
                1e3 * r.get("entry_s", 0),
                1e3 * r.get("drain_s", 0),
                1e3 * r.get("freeze_s", 0),
                1e3 * r.get("pin_s", 0),
                1e3 * r.get("region_s", 0),
                r.get("siblings_frozen", 0),
                note,
            )
        )


register_extra(cli)
register_bench(cli)
register_fleet(cli)


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
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
