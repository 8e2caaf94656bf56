"""The requests of a command's guardian: admit (a slot on a GPU, a pre-warmed start, or a
wait in the queue), adopt (a guardian of a previous daemon keeps its slot), started (its
command joins the slot), register (a self-registered process), and release (the command
ended: its leftovers, its regions' records, the notes and the native guardian's report)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from krex import paths
from krex.errors import DaemonLost, KrexError, NotFound, PermissionDenied, UsageError
from krex.native import lib
from krex.node import freezepolicy, optin, regionqueue
from krex.node.regions import Regions
from krex.node.slots import RELEASE_MAX_RECORDS, Slot, _roots, _user_name
from krex.node.state import handles, log
from krex.protocol import MAX_FRAME, encode_reply, int_field


def _fit(records: list[dict[str, Any]], budget: int) -> int:
    """How many of `records`, from the first, fit in `budget` bytes of JSON."""
    total = 2
    for i, r in enumerate(records):
        total += len(json.dumps(r, default=str)) + 2
        if total > budget:
            return i
    return len(records)


def _status_fields(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("Uid", "Gid", "Groups", "PPid"):
                    out[key] = [int(x) for x in val.split()]
                    if len(out) == 4:  # all four come early; the rest (~50 lines) is not needed
                        break
    except (OSError, ValueError):
        pass
    return out


def _check_own_tree(child: int, peer: int, uid: int) -> None:
    """`child` must be the peer's own process or a descendant of it, with the peer's
    (real) user id; anything else could be someone else's process."""
    st = _status_fields(child)
    if not st:
        raise NotFound(f"no process {child}", "send the pid of your own command")
    if uid != 0 and st.get("Uid", [-1])[0] != uid:
        raise PermissionDenied(
            f"process {child} does not run as uid {uid}: only your own processes may join your slot",
            "send the pid of your own command",
        )
    p, ppid = child, st.get("PPid", [0])  # the child's parent from the read above
    for _ in range(256):
        if p == peer:
            return
        p = ppid[0] if ppid else 0
        if p <= 1:
            break
        ppid = _status_fields(p).get("PPid", [0])
    raise PermissionDenied(
        f"process {child} is not in the process tree of pid {peer}: only your own command may join your slot",
        "send the pid of the command you started",
    )


def _peer_closed(conn: socket.socket) -> bool:
    """Has the client closed its end? (It sends nothing while it waits for an answer.)"""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def run_kind(asked: str, daemon_kind: str) -> str:
    """The kind a command opts into, from its `--device` and the daemon's device alone (no
    discovery): `sim`, or `auto` on a simulated daemon, is "sim"; else "gpu" (`--device gpu`
    on a simulated daemon only where a real GPU exists: Admission._check_native)."""
    return "sim" if asked == "sim" or (asked == "auto" and daemon_kind == "sim") else "gpu"


