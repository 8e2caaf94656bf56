"""Reading /proc (and writing small control files): process state, parents and start
times, process trees, thread states. The freezer backends and krexd use these; they
never raise for a process that has gone, they report it missing."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

PROC = "/proc"
# Stopped ('T'), traced ('t'), zombie ('Z') and dead ('X') tasks cannot run user code.
STOPPED_STATES = frozenset("TtZX")
PF_EXITING = 0x4  # Stat.flags: the task is inside its exit (include/linux/sched.h)


def write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def keyed(text: str, key: str) -> str | None:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return v.strip()
    return None


@dataclass(frozen=True)
class Stat:
    pid: int
    state: str
    ppid: int
    start: int  # clock ticks since boot; tells a reused pid apart
    threads: int = 1
    cpu_ticks: int = 0  # user + system CPU time, clock ticks
    flags: int = 0  # the kernel's PF_* flags (PF_EXITING: inside its exit)
    # Where its stack, heap, arguments and environment start (fields 28, 47, 48, 51): an
    # exec lays them out afresh (randomised, and sized by the new arguments and
    # environment), so they tell one image of a pid from the next. Zeros where /proc hides
    # them (a process not ours to trace).
    image: tuple[int, ...] = ()


def parse_stat(text: str, pid: int) -> Stat | None:
    # comm (field 2) may contain spaces and parentheses, so split after the last ')'.
    rest = text[text.rfind(")") + 2 :].split()
    if len(rest) < 20:
        return None
    return Stat(
        pid=pid,
        state=rest[0],
        ppid=int(rest[1]),
        start=int(rest[19]),
        threads=int(rest[17]),
        cpu_ticks=int(rest[11]) + int(rest[12]),
        flags=int(rest[6]),
        image=(int(rest[25]), int(rest[44]), int(rest[45]), int(rest[48])) if len(rest) > 48 else (),
    )


def pid_stat(pid: int) -> Stat | None:
    try:
        with open(f"{PROC}/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read(), pid)
    except (OSError, ValueError):
        return None


def cmdline(pid: int, limit: int) -> str | None:
    """A process's arguments joined by spaces, cut to ``limit`` characters; None when
    /proc/PID/cmdline cannot be read (gone, or not in this pid namespace)."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return None


