"""The error hierarchy. Every failure the library reports is a KrexError with a
`fix` hint; the CLI maps `exit_code` to the process exit status in one place
(cli/main.py). The library itself never prints."""

from __future__ import annotations

import errno


class KrexError(Exception):
    exit_code = 1

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


class UsageError(KrexError):
    """Bad arguments or a malformed KREX_* variable."""

    exit_code = 2


class NotFound(KrexError):
    """No segment, no daemon, unknown GPU, missing library."""

    exit_code = 3


class PermissionDenied(KrexError):
    exit_code = 4


class Timeout(KrexError):
    """Stragglers did not finish in time (pause, region entry)."""

    exit_code = 5

    def __init__(self, message: str, fix: str = "", stragglers: list[int] | None = None) -> None:
        super().__init__(message, fix)
        self.stragglers = stragglers or []


class Busy(KrexError):
    """The thing asked for is held by someone else (a gate, a daemon, a slot)."""

    exit_code = 6


class DaemonLost(KrexError):
    """krexd closed the connection or went away in the middle of a request."""


class MpsUnavailable(KrexError):
    """krexd was asked for NVIDIA MPS and cannot start or attach to its control daemon:
    it refuses to start rather than run without it."""


class CommandNotFound(KrexError):
    exit_code = 127


class NotExecutable(KrexError):
    exit_code = 126


# The one errno -> error kind mapping; every OSError the library turns into a
# KrexError picks its kind here (the message and the fix stay the caller's).
ERRNO_KINDS: dict[int, type[KrexError]] = {
    errno.EPERM: PermissionDenied,
    errno.EACCES: PermissionDenied,
    errno.EROFS: PermissionDenied,
    errno.ENOENT: NotFound,
    errno.ESRCH: NotFound,
}


def error_kind(err: int | OSError | None) -> type[KrexError]:
    """The KrexError subclass for an errno (or an OSError's errno); KrexError when
    the errno says nothing more specific."""
    code = err.errno if isinstance(err, OSError) else err
    return ERRNO_KINDS.get(code, KrexError) if code is not None else KrexError


RUN_FAILURE = 125  # `krex run`: KREX itself failed (as `docker run` and `env` do)


def run_exit_code(e: KrexError) -> int:
    """`krex run`'s status for a KREX error: 126/127 keep their shell meaning (the
    command cannot be executed / was not found); every other KREX failure is 125,
    so it never collides with a status the command itself returns."""
    return e.exit_code if isinstance(e, (CommandNotFound, NotExecutable)) else RUN_FAILURE