class Admission(Regions):
    """The Daemon's guardian requests."""

    @handles("admit")
    def _admit(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        want = int_field(msg, "gpu")
        asked = msg.get("device") or "auto"  # the client's --device: the environment's kind
        if asked not in ("auto", "gpu", "sim"):
            raise UsageError(f"unknown device {asked!r}", "use one of: auto, gpu, sim")
        freeze = msg.get("freeze")
        if freeze is not None:
            freezepolicy.check(str(freeze))
        tenant = msg.get("tenant")
        tenant = _user_name(owned["uid"]) if tenant in (None, "") else regionqueue.check_tenant(str(tenant))
        if msg.get("guardian") == "native":
            self._check_native(asked, owned)
        if want is not None and not 0 <= want < self.info.count:
            raise NotFound(
                f"unknown GPU {want}: this node has {self.info.count} GPU(s)",
                "pick a GPU index from `krex status`",
            )
        self._check_not_lost()
        t0 = time.monotonic()
        told = False
        with self.lock:
            while True:
                picked = self._pick_gpu(want)
                if picked is not None:
                    gpu, warm = picked
                    s = self._new_slot(gpu, "run", pid, warm=warm)
                    s.freeze = None if freeze is None else str(freeze)
                    s.tenant = tenant
                    break
                if not told:
                    busy = len(self.slots)
                    ev = {"event": "queued", "slots_busy": busy, "note": optin.queue_note(busy)}
                    conn.sendall(encode_reply("event", ev))
                    told = True
                self.changed.wait(0.5)
                if self.stop.is_set():
                    raise KrexError("daemon is stopping", "try again")
                if _peer_closed(conn):  # Ctrl-C in the queue: never admit a guardian that is gone
                    raise DaemonLost("the client closed its connection while queued", "")
        owned["guardian"] = s.slot
        log.info("slot %d on gpu %d admitted for guardian pid %d", s.slot, gpu, pid)
        if owned.get("role") == "member":
            self._delegate_thaw(s, owned["uid"])
        env_set, env_prepend = self._command_env(s, gpu, asked)
        s.admission_wait_s = round(time.monotonic() - t0, 6)
        s.simulated = self.info.kind == "sim" or asked == "sim"
        value = msg.get("auto_value")
        if isinstance(value, str):
            s.auto_value = value.strip()
        placed = s.placement.as_dict() if s.placement else {}
        return {
            # Taken (the guardian falls back to Python with a krexd that does not say so).
            **({"auto_value": True} if isinstance(value, str) else {}),
            "ok": True,
            "notes": optin.start_notes(
                s.simulated,
                s.warm,
                optin.sim_reason(asked, self.cfg.device),
                cgroup_note=placed.get("note", ""),
            ),
            "cgroup": placed,
            "warm": s.warm,
            "env_set": env_set,
            "env_prepend": env_prepend,
            "slot": s.slot,
            "gpu": gpu,
            "physical": self.info.physical[gpu],
            "vendor": self.info.kind,
            "visible": self.info.visible_token(gpu),
            "generation": s.generation,
            "device": self.info.kind,
            "shm": self.shm_name,
            "group": s.group.path,
            "freezer": self.freezer.name,
            "shared_cpus": self.partition.command_cpus(gpu, self.cfg.lend_cores),
            "admission_wait_s": s.admission_wait_s,
            "tenant": s.tenant,
        }

    def _check_native(self, asked: str, owned: dict[str, Any]) -> None:
        """`--device gpu` on a simulated daemon runs only where this node has a real GPU: the
        native guardian (interpose/guardian.c) does no GPU discovery, so krexd, on the same
        node, does it before any slot is taken (krex.device.gpus.discover raises NotFound,
        the words `krex run`'s own discovery gives where no daemon answers)."""
        del owned
        if asked == "gpu" and self.info.kind == "sim":
            from krex.device.gpus import discover

            discover("gpu")

    def _command_env(self, s: Slot, gpu: int, asked: str) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The variables a guardian gives its command (optin.opt_in_parts plus the slot's):
        the guardian applies exactly these. A simulated daemon under `--device gpu` opts in
        as "gpu" (_check_native first checks that a real GPU exists)."""
        kind = run_kind(asked, self.info.kind)
        base = self._opt_in.get(kind)
        if base is None:  # the same for every command of this daemon: made once per kind
            base = self._opt_in[kind] = optin.opt_in_parts(
                kind, self.shm_name, str(self.sock_path), str(paths.log_path())
            )
        put, pre = dict(base[0]), {k: list(v) for k, v in base[1].items()}
        put.update(
            KREX_SLOT=str(s.slot),
            KREX_GPU=str(gpu),
            CUDA_VISIBLE_DEVICES=str(self.info.visible_token(gpu)),
            # The shim compares it with the slot's generation: a process of this command that
            # outlives it never passes the gate of the next command that gets this slot.
            KREX_SLOT_GEN=str(s.generation),
        )
        if self.info.kind == "amd":  # HIP reads HIP_VISIBLE_DEVICES before CUDA_VISIBLE_DEVICES
            put["HIP_VISIBLE_DEVICES"] = str(self.info.physical[gpu])
        put.update(self.mps.command_env(gpu))  # MPS pipe and log directories, the GPU's UUID
        return put, pre

    def _delegate_thaw(self, s: Slot, uid: int) -> None:
        """A member's guardian must be able to thaw its own command if krexd dies or
        hangs (I5): hand it the slot's freeze file, and nothing else."""
        name = {"cgroup2": "cgroup.freeze", "cgroup1": "freezer.state"}.get(self.freezer.name)
        if name:
            with contextlib.suppress(OSError):
                os.chown(os.path.join(s.group.path, name), uid, -1, follow_symlinks=False)

    @handles("adopt")
    def _op_adopt(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._adopt(pid, msg, owned)

    def _adopt(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> dict[str, Any]:
        """A guardian of a previous daemon reconnects and keeps its slot."""
        n, gpu = int_field(msg, "slot", required=True), int_field(msg, "gpu", required=True)
        assert n is not None and gpu is not None
        if not 0 <= n < lib.KREX_MAX_SLOTS or not 0 <= gpu < self.info.count:
            raise NotFound(f"no slot {n} on GPU {gpu}", "start the command again")
        raw = msg.get("pids", [])
        if not isinstance(raw, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
            raise UsageError("field 'pids' must be a list of integers", "send the command's pids")
        pids = set()
        for p in raw:  # the same rule as `started`: only the peer's own tree
            with contextlib.suppress(PermissionDenied, NotFound):
                _check_own_tree(p, pid, owned["uid"])
                pids.add(p)
        with self.lock:
            sp = self.seg.raw.slots[n]
            if sp.state != lib.KREX_SLOT_ACTIVE or sp.owner_pid != pid:
                raise NotFound(f"slot {n} is not held by pid {pid}", "start the command again")
            s = Slot(
                n,
                gpu,
                "run",
                pid,
                self.freezer.group(f"slot-{n}"),
                _roots(pids),
                generation=int(sp.generation),
                warm=bool(sp.warm),
            )
            old = self.slots.get(n)
            if old is not None:
                s.created = old.created  # its place among pre-warmed ones
            self.slots[n] = s
            self._publish_queue_caps()
            owned["guardian"] = n
        return {"ok": True, "slot": n}

    @handles("started")
    def _op_started(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        child = int_field(msg, "pid", required=True)
        assert child is not None
        # Only the peer's own process tree, with its credentials, may join a slot: a
        # pid from the message would otherwise let a member freeze anyone's process.
        _check_own_tree(child, pid, owned["uid"])
        with self.lock:
            s = self.slots.get(owned["guardian"])
            if s is None:
                raise UsageError("`started` before `admit`", "send admit first")
            s.root_pids.update(_roots([child]))
            if self.freezer.name == "signal" or msg.get("join"):
                # join: the guardian could not enter the slot's cgroup itself (a group
                # member); its child waits before exec until the daemon has moved it.
                s.group.add(child)
        return {"ok": True}

    @handles("register")
    def _op_register(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        s = self._slot_for(pid, msg, owned)
        self._wait_warm(s, pid)  # a process that skipped the shim's own wait (no KREX_SLOT)
        return {"ok": True, "slot": s.slot, "gpu": s.gpu, "shm": self.shm_name}

    @handles("release")
    def _op_release(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        n = owned["guardian"]
        out: dict[str, Any] = {"leftovers": [], "action": "none"}
        if n is not None:
            with self.lock:
                slot = self.slots.get(n)
            counters = None
            if msg.get("report") and slot is not None:  # before the release clears its records
                counters = optin.gate_counters(self.seg.slot_procs(n))
            told = self._mps_exit(slot, _exit_of(msg)) if slot is not None else None
            policy = "keep" if msg.get("leftovers") == "keep" else "kill"
            out = self._leftovers(n, policy)
            if told is not None:
                out["mps_client_fault"] = told
            if out["action"] in ("none", "killed"):
                self._release(n, "command-exit")
            else:  # the slot lives on until its last process ends (the reaper frees it)
                with self.lock:
                    if n in self.slots:
                        self.slots[n].guardian_connected = False
            owned["guardian"] = None
            if slot is not None:
                if slot.placement is not None:
                    out["cgroup"] = slot.placement.as_dict()
                if slot.warm or slot.warm_s is not None:  # started pre-warmed: for the report
                    out["prewarm_s"] = slot.warm_s if not slot.warm else round(time.time() - slot.created, 6)
                    out["prewarm_given_gpu"] = not slot.warm
                out["tenant"] = slot.tenant
                out.update(self._slot_regions(slot))
                auto: dict[str, Any] = {}
                out["notes"] = self._release_notes(
                    slot, out, msg.get("auto_dir"), owned["uid"], auto, slot.auto_value
                )
                if counters is not None:
                    self._report_json(slot, counters, out, auto, msg)
        return {"ok": True, **out}

    def _mps_exit(self, s: Slot, ex: object) -> dict[str, Any] | None:
        """How the guardian says its command ended (`release`'s "exit": pid, status, signal,
        command), for MPS (krex.node.mps.Mps.command_exit): a command killed by a signal is an
        MPS client fault (a journal event; the GPU's regions are flagged). Returns another
        client's fault this command, which failed, may have failed from (the release reply's
        `mps_client_fault`, with the notice `krex run` prints)."""
        if not isinstance(ex, dict) or self.mps.mode == "off":
            return None
        try:
            pid, status, sig = (int_field(ex, k, required=True) for k in ("pid", "status", "signal"))
        except UsageError as e:
            log.warning("slot %d: the guardian's exit status is malformed (%s): not used", s.slot, e)
            return None
        assert pid is not None and status is not None and sig is not None
        command = str(ex.get("command") or "?")[:200]
        # The guardian's word counts for its own command's process only.
        made, told = self.mps.command_exit(s.gpu, s.started_ns, pid, status, sig if pid in s.root_pids else 0,
                                           command)
        if made is not None:
            self._journal({"event": "mps-client-fault", "ts": made.ts, "gpu": s.gpu, "slot": s.slot,
                           "guardian_pid": s.guardian_pid, "pid": pid, "signal": made.signame(),
                           "command": command})
        return {**told.as_dict(), "notice": told.notice()} if told is not None else None

    def _slot_regions(self, s: Slot) -> dict[str, Any]:
        """The `release` reply's regions, from krexd's own record of the command (never the
        journal), once a region it still had (ended by the release) is recorded: `regions`
        (the first ones, as many as krexd keeps and half a frame holds), `regions_dropped`
        (how many more there were), `region_tally` (the counts over all of them) and, for a
        region that did not finish in time, `regions_unfinished` (it is journaled later)."""
        with self.lock:
            cur = [r for r in self.current.values() if r is not None and r.slot == s.slot]
        pending = [r for r in cur if r.ended.is_set()]
        for r in pending:
            r.released.wait(10)
        out: dict[str, Any] = {}
        if self.journal_error:
            out["journal_error"] = self.journal_error
        with self.lock:
            regs, dropped = list(s.records), s.records_dropped
            tally = {**s.tally, "region_flags": dict(s.tally.get("region_flags") or {})}
        listed = _fit(regs, MAX_FRAME // 2)
        out["regions"] = regs[:listed]
        out["regions_dropped"] = dropped + len(regs) - listed
        out["regions_cap"] = RELEASE_MAX_RECORDS
        out["region_tally"] = tally or optin.region_tally([])
        out["region_auto_labels"] = dict(s.auto_labels)
        unfinished = sum(1 for r in pending if not r.released.is_set())
        if unfinished:
            out["regions_unfinished"] = unfinished
        return out

    def _report_json(
        self,
        s: Slot,
        counters: dict[str, Any],
        out: dict[str, Any],
        auto: dict[str, Any],
        req: dict[str, Any] | None = None,
    ) -> None:
        """The native guardian's whole `--report`, as JSON text it writes as it is:
        optin.run_report, then what only the guardian saw (`req`, its release request: the
        exit status, krexd's stall; optin.guardian_members) and its caller's members:
        `report_json`, in place of `regions` (not twice in one frame). Where the listed
        regions do not fit in the reply, the list is shortened (the later ones go) and
        `regions_dropped` counts them: the counts still cover every region."""
        regs: list[dict[str, Any]] = out.pop("regions", None) or []
        dropped = int(out.get("regions_dropped") or 0)

        def text(n: int) -> str:
            rel = {**out, "regions": regs[:n], "regions_dropped": dropped + len(regs) - n}
            rep = optin.run_report(
                s.slot, s.gpu, s.admission_wait_s, self.info.kind, s.simulated, counters, rel
            )
            if auto and optin.auto_region_kept(auto):
                rep["auto_region"] = auto
            if req is not None:
                rep = optin.guardian_members(rep, req)
            return json.dumps(rep, indent=2, default=str) + "\n"

        n = len(regs)
        body = text(n)
        # The reply as it will be encoded (the text escaped once more), with room to spare.
        while n and len(json.dumps({**out, "report_json": body}, default=str)) > MAX_FRAME * 3 // 4:
            n = n * 3 // 4
            body = text(n)
        out["report_json"] = body

    def _release_notes(
        self,
        s: Slot,
        out: dict[str, Any],
        auto_dir: object,
        uid: int,
        auto: dict[str, Any] | None = None,
        value: str = "",
    ) -> list[str]:
        """The notes `krex run` prints after its command (optin.release_notes), for a guardian
        that does not render them itself (interpose/guardian.c). `auto_dir`: the command's
        KREX_AUTO_STATUS_DIR when processes left status files there; read only if it is a
        directory of the peer's own that nobody else may write (never through a link).
        `value`: KREX_AUTO_REGION in the guardian's environment (a warning when it made no
        region). What was read goes into `auto` too (the report's `auto_region`)."""
        report: dict[str, Any] = dict(s.tally) or optin.region_tally([])

        def read(d: Path | None) -> None:  # d None: no status to read (the value alone)
            report["auto_region"] = optin.auto_region_report(
                value, d, [], remove=False, uid=uid, labels=dict(s.auto_labels)
            )
            if auto is not None:
                auto.update(report["auto_region"])

        if not (isinstance(auto_dir, str) and auto_dir):
            if value:  # set, and no process said so
                read(None)
            return optin.release_notes(out, report)
        fd = -1
        try:
            if not os.path.isabs(auto_dir):
                raise PermissionDenied("not an absolute path", "")
            # Opened once, never through a link, and read through that descriptor: the
            # path cannot be swapped for another directory between the checks and the reads.
            fd = os.open(auto_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            st = os.fstat(fd)
            if st.st_uid != uid:
                raise PermissionDenied("not a directory of yours", "")
            if st.st_mode & 0o022:
                raise PermissionDenied("writable by others", "")
            read(Path(f"/proc/self/fd/{fd}"))
        except Exception as e:  # noqa: BLE001 - a client's files must never fail its release
            why = e.strerror if isinstance(e, OSError) else str(e) or type(e).__name__
            if value:  # the value's warning and report all the same, as if no status was left
                read(None)
            return [
                *optin.release_notes(out, report),
                f"krex: warning: krexd could not read the auto-region status in {auto_dir} ({why})",
            ]
        finally:
            if fd >= 0:
                os.close(fd)
        return optin.release_notes(out, report)


def _exit_of(msg: dict[str, Any]) -> object:
    """`release`'s account of how the command ended: the guardian's struct fields (exit_pid,
    exit_status, exit_signal, exit_command), or a Python client's "exit" object."""
    if msg.get("exit_pid") is None:
        return msg.get("exit")
    return {
        "pid": msg["exit_pid"],
        "status": msg.get("exit_status"),
        "signal": msg.get("exit_signal"),
        "command": msg.get("exit_command"),
    }
