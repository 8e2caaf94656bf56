"""krexd's background threads: the heartbeat (with the watchdog's restart, the segment's
check and the fail-open count), the reaper (regions and slots whose owners are gone, the idle
exit) and the inspector (commands' processes judged for the `gpu` freeze policy)."""

from __future__ import annotations

import os
import time

from krex.native import lib
from krex.node.shm import HEARTBEAT_TIMEOUT_S
from krex.node.slots import Slots
from krex.node.state import log

# One home for each timing constant: the ABI header (interpose/krex_abi.h).
HEARTBEAT_S = lib.KREX_HEARTBEAT_INTERVAL_NS / 1e9
# krexd starts a new watchdog at most this often (seconds).
WATCHDOG_RESTART_S = 2.0
INSPECT_EVERY_S = 0.2  # the inspector thread's look at new processes (freezepolicy.Inspector)


class Loops(Slots):
    """The Daemon's background threads."""

    def _start_watchdog(self) -> None:
        """A process of our own that thaws our groups if we hang (krex/node/watchdog.py)."""
        import subprocess

        from krex.pystart import module_argv

        root = self.shm_name.strip("/").replace("/", "-") or "krex"
        args = [str(self.pid), self.shm_name, root, self.freezer.name]
        try:
            self._watchdog = subprocess.Popen(
                [*module_argv("krex.node.watchdog"), *args],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                # Not in krexd's process group: a signal to the group (Ctrl-C on a daemon
                # run in a terminal, kill -9 -PGID) must not take the watchdog along.
                start_new_session=True,
            )
        except OSError as e:
            self._watchdog = None
            log.error("cannot start the watchdog: %s; guardians still thaw their own commands", e)

    def _check_watchdog(self) -> None:
        """Start a new watchdog if ours died (self-registered processes have no guardian)."""
        wd = getattr(self, "_watchdog", None)
        if wd is None or wd.poll() is None or self.stop.is_set():
            return
        now = time.monotonic()
        if now - self._watchdog_started < WATCHDOG_RESTART_S:
            return  # one that dies at once (a broken install) is not restarted in a loop
        log.warning("the watchdog (pid %d) exited with %s: starting a new one", wd.pid, wd.returncode)
        self._watchdog_started = now
        self._start_watchdog()

    def _heartbeat_loop(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            self.seg.heartbeat()
            self._check_watchdog()
            try:
                self._guard_tick()
            except Exception as e:  # noqa: BLE001 - the watch must never stop the heartbeat
                log.error("segment check failed: %s: %s", type(e).__name__, e)
            self._check_fail_opens()  # n_gpus word loads; a snapshot only when one rose
            self.pending.expire()
            self._last_beat = last
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            if now - last > HEARTBEAT_TIMEOUT_S:
                # We were stopped or starved past the timeout: shims failed open and
                # guardians thawed their commands meanwhile. Regions that spanned it say so.
                with self.lock:
                    self.stalls.append((last, now))
                    del self.stalls[:-100]
                log.warning("krexd did not beat for %.2f s (stopped or starved)", now - last)
            last = now

    def _stalled_during(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] during which krexd did not beat (stopped or starved)."""
        with self.lock:
            spans = list(self.stalls)
        now = time.monotonic()
        if now - self._last_beat > HEARTBEAT_TIMEOUT_S:  # one the beat loop has not seen yet
            spans.append((self._last_beat, now))
        return sum(min(b, t1) - max(a, t0) for a, b in spans if a < t1 and b > t0)

    def _read_fail_opens(self) -> list[int]:
        return [int(self.seg.raw.gpus[g].fail_opens) for g in range(self.seg.n_gpus)]

    def _check_fail_opens(self) -> None:
        """Log shims that passed a closed gate because its holder looked dead (I5)."""
        now = self._read_fail_opens()
        for g, (old, new) in enumerate(zip(self._fail_opens, now, strict=False)):
            if new > old:
                pids = [p.pid for p in self.seg.snapshot().procs if p.gpu == g and p.fail_opens]
                log.warning(
                    "gpu %d: %d fail-open(s) (total %d): a shim passed a closed gate whose holder "
                    "was gone (a dead region holder or an expired pause lease); pids with fail-opens: %s",
                    g,
                    new - old,
                    new,
                    pids or "-",
                )
        self._fail_opens = now

    def _reaper_loop(self) -> None:
        while not self.stop.is_set():
            time.sleep(0.1)
            # Between regions only: an NVML query inside one is work beside the measurement.
            for g in range(self.info.count):
                if self.current.get(g) is None:
                    self.attestor.sample_memory(g)
            # Ended processes' records, each found gone this close to its end (exits.py).
            self.seg.reap_records()
            with self.lock:
                for r in self.current.values():
                    # A forked child can keep the owner's socket open: check the pid too.
                    if r is not None and not r.ended.is_set() and not lib.krex_pid_alive(r.pid, 0):
                        r.end_reason = "owner-died"
                        r.ended.set()
                for s in list(self.slots.values()):
                    dead = False
                    if s.kind == "auto":
                        dead = not lib.krex_pid_alive(s.guardian_pid, 0)
                    elif not s.guardian_connected:
                        dead = not self._group_pids(s, deep=self._deep_scan_due(s))
                    elif s.kind == "run" and not lib.krex_pid_alive(s.guardian_pid, 0):
                        # Gone while its connection stays open (a descriptor some other
                        # process still holds): as if the connection had closed.
                        s.guardian_connected = False
                        self.pool.submit(self._guardian_lost, s, f"pid {s.guardian_pid} is gone")
                    if dead:
                        self._release(s.slot, "owner-gone")
                self._remove_released()
                busy = bool(self.slots) or any(self.current.values())
                if busy:
                    self.last_busy = time.monotonic()
            if self.cfg.idle_exit_s is not None and time.monotonic() - self.last_busy > self.cfg.idle_exit_s:
                self.stop_reason = f"idle for {self.cfg.idle_exit_s:g} s"
                self.stop.set()

    def _unrecorded(self, gpu: int) -> dict[int, int]:
        """Slots of `gpu` with live processes that registered without a record (the table
        was full): gated through the slot's counter, but drained by nobody. The shim lists
        up to 4 per slot by pid (counted while alive); more, and processes in a pid
        namespace other than krexd's, are counted for good.
        A slot released meanwhile (its GPU no longer known) counts on every GPU."""
        out = {}
        for n in range(lib.KREX_MAX_SLOTS):
            sp = self.seg.raw.slots[n]
            active = int(sp.state) == lib.KREX_SLOT_ACTIVE
            if active and int(sp.gpu) != gpu:
                continue
            live = sum(lib.krex_unrecorded_alive(e) for e in sp.unrecorded_pids)
            count = live + (int(sp.unrecorded) if active else 0)
            if count:
                out[n] = count
        return out

    def _inspector_loop(self) -> None:
        """Inspect commands' processes for the `gpu` policy off the regions' path: those a
        region queued (it froze their slots meanwhile) at once, and every
        INSPECT_EVERY_S the new processes of every slot, so that most are known before a
        region asks."""
        while not self.stop.is_set():
            self.inspector.wanted.wait(INSPECT_EVERY_S)
            self.inspector.wanted.clear()
            try:
                self.inspector.inspect_pending()
                with self.lock:
                    slots = list(self.slots.values())
                for s in slots:
                    for pid in self._group_pids(s):
                        if self.stop.is_set():
                            return
                        if not self.inspector.seen(pid):
                            self.inspector.facts(pid)
            except Exception:  # noqa: BLE001 - an inspection that failed is retried by the next region
                log.exception("inspector")
