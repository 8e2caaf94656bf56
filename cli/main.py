"""The `krex` command: a thin click layer over the krex library.

All output and every exit status live here; errors from the library are
KrexError subclasses, mapped to exit codes in one place (`main`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from krex import __version__
from krex.errors import KrexError

DEVICE = click.Choice(["auto", "gpu", "sim"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="krex")
def cli() -> None:
    """KREX: share one GPU among many kernel benchmarks; keep their timings exclusive."""


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


@cli.command()
@click.option("--device", type=DEVICE, default="auto", show_default=True,
              help="sim: also point LD_LIBRARY_PATH at the simulated GPU libraries")
@click.option("--export", "export", is_flag=True, help="print `export` lines for eval")
def env(device: str, export: bool) -> None:
    """Print the variables that opt a process into KREX."""
    from krex.envvars import format_env, opt_in_env
    from krex.gpus import discover
    from krex.shm import default_name

    kind = "sim" if device == "sim" else discover(device).kind
    click.echo(format_env(opt_in_env("sim" if kind == "sim" else "gpu", default_name()), export))


@cli.command("include-dir")
def include_dir() -> None:
    """Print the directory holding krex.h (the C/C++ region markers)."""
    from krex.native import include_dir as inc

    click.echo(str(inc()))


@cli.command()
@click.option("--gpu", type=int, required=True, help="GPU index")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="seconds to wait for in-flight work and drain acks")
@click.option("--for", "lease", type=float, default=600.0, show_default=True,
              help="seconds the pause holds before it lapses by itself")
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
    from krex.shm import Segment

    with Segment.attach() as seg:
        snap = seg.snapshot()
    if as_json:
        click.echo(json.dumps(snap.to_json(), indent=2))
        return
    hb = "never" if snap.heartbeat_age_s is None else f"{snap.heartbeat_age_s:.1f} s ago"
    click.echo(f"segment {snap.name}: {snap.n_gpus} GPU(s), daemon pid {snap.daemon_pid or '-'}, heartbeat {hb}")
    click.echo("GATES")
    for g in snap.gates:
        state = "open" if not g.closed else f"CLOSED by {g.holder}"
        if g.closed and g.owner_slot >= 0:
            state += f" (owner slot {g.owner_slot})"
        if g.lease_left_s is not None:
            state += f", lease {g.lease_left_s:.0f} s left"
        click.echo(f"  gpu {g.gpu}: {state}; closes {g.closes}, fail-opens {g.fail_opens}")
    click.echo(f"SLOTS ({len(snap.slots)})")
    for s in snap.slots:
        click.echo(f"  slot {s.slot}: gpu {s.gpu}, guardian pid {s.owner_pid}{'' if s.owner_alive else ' (dead)'}")
    click.echo(f"PROCESSES ({len(snap.procs)})")
    if snap.procs:
        click.echo("  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10} {:>5}  {}".format(
            "pid", "slot", "gpu", "infl", "kernels", "copies", "other", "blocked", "blocked_ms", "fopen", "flags"))
    for p in snap.procs:
        other = p.submits["memset"] + p.submits["graph"] + p.submits["prefetch"]
        click.echo("  {:>8} {:>4} {:>3} {:>5} {:>9} {:>7} {:>7} {:>8} {:>10.1f} {:>5}  {}".format(
            p.pid, p.slot, p.gpu, p.inflight, p.submits["kernel"], p.submits["copy"], other, p.blocked,
            p.blocked_ms, p.fail_opens, ",".join(p.flags) + ("" if p.alive else " dead")))


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--device", type=DEVICE, default="auto", show_default=True, help="real GPU or the simulated one")
@click.option("--gpu", type=int, default=None, help="GPU index (default: the least loaded)")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run(device: str, gpu: int | None, cmd: tuple[str, ...]) -> None:
    """Run CMD under KREX and exit with its exit status."""
    from krex.gpus import discover
    from krex.launcher import run_direct

    info = discover(device)
    rc = run_direct(list(cmd), "sim" if info.kind == "sim" else "gpu", gpu, info.count)
    sys.exit(rc)


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
