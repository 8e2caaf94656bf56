"""How long a slot's processes ran on a region core during a region.

Moving threads off the region core at entry (cpus.evict) and checking masks at the end
(cpus.audit) cannot see a process that pins itself to the core and ends within the region:
a sibling's short-lived children, which inherit its narrowed mask and then set their own.
The kernel can: a perf counter of software CPU time (`cpu-clock`) opened on one CPU for one
cgroup counts every nanosecond any task of that cgroup (or a cgroup below it) runs on that
CPU, processes that come and go included. Its samples (one every SAMPLE_NS of that time)
name the processes, so a region flagged for them says which.

Needs a cgroup v2 directory (the slot's freezer group under the cgroup2 backend) and the
right to watch a whole CPU (root, CAP_PERFMON, or kernel.perf_event_paranoid <= 0); where
either is missing, `available` says why and krexd does not lend region cores. Linux only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import struct
import threading
from dataclasses import dataclass, field

from krex.errors import KrexError, PermissionDenied, error_kind

__all__ = ["CoreWatch", "Usage", "available", "watch"]

_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_PERF_TYPE_SOFTWARE = 1
_PERF_COUNT_SW_CPU_CLOCK = 0
_PERF_SAMPLE_TID = 1 << 1
_PERF_FLAG_PID_CGROUP = 1 << 2
_PERF_FLAG_FD_CLOEXEC = 1 << 3
_ATTR_DISABLED = 1 << 0
_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7: every field we set is in the first 64 bytes
_IOC_ENABLE, _IOC_DISABLE, _IOC_RESET = 0x2400, 0x2401, 0x2403
_RECORD_SAMPLE = 9
SAMPLE_NS = 100_000  # one sample per 0.1 ms a watched process runs on the core
_DATA_PAGES = 16  # 64 KiB of samples: 4096 of them, 0.4 s on the core, names enough

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Usage:
    """What one watch saw: `ns` of CPU time on `cpu`, and pids named by its samples."""

    cpu: int
    ns: int = 0
    pids: set[int] = field(default_factory=set)


def _open(cgroup_dir: str, cpu: int, sample: bool) -> int:
    if _NR_PERF_EVENT_OPEN is None:
        raise KrexError(f"no perf_event_open number known for {platform.machine()}", "")
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into(
        "IIQQQQQ",
        attr,
        0,
        _PERF_TYPE_SOFTWARE,
        _ATTR_SIZE,
        _PERF_COUNT_SW_CPU_CLOCK,
        SAMPLE_NS if sample else 0,
        _PERF_SAMPLE_TID if sample else 0,
        0,  # read_format: the bare count
        _ATTR_DISABLED,
    )
    buf = ctypes.create_string_buffer(bytes(attr), _ATTR_SIZE)
    try:
        cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise KrexError(f"cannot open the cgroup {cgroup_dir}: {e.strerror}", "") from e
    try:
        fd = _libc.syscall(
            _NR_PERF_EVENT_OPEN, buf, cg, cpu, -1, _PERF_FLAG_PID_CGROUP | _PERF_FLAG_FD_CLOEXEC
        )
        err = ctypes.get_errno()
    finally:
        os.close(cg)
    if fd < 0:
        kind = error_kind(err)
        words = {errno.EBADF: "not a cgroup v2 directory", errno.ENOSYS: "the kernel has no perf events"}
        why = (
            "not permitted (needs root, CAP_PERFMON or kernel.perf_event_paranoid <= 0)"
            if kind is PermissionDenied
            else words.get(err, os.strerror(err))
        )
        raise kind(f"cannot count CPU {cpu} time of cgroup {cgroup_dir}: {why}", "")
    return int(fd)


class CoreWatch:
    """One counter: the time the processes of `cgroup_dir` run on `cpu` between start() and
    stop(). Opened once per slot and kept (opening costs a region's entry 0.1-0.5 ms per
    counter; starting and stopping, two ioctls); close() when the slot goes."""

    def __init__(self, cgroup_dir: str, cpu: int) -> None:
        self.cpu = cpu
        self.fd = _open(cgroup_dir, cpu, sample=True)
        self.ring: mmap.mmap | None = None
        self.lock = threading.Lock()
        self.running = False
        self.doomed = False  # close() came while it ran: stop() closes it
        try:
            # Writable: the kernel then stops at a full buffer instead of overwriting.
            self.ring = mmap.mmap(self.fd, (1 + _DATA_PAGES) * mmap.PAGESIZE)
        except OSError:
            self.ring = None  # counted all the same, only not named

    def start(self) -> None:
        with self.lock:
            if self.fd < 0:
                raise KrexError("the region core's counter was closed", "")
            self._skip_samples()
            fcntl.ioctl(self.fd, _IOC_RESET, 0)
            fcntl.ioctl(self.fd, _IOC_ENABLE, 0)
            self.running = True

    def stop(self) -> Usage:
        """Stop counting; what it counted since start()."""
        use = Usage(self.cpu)
        with self.lock:
            if self.fd < 0:
                return use
            try:
                fcntl.ioctl(self.fd, _IOC_DISABLE, 0)
                raw = os.read(self.fd, 8)
                use.ns = struct.unpack("Q", raw)[0] if len(raw) == 8 else 0
                if self.ring is not None:
                    use.pids = self._sampled()
            finally:
                self.running = False
                if self.doomed:
                    self._close()
        return use

    def _data(self) -> tuple[int, int, int, int]:
        assert self.ring is not None
        head = struct.unpack_from("Q", self.ring, 1024)[0]  # perf_event_mmap_page.data_head
        tail = struct.unpack_from("Q", self.ring, 1032)[0]  # .data_tail (ours to advance)
        off, size = struct.unpack_from("QQ", self.ring, 1040)  # .data_offset, .data_size
        if not size:  # a kernel before 4.1: the data starts at the second page
            off, size = mmap.PAGESIZE, _DATA_PAGES * mmap.PAGESIZE
        return head, tail, off, size

    def _skip_samples(self) -> None:
        if self.ring is not None:
            head = self._data()[0]
            struct.pack_into("Q", self.ring, 1032, head)

    def _sampled(self) -> set[int]:
        """The pids of the samples since the last read (the ring wraps); marks them read."""
        assert self.ring is not None
        head, tail, off, size = self._data()
        n = min(head - tail, size)
        start = (head - n) % size
        if start + n <= size:
            buf = self.ring[off + start:off + start + n]
        else:
            buf = self.ring[off + start:off + size] + self.ring[off:off + (start + n - size)]
        struct.pack_into("Q", self.ring, 1032, head)
        pos, out = 0, set()
        while pos + 8 <= len(buf):
            kind, _misc, length = struct.unpack_from("IHH", buf, pos)
            if length < 8:
                break
            if kind == _RECORD_SAMPLE and length >= 16 and pos + 16 <= len(buf):
                pid, _tid = struct.unpack_from("II", buf, pos + 8)
                out.add(int(pid))
            pos += length
        return out

    def close(self) -> None:
        """Close it now, or, while it counts a region, once that region's stop() has read it."""
        with self.lock:
            if self.running:
                self.doomed = True
            else:
                self._close()

    def _close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def watch(cgroup_dir: str, cpus: list[int]) -> list[CoreWatch]:
    """A CoreWatch (not started) per CPU of `cpus` for the processes of `cgroup_dir`. Raises
    KrexError (what is missing) when they cannot be counted; none is left open then."""
    out: list[CoreWatch] = []
    try:
        for c in cpus:
            out.append(CoreWatch(cgroup_dir, c))
    except (KrexError, OSError):
        for w in out:
            w.close()
        raise
    return out


def available(cgroup_dir: str | None, cpu: int) -> str | None:
    """None if CPU `cpu` can be watched for the cgroups under `cgroup_dir` (krexd's freezer
    root, cgroup v2), else why not."""
    if cgroup_dir is None:
        return "the freezer is not cgroup v2 (the region core is watched per slot cgroup)"
    try:
        os.close(_open(cgroup_dir, cpu, sample=False))
    except KrexError as e:
        return str(e)
    return None
