"""`krex fleet`: run a batch file or a corpus over a Ray cluster, with KREX on every node.

How KREX maps onto Ray (docs/fleet.md has the operator's side):

* **Slots are a Ray resource.** A node that runs KREX commands offers the custom
  resource ``krex_slot`` (`RESOURCE`) = its KREX slots: slots per GPU x GPUs
  (`node_resources` computes it; ``krex fleet --node-resources`` prints it for
  ``ray start --resources``). Each command is one Ray task that asks for one
  ``krex_slot`` and no CPU (the CPU partition is KREX's business), so Ray never
  places more commands on a node than it has slots.
* **Per-GPU placement is the node daemon's.** The task does not pick a GPU: the
  node's krexd admits each `krex run` to the least loaded GPU and never more than
  slots-per-gpu on one (the daemon is started with slots-per-gpu = the node's
  ``krex_slot`` / its GPUs).
* **One daemon per node, started on demand.** The first guardian on a node that
  finds no daemon answering starts it (krex.proc.client.start_background with
  ``--slots-per-gpu S --idle-exit T``); it exits by itself after T idle seconds.
* **Each command runs under a `krex run` guardian with a report on its node**
  (krex.runner: ``python -m krex.proc.launcher``, never the CLI); the task is the
  guardian's parent and returns exit status, result line (the last non-empty
  stdout line, parsed when it is a JSON object), the report and the output tails.
  The guardian dies with the task (PR_SET_PDEATHSIG): a lost worker or a cancelled
  task takes its command with it, the guardian's own exit thaws and releases it.
* **A lost node.** Ray fails the node's tasks (NodeDiedError, WorkerCrashedError,
  ...); the driver submits them again, up to `FleetConfig.max_attempts` attempts,
  and Ray only places them on live nodes. A lost attempt returns nothing, so it is
  never counted; the final attempt is the command's one result. Every node has its
  own daemon, gates and cgroups, so nothing on the survivors depends on the lost one.
* **A KREX world per node.** By default a node uses its own default KREX paths and
  segment (one Ray node per machine). With `FleetConfig.node_root`, every Ray node
  gets its own world under ``node_root/<node id>``, keyed by the Ray node id (never
  the host name): several Ray nodes on one host (tests, demos) then never share a
  daemon, segment, simulated GPU or trace (`node_world`).

The library never prints: progress goes to the `progress` callback as `FleetEvent`s.
Ray is an optional dependency (``pip install 'krex-gpu[fleet]'``); `import_ray` says so."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from krex import paths, runner
from krex.batch import (
    BatchCommand,
    BatchSummary,
    CommandResult,
    _dist,
    _num,
    _prepare_dir,
    check_args,
    summarize,
)
from krex.batch import (
    default_out_dir as _default_out_dir,
)
from krex.errors import KrexError, NotFound, UsageError
from krex.native import lib
from krex.runner import Spec, guardian_argv, run_one

__all__ = [
    "PYTHON",
    "RESOURCE",
    "FleetConfig",
    "FleetEvent",
    "FleetFailed",
    "FleetSummary",
    "NodeJournal",
    "corpus_commands",
    "default_out_dir",
    "fleet_summary",
    "gather_journals",
    "import_ray",
    "node_resources",
    "node_world",
    "run_fleet",
]

RESOURCE = "krex_slot"
PYTHON = "{python}"  # argv placeholder for the node's own Python (corpus commands)
INSTALL_FIX = ("install Ray beside KREX on the driver and every node: pip install 'krex-gpu[fleet]' "
               "(or pip install ray)")
TAIL_BYTES = 64 * 1024
GRACE_S = runner.GRACE_S  # after a cancel: how long running commands get before their tasks are killed
# How long the driver tries to reach a Ray cluster's GCS before it gives up and says why (Ray's
# own connect retries ran for minutes without a word).
CONNECT_TIMEOUT_S = 10.0
CONNECT_FIX = ("start the head with `ray start --head` (it prints the address to give), check the host "
               "and port (`ray status` on a cluster node shows them), or leave --address out to start "
               "a local one-node cluster")
NODES_REFRESH_S = 2.0
# A node whose attempts were lost without a NodeDiedError naming it (a worker crash first)
# may be dead while the GCS still lists it: its health checks notice within seconds. At the
# end the summary waits up to this long for the GCS to say, not to call a dead node alive.
LOST_CONFIRM_S = 30.0
# Set by Ray in every worker; a command under `krex batch` would not have them
# (OMP_NUM_THREADS=1 would change a CPU-threaded benchmark).
# RAY_AUTH_TOKEN: the cluster's secret (token authentication), never a benchmark's business.
RAY_WORKER_VARS = ("RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_LD_PRELOAD_ON_WORKERS", "SPT_NOENV",
                   "PYTHONBREAKPOINT", "OMP_NUM_THREADS", "RAY_AUTH_TOKEN")
# A node's KREX variables that a fleet world replaces (or that must not leak into a command).
WORLD_VARS = ("KREX_STATE_DIR", "KREX_SOCKET", "KREX_JOURNAL", "KREX_SHM", "KREX_SIM_SHM", "KREX_SIM_TRACE",
              "KREX_SLOT", "KREX_GPU", "KREX_THROWAWAY")
# Ray errors that mean "the attempt was lost with its node or worker", not "the command failed".
LOST_ERRORS = ("NodeDiedError", "WorkerCrashedError", "LocalRayletDiedError", "RaySystemError",
               "ObjectLostError", "OwnerDiedError", "ObjectFetchTimedOutError",
               "ObjectReconstructionFailedError")


class FleetFailed(KrexError):
    """Some commands of a fleet run exited non-zero or were never run (everything was still written)."""

    exit_code = 1


def import_ray() -> Any:
    """The `ray` module, or NotFound that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise NotFound(f"krex fleet needs Ray, which is not installed here ({e})", INSTALL_FIX) from None
    return ray