def _read_all(path: str) -> bytes | None:
    """A /proc file's whole content through bare descriptors (no io buffering: these
    scans open every process's file); None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts = []
        while chunk := os.read(fd, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def environ_scan(entry: bytes, names: Iterable[bytes]) -> dict[int, dict[bytes, set[bytes]]]:
    """Every process whose environment (/proc/PID/environ) holds the entry `entry`
    (b"NAME=value"): pid -> each of `names` -> the values it has there (a name may
    repeat). Processes that cannot be read (gone, or not ours to read) are left out.
    One bytes.find pass per environment for the prefix the names share (b"KREX_"),
    never a regex or a split: environments of 100 KB exist, and a regex over each
    cost milliseconds per process."""
    want = set(names)
    prefix = os.path.commonprefix([entry, *want])
    if not prefix:
        raise ValueError("environ_scan: the entry and the names share no prefix")
    out: dict[int, dict[bytes, set[bytes]]] = {}
    for d in os.listdir(PROC):
        if not d.isdigit():
            continue
        env = _read_all(f"{PROC}/{d}/environ")
        if not env:
            continue
        has = False
        found: dict[bytes, set[bytes]] = {n: set() for n in want}
        pos = env.find(prefix)
        while pos >= 0:
            end = env.find(b"\0", pos)
            end = len(env) if end < 0 else end
            if pos == 0 or env[pos - 1] == 0:  # the start of an entry, not inside a value
                item = env[pos:end]
                if item == entry:
                    has = True
                else:
                    name, eq, value = item.partition(b"=")
                    if eq and name in want:
                        found[name].add(value)
            pos = env.find(prefix, end)
        if has:
            out[int(d)] = found
    return out


class FreshScan(Generic[T]):
    """Shares an expensive scan between concurrent callers without handing anyone a stale
    result: `get()` returns the result of a run of `scan` that began after `get` was
    called. Callers that arrive while a run is going wait for it, then share the next run
    (one of them runs it). N callers at once cost two runs at most, not N."""

    def __init__(self, scan: Callable[[], T]) -> None:
        self._scan = scan
        self._cond = threading.Condition()
        self._started = 0  # runs begun so far; run k is the k-th
        self._done = 0  # the number of the run `_result` came from
        self._running = False
        self._result: T | None = None

    def get(self) -> T:
        with self._cond:
            want = self._started + 1  # any run numbered from here on began after this call
            while self._done < want:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                run = self._started
                self._cond.release()
                try:
                    result = self._scan()
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
                self._result, self._done = result, run
            assert self._result is not None
            return self._result


def proc_table() -> dict[int, Stat]:
    table: dict[int, Stat] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            st = pid_stat(int(entry))
            if st is not None:
                table[st.pid] = st
    return table


def descendants(roots: Iterable[int], table: dict[int, Stat]) -> set[int]:
    children: dict[int, list[int]] = {}
    for st in table.values():
        children.setdefault(st.ppid, []).append(st.pid)
    seen: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
    return seen


def children(pid: int) -> list[int] | None:
    """Children of a process from /proc/PID/task/*/children; None where the kernel lacks the file."""
    try:
        tids = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            kids.extend(int(x) for x in read(f"{PROC}/{pid}/task/{tid}/children").split())
        except FileNotFoundError:
            if not os.path.exists(f"{PROC}/{pid}/task"):
                return []  # the process is gone
            return None  # CONFIG_PROC_CHILDREN is off
        except (OSError, ValueError):
            continue
    return kids


def tree(roots: dict[int, int]) -> dict[int, int]:
    """The live processes among roots (pid -> start time) and all their descendants.

    Walks the children files, so a signal freeze costs O(tree) rather than O(all processes).
    Those files can miss a fork that races the read; callers re-check once everything is stopped.
    """
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        st = pid_stat(pid)
        if st is None or (pid in roots and roots[pid] != st.start):
            continue
        kids = children(pid)
        if kids is None:
            return tree_by_scan(roots)
        found[pid] = st.start
        todo.extend(kids)
    return found


def tree_by_scan(roots: dict[int, int]) -> dict[int, int]:
    table = proc_table()
    alive = [p for p, s in roots.items() if p in table and table[p].start == s]
    return {p: table[p].start for p in descendants(alive, table)}


def task_states(pid: int) -> list[str]:
    """States of every thread of a process; SIGSTOP stops the whole thread group."""
    states: list[str] = []
    try:
        tids = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"{PROC}/{pid}/task/{tid}/stat", encoding="utf-8", errors="replace") as f:
                st = parse_stat(f.read(), int(tid))
        except (OSError, ValueError):
            continue
        if st is not None:
            states.append(st.state)
    return states


def read_or_empty(path: str) -> str:
    """A /proc file's text, stripped; "" if it cannot be read (gone, or not ours)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def thread_report(pid: int, limit: int = 12) -> str:
    """Where a process's threads are, for a reason text: `comm` and cmdline, then per thread
    its name, state, kernel wait channel and the top of its kernel stack (root only)."""
    rd = read_or_empty
    try:
        tids = sorted(os.listdir(f"{PROC}/{pid}/task"), key=int)
    except OSError:
        return f"pid {pid}: gone"
    out = [f"pid {pid} ({rd(f'{PROC}/{pid}/comm')}: {(cmdline(pid, 80) or '?')})"]
    out.extend(thread_line(pid, int(tid)) for tid in tids[:limit])
    if len(tids) > limit:
        out.append(f"... {len(tids) - limit} more threads")
    return "; ".join(out)


def thread_line(pid: int, tid: int) -> str:
    """One thread: "tid comm state wchan=... stack=a<b<c" (the stack needs root)."""
    t = f"{PROC}/{pid}/task/{tid}"
    rd = read_or_empty
    st = parse_stat(rd(f"{t}/stat"), tid)
    stack = [ln.split("] ", 1)[-1].split("+")[0] for ln in rd(f"{t}/stack").splitlines()[:3]]
    return f"{tid} {rd(f'{t}/comm') or '?'} {st.state if st else 'gone'} wchan={rd(f'{t}/wchan') or '-'}" + (
        f" stack={'<'.join(stack)}" if stack else ""
    )


def stopped(pid: int) -> bool:
    return all(s in STOPPED_STATES for s in task_states(pid))


def still_running(pid: int) -> bool:
    """Best guess whether a process in a freezing cgroup has not stopped yet.

    A v2-frozen task sleeps ('S') in the freezer trap, a v1-frozen one shows 'D' in
    __refrigerator; a straggler is running ('R') or stuck in some other 'D' wait (a driver call).
    """
    try:
        tids = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        base = f"{PROC}/{pid}/task/{tid}"
        try:
            st = parse_stat(read(f"{base}/stat"), int(tid))
        except (OSError, ValueError):
            continue
        if st is None:
            continue
        if st.state == "R":
            return True
        if st.state == "D":
            try:
                if read(f"{base}/wchan").strip() != "__refrigerator":
                    return True
            except OSError:
                return True
    return False


# Where a stopped thread sleeps: the v2 freezer's trap (inlined into get_signal on newer
# kernels, e.g. 6.18), the v1 freezer's refrigerator.
_FROZEN_WCHANS = frozenset({"do_freezer_trap", "get_signal", "__refrigerator"})


def unfrozen_threads(pids: Iterable[int], limit: int = 6) -> list[str]:
    """Threads of `pids` that a freeze has not stopped yet, for a slow freeze's record:
    "pid/tid comm state wchan stack-top", at most `limit`. A thread counts as stopped in
    the freezer's trap (wchan, both cgroup versions) or as a zombie."""
    out: list[str] = []
    for pid in pids:
        try:
            tids = sorted(os.listdir(f"{PROC}/{pid}/task"), key=int)
        except OSError:
            continue
        for tid in tids:
            base = f"{PROC}/{pid}/task/{tid}"
            try:
                st = parse_stat(read(f"{base}/stat"), int(tid))
                wchan = read(f"{base}/wchan").strip()
            except (OSError, ValueError):
                continue
            if st is None or st.state in "ZX" or wchan in _FROZEN_WCHANS:
                continue
            try:
                top = read(f"{base}/stack").splitlines()[:1]
            except OSError:
                top = []
            where = top[0].split("] ", 1)[-1].split("+")[0] if top else "-"
            out.append(f"{pid}/{tid} {read(f'{base}/comm').strip()} {st.state} {wchan or '-'} {where}")
            if len(out) >= limit:
                return out
    return out


def self_and_ancestors() -> set[int]:
    pids: set[int] = set()
    pid = os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        st = pid_stat(pid)
        pid = st.ppid if st else 0
    return pids
