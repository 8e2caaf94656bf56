"""`krex.region()`: mark the timed part of a benchmark.

    with krex.region() as grant:      # exclusive GPU + pinned thread inside
        ms = triton.testing.do_bench(fn)

Also a decorator (``@krex.region()``). Thread-safe: one region per process at a
time, other threads wait their turn; a nested region on the same thread is a
no-op. Outside KREX it does nothing and warns once; with KREX_STRICT=1 it raises.

A lost daemon (killed, stopped, hung, or stopped by `krex daemon stop`) never
kills the benchmark: the region warns, sets `unprotected` (and `lost`, why) and
the code inside runs on; the next region connects afresh."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from krex.errors import DaemonLost, KrexError, NotFound, Timeout

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()
# One region per process (the daemon serialises per GPU anyway). Re-entrant only so that its
# owner can be asked (_is_owned, recorded by the acquire itself): an interrupt that lands
# right after the acquire returns must not leave it held.
_proc_lock = threading.RLock()
_client: Any = None
_client_pid = 0
_warned = False
_granted_tid: int | None = None  # the thread whose region krexd granted, while it runs
_grant_seq = 0  # bumped at each grant in this process: a soft region knows when "its" region ended
_fork_gen = 0  # bumped in a fork child: regions entered before the fork are the parent's
_fork_word = 0  # forked inside its parent's region: that region's gate word (0: none, or over)
_SOFT_WAIT_S = 60.0  # a soft region waits this long for another thread's region to be granted
_HANG_WARN_S = 10.0  # a hard region waiting this long for a parked thread's region warns


def _after_fork_in_child() -> None:
    """A child forked inside a region is not its owner: the inherited region ends in the
    parent only, and the child's own regions start afresh (depth 0, a free lock). While that
    region of its parent's still holds the gate (the same gate word, epoch included), they
    run inside it as nested ones: a region of its own would queue behind its parent's, which
    may be waiting for it. After it, they are regions of their own."""
    global _proc_lock, _granted_tid, _fork_gen, _client, _fork_word
    if getattr(_local, "depth", 0) > 0 or _granted_tid is not None:
        _fork_word = _our_gate_word()
    _proc_lock = threading.RLock()
    _granted_tid = None
    _fork_gen += 1
    _client = None  # the parent's connection: never ours to use or close
    _local.depth = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _release_if_ours() -> None:
    if _proc_lock._is_owned():  # type: ignore[attr-defined]
        _proc_lock.release()


def under_krex() -> bool:
    return bool(os.environ.get("KREX_SHM") or os.environ.get("KREX_SOCKET"))


def _strict() -> bool:
    return os.environ.get("KREX_STRICT", "") not in ("", "0")


def _get_client() -> Any:
    global _client, _client_pid
    from krex.proc.client import Client

    if _client is None or _client_pid != os.getpid():  # a fork child needs its own connection
        _client = Client.connect(autostart=True, device=os.environ.get("KREX_DEVICE", "auto"))
        _client_pid = os.getpid()
    return _client


def _drop_client() -> None:
    global _client
    if _client is not None and _client_pid == os.getpid():
        _client.close()
    _client = None


# What "the daemon is gone" looks like from here: a closed or reset connection, a
# daemon that does not answer within the heartbeat timeout, no socket at all.
_LOST = (DaemonLost, Timeout, OSError)


def _begin(msg: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(_get_client().request(msg))
    except DaemonLost:
        # The cached connection belonged to a daemon that has gone (or restarted):
        # one fresh try, which also starts a new daemon on demand.
        _drop_client()
        return dict(_get_client().request(msg))


def soon() -> bool:
    """Tell krexd that a region of this command comes soon (an automatic region's target was
    entered and runs its warm-up first): the other commands on the GPU start shrinking their
    queued work now, so the region's gate closes on short queues (docs/design/data-plane.md,
    early shrink).
    Only a hint, lapsing after KREX_SOON_MS: it never delays this command and never raises.
    False outside KREX, inside a region, while another thread's region is under way, or when
    krexd could not be told."""
    if not under_krex() or getattr(_local, "depth", 0) > 0 or _fork_word:
        return False
    if not _proc_lock.acquire(blocking=False):  # another thread's region: its BEGIN has said it
        return False
    try:
        return bool(_get_client().request({"op": "soon"}).get("soon"))
    except (KrexError, OSError):
        return False
    finally:
        _proc_lock.release()


class RegionWarning(RuntimeWarning):
    """A region ended that KREX cannot vouch for: cut by --max-region, or flagged."""


class region:  # noqa: N801 - reads like a keyword at call sites
    """Context manager and decorator. `grant` holds the daemon's reply (timings,
    contamination) after entry, None when nested or outside KREX.

    After the block: `clean` is True only when the region was exclusive from entry
    to exit (None when nested or outside KREX); `cut` is True when krexd ended it at
    --max-region before the block ended, so what ran after the cut was not protected;
    `flags` and `reasons` say why a region is not clean. A region that is not clean
    also warns (RegionWarning)."""

    def __init__(self, label: str | None = None, soft: bool = False) -> None:
        self.label = label
        # soft: for targets KREX turns on by itself (the implicit `inductor`), which must never
        # wait for their own command or break the program: no region when another thread of
        # this process or another process of its command holds one (the GPU is the
        # command's already; outliving that one is flagged), nor when krexd refuses one
        # (flagged), and its warnings never raise.
        self.soft = soft
        self.grant: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.unprotected = False  # True: (part of) this region ran without exclusivity
        self.lost: str | None = None  # why, when the daemon was lost
        self.clean: bool | None = None
        self.cut = False
        self.flags: list[str] = []
        self.reasons: list[str] = []
        self._active = False
        self._gen = _fork_gen
        self._inside: tuple[str, int] | None = None  # the region this one runs inside, not its own

    def _warn(self, message: str, category: type[Warning], stacklevel: int) -> None:
        try:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
        except Warning:
            if not self.soft:  # warnings as errors: a soft region must not break the program
                raise

    def _lose(self, why: str, stacklevel: int) -> None:
        self.unprotected = True
        self.lost = why
        self.clean = False
        self.flags = ["daemon-lost"]
        _drop_client()
        self._warn(
            f"krex.region(): lost the KREX daemon ({why}); this region is not exclusive", RuntimeWarning,
            stacklevel=stacklevel,
        )

    def _flag_unprotected(self, flag: str, why: str) -> None:
        self.unprotected = True
        self.clean = False
        self.flags = [flag]
        self.reasons = [why]
        self._warn(f"krex.region(): {why}; it is not exclusive", RegionWarning, stacklevel=4)

    def __enter__(self) -> region:
        global _warned
        self._gen = _fork_gen
        depth = getattr(_local, "depth", 0)
        if depth:
            _local.depth = depth + 1
            return self  # nested: the outer region already holds the GPU
        if not under_krex():
            if _strict():
                raise NotFound(
                    "krex.region() used outside KREX (KREX_STRICT=1)",
                    'run under `krex run -- ...` or eval "$(krex env --export)"',
                )
            if not _warned:
                warnings.warn(
                    "krex.region(): not running under KREX; the region is not exclusive",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _warned = True
            _local.depth = 1
            return self
        global _fork_word
        if _fork_word:
            if _our_gate_word() == _fork_word:
                self._inside = ("gate", _fork_word)  # the parent's region, which may be waiting for us
                _local.depth = 1
                return self
            _fork_word = 0  # that region is over: this child is on its own from now on
        # Every way out of this block either keeps the lock with an active region or gives it
        # back, an interrupt too (even one that lands as the acquire returns): no depth or
        # lock is left behind for later regions to wait on.
        global _granted_tid, _grant_seq
        granted = False
        try:
            if self.soft:
                if not self._soft_lock():
                    _local.depth = 1
                    return self
            else:
                self._hard_lock()
            msg: dict[str, Any] = {"op": "begin", "tid": threading.get_native_id(), "gpu": _visible_gpu()}
            if self.label:
                msg["label"] = self.label
            self.grant = _begin(msg)
            self._active = True
            _grant_seq += 1  # first: whoever sees _granted_tid set sees this region's number
            _granted_tid = threading.get_ident()
            granted = True
        except _LOST as e:
            self._lose(str(e), stacklevel=3)
        except KrexError as e:
            if not self.soft:
                raise
            self._flag_unprotected("refused", f"krexd refused the region: {e}")
        except BaseException:
            # An interrupt mid-request leaves the connection out of step; closing it also ends
            # a region krexd granted meanwhile.
            if self._active:
                self._active = False
                _granted_tid = None
                _drop_client()
            raise
        finally:
            if not granted:
                _release_if_ours()
        _local.depth = 1
        return self

    def _hard_lock(self) -> None:
        """Take the process lock, waiting for another thread's region to end. If that region's
        thread sits in one of threading's waits for _HANG_WARN_S meanwhile, it may be waiting
        for this very thread (`with krex.region(): pool.submit(timed).result()`), which never
        ends: say so once, with the way out. (Running inside its region instead would be silently
        wrong: docs/design/region-api.md.)"""
        t0 = time.monotonic()
        if _proc_lock.acquire(timeout=_HANG_WARN_S):  # the common case: one blocking wait
            return
        while not _proc_lock.acquire(timeout=0.05):
            tid = _granted_tid
            if tid is None or not _parked(tid):
                continue
            self._warn(
                f"krex.region(): this thread has waited {time.monotonic() - t0:.0f} s for the region of "
                f"thread {tid}, which is itself waiting (for this thread? then neither ever goes on). "
                "Time the work in that region, or mark the worker's region krex.region(soft=True)",
                RuntimeWarning,
                stacklevel=4,
            )
            _proc_lock.acquire()  # said once; waiting on is all there is to do
            return

    def _soft_lock(self) -> bool:
        """Take the process lock for a soft region, or say why there is no region: the GPU is
        already this command's (another thread of this process, or another process of it,
        holds a granted region: `_inside` says which), or another thread's region did not
        come within _SOFT_WAIT_S (then `unprotected`, and a warning). Waits while another
        thread's region only awaits its grant: skipping then would run this benchmark
        unprotected, unreported."""
        deadline = time.monotonic() + _SOFT_WAIT_S
        while True:
            if _granted_tid is not None:
                self._inside = ("thread", _grant_seq)
                return False
            if _proc_lock.acquire(timeout=0.005):
                word = _our_gate_word()
                if word:  # another process of this command holds a region
                    _proc_lock.release()
                    self._inside = ("gate", word)
                    return False
                return True
            if time.monotonic() >= deadline:
                self._flag_unprotected(
                    "soft-wait-timeout",
                    f"another thread's region was not granted within {_SOFT_WAIT_S:.0f} s, "
                    "so this one ran without one",
                )
                return False

    def _outlived(self) -> bool:
        """Did the region this one ran inside end before it?"""
        if self._inside is None:
            return False
        kind, seq = self._inside
        if kind == "thread":
            return _granted_tid is None or _grant_seq != seq
        return _our_gate_word() != seq  # over, or another region since (the epoch differs)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._gen != _fork_gen:
            return  # a fork child leaving its parent's region: the parent ends it, not the child
        _local.depth -= 1
        if self._outlived():
            self._flag_unprotected(
                "outlived", "the region it ran inside (another of its command's) ended before it did"
            )
        if not self._active:
            return
        self._active = False
        global _granted_tid
        _granted_tid = None
        try:
            self.summary = _get_client().request({"op": "end"})
        except _LOST as e:
            self._lose(str(e), stacklevel=3)
        except KrexError:
            if et is None:
                raise
        except BaseException:
            _drop_client()
            raise
        finally:
            _release_if_ours()
        self._verdict(self.summary)

    def _verdict(self, reply: dict[str, Any] | None) -> None:
        if reply is None:
            return
        rec = reply.get("region") or {}
        self.cut = bool(reply.get("cut", rec.get("cut")))
        self.clean = bool(reply.get("clean", not rec.get("contaminated", True))) and not self.cut
        self.flags = list(reply.get("flags") or rec.get("flags") or [])
        self.reasons = list(rec.get("reasons") or [])
        if self.cut:
            self._warn(
                f"krex.region(): the region was cut by krexd's --max-region ({reply.get('end')}); what ran "
                "after the cut was not exclusive: do not trust this timing",
                RegionWarning,
                stacklevel=3,
            )
        elif not self.clean:
            self._warn(
                "krex.region(): the region was not clean: " + "; ".join(self.reasons or self.flags),
                RegionWarning,
                stacklevel=3,
            )

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            with region(self.label, soft=self.soft):
                return fn(*a, **k)

        return wrapper  # type: ignore[return-value]


def _parked(ident: int) -> bool:
    """Is thread `ident` blocked in one of threading's waits (Condition.wait, which Event,
    Future.result and queue.Queue.get use; Thread.join)?"""
    frame = sys._current_frames().get(ident)
    return (
        frame is not None
        and frame.f_code.co_filename == threading.__file__
        and frame.f_code.co_name in ("wait", "_wait_for_tstate_lock", "join")
    )


@functools.cache
def _gate_word_fn() -> Callable[[], int] | None:
    """The shim's krex_shim_gate_word (LD_PRELOAD), looked up once; None where it is not loaded."""
    try:
        fn = ctypes.CDLL(None).krex_shim_gate_word
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = []
    return fn


def _our_gate_word() -> int:
    """This GPU's gate word while our own command holds it closed, else 0."""
    fn = _gate_word_fn()
    return int(fn()) if fn is not None else 0


def _visible_gpu() -> int:
    """GPU index for a self-registering process (krex run sets KREX_GPU)."""
    raw = os.environ.get("KREX_GPU")
    if raw and raw.isdigit():
        return int(raw)
    return 0