# ------------------------------------------------------------------------------- node worlds


def node_world(node_id: str, node_root: str | Path | None) -> dict[str, str]:
    """The KREX variables of one Ray node's world: {} for the node's defaults, else a
    state directory, segment, simulated GPU and trace of its own under node_root,
    keyed by the Ray node id. Pure: tests compute the same world from the node id."""
    if node_root is None:
        return {}
    if not re.fullmatch(r"[0-9a-fA-F]{8,}", node_id):
        raise UsageError(f"{node_id!r} is not a Ray node id", "pass the hex id from ray.nodes()")
    root = Path(node_root).absolute()
    d = root / node_id[:12]
    tag = hashlib.sha1(f"{root}\0{node_id}".encode()).hexdigest()[:12]
    sock = d / paths.SOCKET_NAME
    if len(str(sock).encode()) > 100:
        raise UsageError(f"--node-root {root} is too long for a Unix socket path ({sock})",
                         "use a short directory, e.g. one made by mktemp -d /tmp/kx-XXXX")
    # Throwaway: its daemon's clean stop (idle exit) removes its segments from /dev/shm.
    return {"KREX_STATE_DIR": str(d), "KREX_SHM": f"/krex-fl-{tag}", "KREX_SIM_SHM": f"/krex-flsim-{tag}",
            "KREX_SIM_TRACE": str(d / "trace.jsonl"), "KREX_THROWAWAY": "1"}


def node_resources(device: str = "auto", slots_per_gpu: int | None = None) -> tuple[dict[str, float], int]:
    """({RESOURCE: slots}, GPUs) for this machine: what `ray start --resources` should offer.
    Slots per GPU default to krexd's own default (the physical cores of the GPU's CPU slice)."""
    from krex.device.gpus import discover
    from krex.node import cpus

    check_args(1, device)
    if slots_per_gpu is not None and not 1 <= slots_per_gpu <= 64:
        raise UsageError(f"--slots-per-gpu {slots_per_gpu}: out of range", "give 1..64")
    info = discover(device)
    if slots_per_gpu is not None:
        total = slots_per_gpu * info.count
    else:
        part = cpus.partition(cpus.discover(), info.count, info.numa or None)
        total = sum(cpus.default_slots_per_gpu(part, g) for g in range(info.count))
    return {RESOURCE: float(total)}, info.count


def _worker_env(world: dict[str, str], sim_gpus: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RAY_WORKER_VARS and k != "LD_PRELOAD"}
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        # Older Ray versions hide every GPU from tasks that asked for none; KREX's daemon
        # assigns GPUs itself (krex run sets CUDA_VISIBLE_DEVICES per command).
        del env["CUDA_VISIBLE_DEVICES"]
    if world:
        for k in WORLD_VARS:
            env.pop(k, None)
        env.update(world)
        if sim_gpus is not None:
            env["KREX_SIM_GPUS"] = str(sim_gpus)
    elif sim_gpus is not None:
        env.setdefault("KREX_SIM_GPUS", str(sim_gpus))
    for k in ("KREX_SLOT", "KREX_GPU"):
        env.pop(k, None)
    return env


