"""Where KREX keeps its node state: socket, lock, journal, log.

On a shared node another user can pre-create the default state directory
(/tmp/krex-<uid>) and plant symlinks in it. So a directory KREX writes into must
be a real directory owned by the caller (or root) that nobody else can write,
and every file in it is opened with O_NOFOLLOW and checked after opening
(`open_private`). A client that only connects accepts a directory owned by
someone else when the user named it (KREX_STATE_DIR / KREX_SOCKET: a daemon
shared with a group), never the derived default."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from krex.errors import PermissionDenied, UsageError

_FIX_DIR = "set KREX_STATE_DIR to a directory of your own (mode 0700 or 0750)"


SOCKET_NAME = "krexd.sock"  # inside a state directory (fleet builds one per Ray node)
JOURNAL_NAME = "journal.jsonl"


def state_dir() -> Path:
    """$KREX_STATE_DIR, else /run/krex for root, else a per-user directory."""
    raw = os.environ.get("KREX_STATE_DIR")
    if raw:
        p = Path(raw)
    elif os.geteuid() == 0:
        p = Path("/run/krex")
    else:
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/krex-{os.getuid()}"
        p = Path(base) / "krex" if os.environ.get("XDG_RUNTIME_DIR") else Path(base)
    return p


def explicit() -> bool:
    """Did the user name the state location (rather than take the derived default)?"""
    return bool(os.environ.get("KREX_STATE_DIR") or os.environ.get("KREX_SOCKET"))


def check_dir(p: Path, what: str = "KREX state directory", shared_ok: bool = False) -> None:
    """Refuse a directory that is a symlink, not a directory, owned by another user
    (unless `shared_ok`) or writable by others. A writer (`shared_ok=False`) also
    refuses a group-writable one: group members could swap the files in it."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise PermissionDenied(f"the {what} {p} does not exist", _FIX_DIR) from None
    except OSError as e:
        raise PermissionDenied(f"cannot inspect the {what} {p}: {e.strerror}", _FIX_DIR) from e
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise PermissionDenied(
            f"the {what} {p} is a symbolic link: refusing to use it (someone may have planted it)",
            f"remove {p}, or {_FIX_DIR}",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionDenied(f"the {what} {p} is not a directory", f"remove {p}, or {_FIX_DIR}")
    if st.st_uid not in (me, 0) and not shared_ok:
        raise PermissionDenied(
            f"the {what} {p} belongs to uid {st.st_uid}, not to you (uid {me}): refusing to use it",
            f"remove {p} (as its owner or root), or {_FIX_DIR}",
        )
    bad = stat.S_IWOTH if shared_ok else stat.S_IWOTH | stat.S_IWGRP
    if st.st_mode & bad:
        who = "everyone" if st.st_mode & stat.S_IWOTH else "its group"
        raise PermissionDenied(
            f"the {what} {p} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by {who}: refusing to use it",
            f"chmod go-w {p} if it is yours, else {_FIX_DIR}",
        )


def ensure_state_dir() -> Path:
    """Create (if needed) and check the state directory for writing: the daemon's
    socket, lock, log and journal go here."""
    p = state_dir()
    try:
        p.mkdir(mode=0o750, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a dangling symlink or a file: check_dir says which
    except OSError as e:
        raise PermissionDenied(
            f"cannot create the KREX state directory {p}: {e.strerror}",
            "set KREX_STATE_DIR to a writable directory",
        ) from e
    check_dir(p)
    if not os.access(p, os.W_OK):
        raise PermissionDenied(
            f"the KREX state directory {p} is not writable", "set KREX_STATE_DIR to a writable directory"
        )
    return p


def ensure_dir(p: Path, what: str) -> Path:
    """Like ensure_state_dir for the directory of KREX_SOCKET or KREX_JOURNAL."""
    try:
        p.mkdir(mode=0o750, parents=True, exist_ok=True)
    except FileExistsError:
        pass
    except OSError as e:
        raise PermissionDenied(
            f"cannot create the {what} {p}: {e.strerror}",
            "set KREX_SOCKET (or KREX_STATE_DIR) to a writable place",
        ) from e
    check_dir(p, what)
    return p


def check_for_client() -> None:
    """A client that connects (and writes nothing) checks the socket's directory:
    never a foreign or world-writable default; a named shared one is accepted."""
    d = socket_path().parent
    if d.exists() or d.is_symlink():
        check_dir(d, "KREX socket directory", shared_ok=explicit())


def open_private(path: Path, flags: int, mode: int = 0o640) -> int:
    """os.open with O_NOFOLLOW|O_CLOEXEC, then insist on a regular file with one
    link that belongs to us: a planted symlink, hard link or foreign file is refused."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the last component is a symlink
            raise PermissionDenied(
                f"{path} is a symbolic link: refusing to follow it", f"remove {path}; {_FIX_DIR}"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionDenied(
            f"{path} is not a private regular file of yours (uid {st.st_uid}, {st.st_nlink} link(s)): "
            "refusing to use it",
            f"remove {path}; {_FIX_DIR}",
        )
    return fd


def socket_path() -> Path:
    raw = os.environ.get("KREX_SOCKET")
    if raw:
        if len(raw.encode()) > 100:
            raise UsageError(
                f"KREX_SOCKET={raw!r} is longer than a Unix socket path may be",
                "use a path of at most 100 bytes",
            )
        return Path(raw)
    return state_dir() / SOCKET_NAME


def journal_path() -> Path:
    return Path(os.environ.get("KREX_JOURNAL") or state_dir() / JOURNAL_NAME)


def lock_path() -> Path:
    return socket_path().with_suffix(".lock")


def log_path() -> Path:
    return state_dir() / "krexd.log"


def read_lock_pid(lp: Path) -> int | None:
    """The pid a daemon wrote into its lock file, if any."""
    try:
        fd = os.open(lp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 32).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return int(raw) if raw.isdigit() else None


def lock_holder(lp: Path | None = None) -> int | None:
    """The pid that holds the daemon lock (flock), from /proc/locks: the daemon that
    runs, whether or not its socket still exists. Reading /proc/locks never takes
    the lock, so it cannot make a starting daemon think another one runs."""
    lp = lp or lock_path()
    try:
        st = os.stat(lp, follow_symlinks=False)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" marks a waiter)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                pid = int(parts[4])
            except ValueError:
                continue
            if pid > 0 and os.path.exists(f"/proc/{pid}"):
                return pid
    return None
