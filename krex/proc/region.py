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
import threading
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from krex.errors import DaemonLost, KrexError, NotFound, Timeout

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()
_proc_lock = threading.Lock()  # one region per process: the daemon serialises per GPU anyway
_client: Any = None
_client_pid = 0
_warned = False
_granted_tid: int | None = None  # the thread whose region krexd granted, while it runs
_fork_gen = 0  # bumped in a fork child: regions entered before the fork are the parent's
_SOFT_WAIT_S = 60.0  # a soft region waits this long for another thread's region to be granted


def _after_fork_in_child() -> None:
    """A child forked inside a region is not its owner: its regions start afresh (depth 0, a
    lock nobody holds), and the inherited one ends in the parent only."""
    global _proc_lock, _granted_tid, _fork_gen, _client
    _proc_lock = threading.Lock()
    _granted_tid = None
    _fork_gen += 1
    _client = None  # the parent's connection: never ours to use or close
    _local.depth = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


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
        # command's already), nor when krexd refuses one.
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

    def _lose(self, why: str, stacklevel: int) -> None:
        self.unprotected = True
        self.lost = why
        self.clean = False
        self.flags = ["daemon-lost"]
        _drop_client()
        warnings.warn(
            f"krex.region(): lost the KREX daemon ({why}); this region is not exclusive", RuntimeWarning,
            stacklevel=stacklevel,
        )

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
        if self.soft:
            if not self._soft_lock():
                _local.depth = 1
                return self
        else:
            _proc_lock.acquire()
        # From here the lock is ours: every way out of this block either keeps it with an
        # active region or gives it back (an interrupt too), so no depth is left behind.
        global _granted_tid
        granted = False
        try:
            msg: dict[str, Any] = {"op": "begin", "tid": threading.get_native_id(), "gpu": _visible_gpu()}
            if self.label:
                msg["label"] = self.label
            self.grant = _begin(msg)
            self._active = True
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
            self._active = False
            _granted_tid = None
            _drop_client()
            raise
        finally:
            if not granted:
                _proc_lock.release()
        _local.depth = 1
        return self

    def _soft_lock(self) -> bool:
        """Take the process lock for a soft region, or say why there is no region: the GPU is
        already this command's (another process of it, or another thread of this process, holds
        a granted region), or another thread's region did not come within _SOFT_WAIT_S (then
        `unprotected`, and a warning). Waits while another thread's region only awaits its
        grant: skipping then would run this benchmark unprotected, unreported."""
        deadline = time.monotonic() + _SOFT_WAIT_S
        while True:
            if _granted_tid is not None:
                return False  # inside another thread's granted region
            if not _proc_lock.locked() and _command_holds_gate():
                return False  # another process of this command holds a region
            if _proc_lock.acquire(timeout=0.005):
                if _command_holds_gate():
                    _proc_lock.release()
                    return False
                return True
            if time.monotonic() >= deadline:
                self._flag_unprotected(
                    "soft-wait-timeout",
                    f"another thread's region was not granted within {_SOFT_WAIT_S:.0f} s, "
                    "so this one ran without one",
                )
                return False

    def _flag_unprotected(self, flag: str, why: str) -> None:
        self.unprotected = True
        self.clean = False
        self.flags = [flag]
        self.reasons = [why]
        warnings.warn(f"krex.region(): {why}; it is not exclusive", RegionWarning, stacklevel=4)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._gen != _fork_gen:
            return  # a fork child leaving its parent's region: the parent ends it, not the child
        _local.depth -= 1
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
            _proc_lock.release()
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
            warnings.warn(
                f"krex.region(): the region was cut by krexd's --max-region ({reply.get('end')}); what ran "
                "after the cut was not exclusive: do not trust this timing",
                RegionWarning,
                stacklevel=3,
            )
        elif not self.clean:
            warnings.warn(
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


@functools.cache
def _gate_ours() -> Callable[[], int] | None:
    """The shim's krex_shim_gate_ours (LD_PRELOAD), looked up once; None where it is not loaded."""
    try:
        fn: Callable[[], int] = ctypes.CDLL(None).krex_shim_gate_ours
        return fn
    except (OSError, AttributeError):
        return None


def _command_holds_gate() -> bool:
    """Is this GPU's gate closed by our own command?"""
    fn = _gate_ours()
    return bool(fn()) if fn is not None else False


def _visible_gpu() -> int:
    """GPU index for a self-registering process (krex run sets KREX_GPU)."""
    raw = os.environ.get("KREX_GPU")
    if raw and raw.isdigit():
        return int(raw)
    return 0