# ------------------------------------------------------------------------------ on the node

_NODE_INFO: dict[str, tuple[float, int]] = {}  # node id -> (slots, gpus), cached per worker process


def _this_node(ray: Any, node_id: str) -> tuple[float, int]:
    """(krex slots, Ray GPUs) of this node, from the cluster's node table (one GCS call per worker)."""
    if node_id not in _NODE_INFO:
        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                res = n.get("Resources") or {}
                _NODE_INFO[node_id] = (float(res.get(RESOURCE, 0.0)), int(res.get("GPU", 0) or 0))
                break
        else:
            _NODE_INFO[node_id] = (0.0, 0)
    return _NODE_INFO[node_id]


def _die_with_parent() -> Callable[[], None]:
    """preexec_fn: the guardian gets SIGTERM when the task's thread goes (a lost worker,
    a killed task). prctl is resolved before the fork, so the child only calls it.
    Ray runs tasks with SIGINT blocked, and a blocked mask survives exec: unblock
    everything, or neither a cancel's SIGINT nor the guardian's forwarding would work."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def apply() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent went before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return apply


def _raylet_gone() -> bool:
    """True if this worker's raylet (RAY_RAYLET_PID, set by Ray in every worker) has died."""
    import psutil

    try:
        pid = int(os.environ.get("RAY_RAYLET_PID", ""))
    except ValueError:
        return False
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _tail(path: Path, n: int) -> tuple[str, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            data = f.read()
    except OSError:
        return "", 0
    return data.decode(errors="replace"), size


def _result_line(stdout_tail: str) -> tuple[str | None, Any]:
    for line in reversed(stdout_tail.splitlines()):
        line = line.strip()
        if line:
            parsed: Any = None
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    parsed = json.loads(line)
            return line, parsed if isinstance(parsed, dict) else None
    return None, None


def _node_ip(ray: Any) -> str:
    util: Any = ray.util  # untyped in Ray
    return str(util.get_node_ip_address())


def run_on_node(payload: dict[str, Any]) -> dict[str, Any]:
    """The body of one command's Ray task (runs on the node Ray chose)."""
    import ray

    t0, started_at = time.monotonic(), time.time()
    node_id = ray.get_runtime_context().get_node_id()
    out: dict[str, Any] = {"index": payload["index"], "attempt": payload["attempt"], "node_id": node_id,
                           "host": socket.gethostname(), "node_ip": _node_ip(ray),
                           "started_at": started_at, "pid": os.getpid()}
    world = node_world(node_id, payload.get("node_root"))
    slots, gpus = _this_node(ray, node_id)
    device = str(payload["device"])
    sim_gpus = max(1, gpus) if device == "sim" or world else None
    env = _worker_env(world, sim_gpus)
    out["krex_shm"] = env.get("KREX_SHM")
    work = Path(tempfile.mkdtemp(prefix="krex-fleet-"))
    try:
        argv = [sys.executable if a == PYTHON else str(a) for a in payload["argv"]]
        report = work / "report.json"
        so, se = work / "stdout", work / "stderr"
        # The guardian starts the node's daemon when none answers (slots per GPU = the node's
        # krex_slot / its GPUs, exiting after idle_exit_s), through the library's one start path.
        per_gpu = max(1, min(64, math.ceil(slots / max(1, gpus)))) if slots >= 1 else None
        cmd = guardian_argv(argv, report, device, daemon_slots_per_gpu=per_gpu,
                            daemon_idle_exit_s=float(payload["idle_exit_s"]))
        cwd = payload.get("cwd")
        if cwd and not os.path.isdir(cwd):
            raise NotFound(f"the working directory {cwd} does not exist on node {node_id[:12]}",
                           "give --cwd a directory that every node has (or a shared filesystem)")
        out["setup_s"] = round(time.monotonic() - t0, 6)
        # ray.cancel(force=False) raises KeyboardInterrupt here: run_one stops the command like Ctrl-C.
        got = run_one(Spec(cmd, so, se, env, cwd, report=report, preexec_fn=_die_with_parent()),
                      interrupt_grace_s=GRACE_S)
        if got.start_error:
            raise KrexError(got.start_error, "check the node's Python and its krex installation")
        if got.cancelled:
            out["cancelled"] = True
        rc = got.returncode if got.returncode is not None else 127
        out["exit_status"] = got.exit_status
        if _raylet_gone():
            # The node is going down under us (Ray kills a dying worker's children): whatever the
            # command's status says, this attempt was cut short by the node, not by the command.
            out["lost"] = f"the node's raylet died while the command ran (exit {out['exit_status']})"
        elif rc < 0 and not out.get("cancelled"):
            # The guardian passes its command's status on (128+N for a signal), so a guardian
            # that itself died of a signal was killed from outside (the OOM killer, a node going
            # down). The attempt is lost, not failed.
            out["lost"] = f"the krex run guardian was killed by signal {-rc}"
        out["wall_s"] = round(got.wall_s, 6)
        out["report"] = got.report
        out["daemon_started"] = bool((got.report or {}).get("daemon_started"))
        if got.error:
            out["error"] = got.error
        n = int(payload.get("tail_bytes") or TAIL_BYTES)
        out["stdout_tail"], out["stdout_bytes"] = _tail(so, n)
        out["stderr_tail"], out["stderr_bytes"] = _tail(se, n)
        out["result_line"], out["result"] = _result_line(out["stdout_tail"])
    except KrexError as e:  # the node could not run it (no daemon, no cwd): a failed command, not a lost one
        out.update(exit_status=out.get("exit_status", 1), wall_s=out.get("wall_s", 0.0), report=None,
                   error=f"{e} (fix: {e.fix})" if e.fix else str(e))
        out.setdefault("stdout_tail", "")
        out.setdefault("stderr_tail", "")
        out.setdefault("result_line", None)
        out.setdefault("result", None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["ended_at"] = time.time()
    return out


def node_journal(node_root: str | None, since: float | None, last: int | None) -> dict[str, Any]:
    """The body of a journal-gathering task pinned to one node: that node's regions."""
    import ray

    from krex import paths
    from krex.node import journal

    node_id = ray.get_runtime_context().get_node_id()
    world = node_world(node_id, node_root)
    path = Path(world["KREX_STATE_DIR"]) / paths.JOURNAL_NAME if world else paths.journal_path()
    out: dict[str, Any] = {"node_id": node_id, "host": socket.gethostname(),
                           "node_ip": _node_ip(ray), "journal": str(path)}
    try:
        recs = journal.read(path, None if since is not None else last)
    except NotFound:
        recs = []
    if since is not None:
        recs = [r for r in recs if _num(r.get("ts")) >= since]
    out["records"] = recs[-last:] if last else recs
    return out


# ------------------------------------------------------------------------------- the driver


class LostAttempt(TypedDict):
    """An attempt lost with its node or worker (summary.json's and a command's lost_attempts)."""

    index: int
    attempt: int
    node_id: str | None
    error: str  # the Ray error's name, or GuardianKilled
    message: str


class NodeInfo(TypedDict):
    """A live Ray node that offers krex_slot."""

    ip: str | None
    host: str | None
    slots: int
    gpus: int


@dataclass
class FleetConfig:
    address: str | None = None  # Ray address; None: start a local one-node Ray cluster
    device: str = "auto"  # passed to every `krex run` (and used for the local cluster's slots)
    node_root: str | None = None  # a KREX world per Ray node under this directory (see node_world)
    slots_per_gpu: int | None = None  # local cluster only: its krex_slot = this x GPUs
    max_attempts: int = 3  # a command lost with its node runs again, up to this many attempts in all
    idle_exit_s: float = lib.KREX_ON_DEMAND_IDLE_EXIT_MS / 1e3  # daemons the fleet starts exit when idle
    cwd: str | None = None  # where commands run on the nodes (default: the driver's cwd)
    tail_bytes: int = TAIL_BYTES
    wait_nodes_s: float = 60.0  # give up when no live node offers krex_slot for this long


@dataclass
class FleetEvent:
    """Progress: `kind` "submit", "done" (`result` set), "lost" (an attempt lost with its node;
    `lost` set), "tick" (about every TICK_S s)."""

    kind: Literal["submit", "done", "lost", "tick"]
    total: int
    done: int
    in_flight: int
    failed: int
    reruns: int
    elapsed_s: float
    nodes_alive: int
    slots: int
    per_node: dict[str, int]  # node id -> commands finished there
    command: BatchCommand | None = None
    result: CommandResult | None = None
    node_id: str | None = None
    lost: LostAttempt | None = None
    cancelling: bool = False


class FleetSummary(BatchSummary):
    """A fleet run's results: `krex batch`'s shape, with per-node rows in ``data``."""


@dataclass
class _Attempt:
    cmd: BatchCommand
    attempt: int
    submitted: float  # monotonic, on the driver
    lost: list[LostAttempt] = field(default_factory=list)


def default_out_dir(now: float | None = None, base: Path | None = None) -> Path:
    return _default_out_dir(now, base, prefix="krex-fleet")


def corpus_commands(manifest: str | None, device: str, quick: bool = False,
                    only: Sequence[str] = ()) -> list[BatchCommand]:
    """The `krex bench` corpus as fleet commands (its scripts must exist at the same path on every
    node); PYTHON stands for the node's Python. device "sim" picks the simulated corpus, else GPU."""
    from krex.bench import load_corpus

    dev = "sim" if device == "sim" else "gpu"
    wl = load_corpus(Path(manifest) if manifest else None, dev, quick, only)
    if not wl:
        raise UsageError(f"the corpus has no {dev} command{' matching --only' if only else ''}",
                         "check --corpus, --quick and --only")
    # A workload's own variables (e.g. KREX_AUTO_REGION) go through env(1), like a shell line would.
    return [BatchCommand(i, [*(["env", *(f"{k}={v}" for k, v in w.env)] if w.env else []), *w.argv(PYTHON)])
            for i, w in enumerate(wl, 1)]


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise NotFound, naming the address and the fix, unless something accepts connections at
    the GCS address `address` stands for (host:port; 'auto': the cluster this machine last
    joined) within `timeout_s`. 'local' and Ray client addresses (ray://) are Ray's to check."""
    if address == "local" or address.startswith("ray://"):
        return
    try:
        from ray._private.services import canonicalize_bootstrap_address  # Ray's own resolution

        resolved = canonicalize_bootstrap_address(address)
    except ImportError:
        resolved = address if address != "auto" else None
    except Exception as e:  # noqa: BLE001 - a malformed address, an unreadable address file
        raise NotFound(f"cannot reach the Ray cluster at {address}: {e}", CONNECT_FIX) from None
    if resolved is None:
        raise NotFound(f"cannot reach the Ray cluster at {address}: no running Ray cluster was found "
                       "on this machine", CONNECT_FIX)
    host, _, port = resolved.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address}: not host:port", "give e.g. --address 10.0.0.5:6379")
    deadline = time.monotonic() + timeout_s
    why = "no answer"
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(
                    2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        if time.monotonic() + 0.5 >= deadline:
            break
        time.sleep(0.5)
    via = f" ({resolved})" if resolved != address else ""
    raise NotFound(f"cannot reach the Ray cluster at {address}{via}: {why}, for {timeout_s:g} s",
                   CONNECT_FIX)


def check_node_root(node_root: str | Path, create: bool) -> None:
    """--node-root: a directory (made if `create`, for a fleet run; an existing one for the
    journals of a fleet that ran with it), else a UsageError naming it and why."""
    root = Path(node_root)
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(
                f"--node-root {node_root}: cannot make the directory ({e.strerror})",
                "give a directory you may write, e.g. one made by mktemp -d /tmp/kx-XXXX",
            ) from None
    if not root.is_dir():
        raise UsageError(f"--node-root {node_root} is not a directory",
                         "give the --node-root the fleet ran with (it holds one KREX world per node)")


def _connect(ray: Any, address: str | None, local_resources: tuple[dict[str, float], int] | None) -> bool:
    """Connect to Ray. Returns True if we did (and must disconnect)."""
    import logging

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "krex"}
    if address:
        check_reachable(address)
    try:
        if address:
            ray.init(address=address, **kw)
        else:
            assert local_resources is not None
            res, gpus = local_resources
            # "local": a new instance even where a cluster runs (ray.init() alone would join it)
            ray.init(address="local", num_gpus=gpus, resources=res, include_dashboard=False,
                     object_store_memory=256 * 1024 * 1024, **kw)
    except ConnectionError as e:
        raise NotFound(f"no Ray cluster at {address or 'a new local instance'}: {e}",
                       "check --address (host:port of the head's GCS, or 'auto' on a cluster node)") from None
    return True


def _alive_nodes(ray: Any, dead: set[str] | frozenset[str] = frozenset()) -> dict[str, NodeInfo]:
    out: dict[str, NodeInfo] = {}
    for n in ray.nodes():
        res = n.get("Resources") or {}
        if n.get("Alive") and res.get(RESOURCE, 0) >= 1 and n["NodeID"] not in dead:
            out[str(n["NodeID"])] = {"ip": n.get("NodeManagerAddress"), "host": n.get("NodeManagerHostname"),
                                     "slots": int(res.get(RESOURCE, 0)), "gpus": int(res.get("GPU", 0) or 0)}
    return out


def _final_nodes(ray: Any, dead: set[str], lost_log: Sequence[LostAttempt]) -> dict[str, NodeInfo]:
    """The nodes alive at the end. One that lost attempts and is still listed gets up to
    LOST_CONFIRM_S for the GCS's health checks to notice it died."""
    alive = _alive_nodes(ray, dead)
    suspects = {str(x["node_id"]) for x in lost_log if x.get("node_id")} & set(alive)
    until = time.monotonic() + LOST_CONFIRM_S
    while suspects and time.monotonic() < until:
        time.sleep(0.5)
        alive = _alive_nodes(ray, dead)
        suspects &= set(alive)
    return alive


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    return tuple(t for t in (getattr(ray.exceptions, n, None) for n in LOST_ERRORS) if isinstance(t, type))


def _node_of_error(e: BaseException) -> str | None:
    m = re.search(r"node ID: ([0-9a-f]{16,})", str(e), re.IGNORECASE)
    return m.group(1) if m else None


def run_fleet(commands: Sequence[BatchCommand], cfg: FleetConfig, out_dir: Path | str | None = None,
              progress: Callable[[FleetEvent], None] | None = None,
              cancel: threading.Event | None = None) -> FleetSummary:
    """Run `commands` on the Ray cluster (see the module docstring); write cmd-NNN.json,
    .stdout and .stderr (output tails), journal.jsonl (every node's regions of the run) and
    summary.json to `out_dir` (default ./krex-fleet-<timestamp>/) and return them.

    A failing command does not stop the run. Setting `cancel` (or a KeyboardInterrupt in the
    calling thread) stops submitting, interrupts the running commands (SIGINT, then their
    tasks are killed after GRACE_S) and still writes everything."""
    check_args(1, cfg.device)
    if cfg.max_attempts < 1:
        raise UsageError(f"--max-attempts {cfg.max_attempts}: need at least 1", "give 1 or more")
    if not commands:
        raise UsageError("no commands to run", "give a batch file or --corpus")
    local = None if cfg.address else node_resources(cfg.device, cfg.slots_per_gpu)
    if cfg.node_root is not None:
        check_node_root(cfg.node_root, create=True)
        node_world("0" * 56, cfg.node_root)  # a too-long root fails here, not on every node
    out = (Path(out_dir) if out_dir is not None else default_out_dir()).absolute()
    _prepare_dir(out)
    ray = import_ray()
    connected = _connect(ray, cfg.address, local)
    try:
        from krex.fleetdrive import drive  # it imports this module

        return drive(ray, commands, cfg, out, progress, cancel or threading.Event())
    finally:
        if connected:
            ray.shutdown()


# ------------------------------------------------------------------------------------ summary


def fleet_summary(results: Sequence[CommandResult], extra: dict[int, dict[str, Any]],
                  nodes: dict[str, NodeInfo], alive: set[str], lost: Sequence[LostAttempt],
                  total_wall_s: float, cfg: FleetConfig, out_dir: str, interrupted: bool = False,
                  journals: Sequence[NodeJournal] = ()) -> dict[str, Any]:
    """The fleet summary: `krex batch`'s summary over all commands, plus one row per node.
    Pure. Each command counts once, on the node of its final attempt; lost attempts count
    only in `reruns` / `lost_attempts` (and in their node's row as `lost_attempts`)."""
    slots = sum(int(n.get("slots", 0)) for i, n in nodes.items() if i in alive)
    data = summarize(results, total_wall_s, slots, cfg.device, out_dir, interrupted)
    data["jobs"] = slots  # the live cluster's slots at the end: Ray's admission limit
    by_node: dict[str, list[CommandResult]] = {}
    for r in results:
        node = (extra.get(r.command.index) or {}).get("node_id")
        if node and r.exit_status is not None:
            by_node.setdefault(node, []).append(r)
    jr = {j.node_id: j for j in journals}
    rows = []
    for nid in sorted(set(nodes) | set(by_node)):
        rs = by_node.get(nid, [])
        regs = [reg for r in rs for reg in r.regions]
        info: NodeInfo | dict[str, Any] = nodes.get(nid, {})
        j = jr.get(nid)
        rows.append({
            "node_id": nid,
            "ip": info.get("ip"),
            "host": info.get("host"),
            "gpus": info.get("gpus"),
            "slots": info.get("slots"),
            "state": "alive" if nid in alive else "lost",
            "commands": len(rs),
            "failures": sum(1 for r in rs if not r.ok),
            "regions": len(regs),
            "contaminated_regions": sum(1 for reg in regs if reg.get("contaminated")),
            "region_waits": _dist([_num(reg.get("queue_wait_s")) for reg in regs]),
            "admission_waits": _dist([_num(r.report.get("admission_wait_s")) for r in rs if r.report]),
            "gpus_used": sorted({int(_num((r.report or {}).get("gpu"))) for r in rs if r.report}),
            "lost_attempts": sum(1 for x in lost if x.get("node_id") == nid),
            "journal_regions": None if j is None else len(j.records),
            "journal_error": None if j is None else j.error,
        })
    rt = [float(e["round_trip_s"]) - r.wall_s for r in results
          if r.exit_status is not None and (e := extra.get(r.command.index))
          and e.get("round_trip_s") is not None]
    data.update({
        "fleet": {"address": cfg.address or "local", "node_root": cfg.node_root,
                  "max_attempts": cfg.max_attempts},
        "nodes": rows,
        "lost_nodes": sorted(n for n in nodes if n not in alive),
        "reruns": sum(len((extra.get(r.command.index) or {}).get("lost_attempts", [])) for r in results),
        "lost_attempts": list(lost),
        # driver round trip minus the command's own `krex run` wall: Ray's scheduling,
        # the task's set-up and the result's way back (queueing for a free slot included)
        "dispatch_s": _dist(rt),
    })
    return data


# ----------------------------------------------------------------------------- fleet journal


@dataclass
class NodeJournal:
    node_id: str
    ip: str | None
    host: str | None
    records: list[dict[str, Any]]
    error: str | None = None


def gather_journals_connected(ray: Any, node_root: str | None, since: float | None = None,
                              last: int | None = None, nodes: Sequence[str] | None = None,
                              timeout_s: float = 60.0) -> list[NodeJournal]:
    """Every live KREX node's journal (one task pinned to each node), on a connected Ray."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = _alive_nodes(ray)
    ids = [n for n in (nodes if nodes is not None else sorted(alive)) if n in alive]
    task = ray.remote(node_journal)
    root = None if node_root is None else str(Path(node_root).absolute())
    refs = {n: task.options(num_cpus=0, max_retries=0,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
            .remote(root, since, last) for n in ids}
    out = []
    deadline = time.monotonic() + timeout_s
    for n, ref in refs.items():
        info = alive[n]
        try:
            got = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            out.append(NodeJournal(n, got.get("node_ip") or info.get("ip"), got.get("host"), got["records"]))
        except Exception as e:  # a node that dies or hangs now: say so, keep the others
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            out.append(NodeJournal(n, info.get("ip"), info.get("host"), [], f"{type(e).__name__}: {e}"[:300]))
    return out


def gather_journals(address: str | None, node_root: str | None = None, last: int | None = None,
                    since: float | None = None) -> list[NodeJournal]:
    """`krex journal --fleet`: connect to the Ray cluster at `address` (default: $RAY_ADDRESS,
    else 'auto', the cluster this machine belongs to) and read every KREX node's journal."""
    if node_root is not None:
        check_node_root(node_root, create=False)
    ray = import_ray()
    addr = address or os.environ.get("RAY_ADDRESS") or "auto"
    connected = _connect(ray, addr, None)
    try:
        js = gather_journals_connected(ray, node_root, since, last)
    finally:
        if connected:
            ray.shutdown()
    if not js:
        raise NotFound(f"no live node of the Ray cluster at {addr} offers the {RESOURCE} resource",
                       "start KREX nodes with `ray start ... --resources \"$(krex fleet --node-resources)\"`")
    return js
