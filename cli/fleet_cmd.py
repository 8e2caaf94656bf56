"""`krex fleet` and `krex journal --fleet`: the click layer over krex.fleet.

All output lives here (the library never prints). Errors are KrexError
subclasses, mapped to exit codes by cli/main.py's main(). cli/main.py adds the
command with `register(cli)`."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, TextIO

import click

from .commands_extra import _cancel_on_signals
from .progress import Progress, bar, fmt_s, short

__all__ = ["fleet", "journal_fleet", "register"]


def register(cli_group: click.Group) -> None:
    cli_group.add_command(fleet)


def _node(nid: str | None) -> str:
    return (nid or "?")[:12]


class _FleetProgress:
    """A live status line on a terminal; plain lines (one per finished or lost command) otherwise."""

    def __init__(self, stream: TextIO, tty: bool) -> None:
        self.out = Progress(stream, tty)

    def __call__(self, ev: Any) -> None:  # ev: krex.fleet.FleetEvent
        res = ev.result
        if ev.kind == "lost" and ev.lost is not None:
            self.out.line(f"krex fleet: #{ev.command.index} lost with node {_node(ev.node_id)} "
                          f"({ev.lost['error']}, attempt {ev.lost['attempt']}): it runs again elsewhere")
        elif ev.kind == "done" and res is not None:
            where = f"on {_node(ev.node_id)}" if ev.node_id else "(no node)"
            if not self.out.tty:
                state = "ok  " if res.ok else "FAIL"
                self.out.line(f"krex fleet: [{ev.done}/{ev.total}] {state} #{res.command.index} exit "
                              f"{res.exit_status} {where} in {fmt_s(res.wall_s)}: "
                              f"{short(res.command.display)}")
            elif not res.ok:
                self.out.line(f"#{res.command.index} failed (exit {res.exit_status}) {where}: "
                              f"{short(res.command.display)}")
        nodes = " ".join(f"{_node(n)[:6]}:{c}" for n, c in sorted(ev.per_node.items()))
        self.out.status(
            f"krex fleet {bar(ev.done, ev.total)} {ev.done}/{ev.total} done, {ev.in_flight} in flight, "
            f"{ev.failed} failed, {ev.reruns} rerun; {ev.nodes_alive} node(s), {ev.slots} slots; "
            f"{ev.elapsed_s:.1f} s" + (f" | {nodes}" if nodes else "")
            + (" - stopping" if ev.cancelling else "")
        )

    def close(self) -> None:
        self.out.close(keep=True)


def _summary_lines(data: dict[str, Any]) -> list[str]:
    share = data.get("region_share")
    share_txt = "-" if share is None else f"{100 * share:.1f}%"
    waits, adm, disp = data["region_waits"], data["admission_waits"], data["dispatch_s"]
    tp = data.get("throughput_per_min")
    lines = [
        f"{data['commands']} commands: {data['succeeded']} ok, {data['failures']} failed"
        + (f", {len(data['not_run'])} not run" if data["not_run"] else "")
        + f" in {fmt_s(data['total_wall_s'])} ({'-' if tp is None else f'{tp:.1f}'} commands/min) on "
        f"{len(data['nodes'])} node(s), {data['jobs']} slots, device {data['device']}",
        f"regions: {data['regions']}, {fmt_s(data['region_s'])} in regions = {share_txt} of command wall "
        f"time; contaminated regions: {data['contaminated_regions']}",
        f"region waits: total {fmt_s(waits['total_s'])}, p50 {fmt_s(waits['p50_s'])}, "
        f"p95 {fmt_s(waits['p95_s'])}; admission waits: total {fmt_s(adm['total_s'])}; "
        f"gate blocks: {data['gate_blocks']}, fail-opens: {data['fail_opens']}",
        f"Ray dispatch per command (round trip - command wall): p50 {fmt_s(disp['p50_s'])}, "
        f"p95 {fmt_s(disp['p95_s'])}; re-runs after lost nodes: {data['reruns']}",
        "{:<12} {:>15} {:>4} {:>5} {:>5} {:>5} {:>7} {:>6} {:>10} {:>10} {:>5}  {}".format(
            "node", "ip", "gpus", "slots", "cmds", "fail", "regions", "contam", "wait_p95", "adm_total",
            "lost", "state"),
    ]
    for n in data["nodes"]:
        lines.append("{:<12} {:>15} {:>4} {:>5} {:>5} {:>5} {:>7} {:>6} {:>10} {:>10} {:>5}  {}".format(
            _node(n["node_id"]), str(n.get("ip") or "-")[:15], str(n.get("gpus") if n.get("gpus") is not None
                                                                 else "-"),
            str(n.get("slots") if n.get("slots") is not None else "-"), n["commands"], n["failures"],
            n["regions"], n["contaminated_regions"], fmt_s(n["region_waits"]["p95_s"]),
            fmt_s(n["admission_waits"]["total_s"]), n["lost_attempts"],
            n["state"] + (f" (journal: {n['journal_error']})" if n.get("journal_error") else "")))
    if data.get("partition_degraded"):
        lines.append("note: the CPU partition is degraded on some node (cores are shared); see `krex doctor`")
    for c in data.get("contaminated", []):
        lines.append(f"CONTAMINATED region of #{c['index']}: {'; '.join(c['reasons'])}")
    if data.get("gave_up"):
        lines.append(f"gave up: {data['gave_up']}")
    lines.append(f"results: {data['dir']}/ (summary.json, journal.jsonl; cmd-N.json, .stdout, .stderr "
                 "(output tails) per command)")
    for f in data["failed"]:
        lines.append(f"failed: #{f['index']} exit {f['exit_status']}: {short(f['command'])}")
        if f.get("error"):
            lines.append(f"        {short(f['error'], 160)}")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", metavar="[FILE]", required=False)
@click.option("--address", default=None, metavar="ADDR",
              help="Ray cluster to use (host:port of the head, or 'auto'); default: start a local one-node "
                   "Ray cluster with this machine's KREX slots")
@click.option("--device", default="auto", show_default=True, metavar="[auto|gpu|sim]",
              help="passed to every `krex run` on the nodes")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="directory for the results (default: ./krex-fleet-<timestamp>/; must be new or empty)")
@click.option("--corpus", default=None, metavar="MANIFEST",
              help="run a `krex bench` corpus instead of FILE ('default': examples/workloads/manifest.py); "
                   "its scripts must exist at the same path on every node")
@click.option("--quick", is_flag=True, help="with --corpus: only its quick subset")
@click.option("--only", multiple=True, metavar="NAME", help="with --corpus: only names containing NAME")
@click.option("--slots-per-gpu", type=click.IntRange(1, 64), default=None,
              help="local cluster only: KREX slots per GPU (default: krexd's, from the GPU's CPU slice)")
@click.option("--node-root", type=click.Path(file_okay=False), default=None,
              help="give every Ray node a KREX world of its own under DIR/<node id> (several Ray nodes on "
                   "one host: tests, demos); default: each node's own KREX defaults")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=3, show_default=True,
              help="a command lost with its node runs again elsewhere, up to this many attempts")
@click.option("--cwd", default=None, metavar="DIR",
              help="working directory of the commands on the nodes (default: this one)")
@click.option("--node-resources", is_flag=True,
              help="print this machine's Ray resources for `ray start --resources` and exit")
def fleet(file: str | None, address: str | None, device: str, out_dir: str | None, corpus: str | None,
          quick: bool, only: tuple[str, ...], slots_per_gpu: int | None, node_root: str | None,
          max_attempts: int, cwd: str | None, node_resources: bool) -> None:
    """Run every command of FILE (or a corpus) over a Ray cluster, each under KREX on its node.

    FILE is a `krex batch` file: one shell command per line, or a JSON list of
    argv lists; `-` reads standard input. Each command is a Ray task that asks
    for one `krex_slot` (the resource every KREX node offers: slots per GPU x
    GPUs) and runs under `krex run --report` on its node, where the node's daemon
    (started on demand) picks the GPU. Results come back to --out: cmd-N.json
    per command, output tails, journal.jsonl (every node's regions) and
    summary.json with one row per node. A command whose node is lost runs
    again elsewhere. Exits 1 if any command failed, 130 if interrupted.

    Needs Ray: pip install 'krex-gpu[fleet]'."""
    from krex.batch import check_args, load_commands
    from krex.errors import UsageError
    from krex.fleet import FleetConfig, FleetFailed, corpus_commands, import_ray, run_fleet
    from krex.fleet import node_resources as node_res

    check_args(1, device)
    if node_resources:
        res, gpus = node_res(device, slots_per_gpu)
        click.echo(json.dumps({k: int(v) for k, v in res.items()}))
        click.echo(f"# {gpus} GPU(s): ray start ... --num-gpus {gpus} --resources "
                   f"'{json.dumps({k: int(v) for k, v in res.items()})}'", err=True)
        return
    if (file is None) == (corpus is None):
        raise UsageError("give either a batch FILE or --corpus MANIFEST",
                         "e.g. krex fleet cmds.txt --address HEAD:6379, or krex fleet --corpus default")
    if slots_per_gpu is not None and address:
        raise UsageError("--slots-per-gpu only applies to the local cluster",
                         "a cluster's slots are what its nodes offer (`krex fleet --node-resources` on each)")
    import_ray()  # say how to install it before reading anything
    commands = (load_commands(file) if file is not None
                else corpus_commands(None if corpus == "default" else corpus, device, quick, only))
    cfg = FleetConfig(address=address, device=device, node_root=node_root, slots_per_gpu=slots_per_gpu,
                      max_attempts=max_attempts, cwd=cwd)
    tty = sys.stderr.isatty()
    where = address or "a local Ray cluster"
    click.echo(f"krex fleet: {len(commands)} command(s) on {where}, device {device}", err=True)
    view = _FleetProgress(sys.stderr, tty)
    cancel = threading.Event()
    try:
        with _cancel_on_signals(cancel):
            summary = run_fleet(commands, cfg, out_dir=out_dir, progress=view, cancel=cancel)
    finally:
        view.close()
    for line in _summary_lines(summary.data):
        click.echo(line)
    n = len(commands)
    if summary.interrupted and not summary.data.get("gave_up"):
        click.echo(f"krex: fleet run interrupted: {len(summary.data['not_run'])} of {n} command(s) not run, "
                   f"{summary.failures} failed; results so far in {summary.out_dir}", err=True)
        sys.exit(130)
    if summary.failures or summary.data["not_run"]:
        bad = summary.failures + len(summary.data["not_run"])
        raise FleetFailed(f"{bad} of {n} command(s) failed or did not run"
                          + (f" ({summary.data['gave_up']})" if summary.data.get("gave_up") else ""),
                          f"see {summary.out_dir}/summary.json and each failed command's cmd-N.json")


def journal_fleet(address: str | None, node_root: str | None, last: int, as_json: bool) -> None:
    """`krex journal --fleet`: every KREX node's recent regions, with a node column."""
    from krex.fleet import gather_journals

    js = gather_journals(address, node_root, last)
    if as_json:
        click.echo(json.dumps([{"node_id": j.node_id, "ip": j.ip, "host": j.host, "error": j.error,
                                "records": j.records} for j in js], indent=2))
        return
    from krex.node.journal import one_line, when

    row = "{:<12} {:>15} {:<14} {:>8} {:>3} {:>4} {:>8} {:>9} {:>9} {:>6}  {:<11} {:<16} {}"
    click.echo(row.format("node", "ip", "time", "pid", "gpu", "slot", "wait_ms", "entry_ms", "region_ms",
                          "frozen", "end", "label", "command"))
    for j in js:
        if j.error:
            click.echo(f"{_node(j.node_id):<12} {str(j.ip or '-')[:15]:>15}  unreachable: {j.error}")
        for r in j.records:
            ms = (f"{1e3 * (r.get(k) or 0):.2f}" for k in ("queue_wait_s", "entry_s", "region_s"))
            click.echo(row.format(
                _node(j.node_id), str(j.ip or "-")[:15], when(r), r.get("owner_pid", 0), r.get("gpu", 0),
                r.get("owner_slot", 0), *ms, r.get("siblings_frozen", 0), str(r.get("end", "")),
                one_line(r.get("label")) or "-", one_line(r.get("cmd")) or "-"))
            if r.get("contaminated"):
                click.echo(f"{'':<12} CONTAMINATED: " + "; ".join(r.get("reasons", [])))
    total = sum(len(j.records) for j in js)
    click.echo(f"{total} region(s) from {len(js)} node(s)", err=True)
