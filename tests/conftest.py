"""Fixtures shared by the unit and integration tests.

C victims (tests/c/*.c) are compiled once per session against the simulated
GPU in krex/_lib; see tests/helpers."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# A shell without job control starts a background job (`make test &`, nohup) with SIGINT and
# SIGQUIT ignored, and an ignored disposition survives exec: every command and guardian the
# tests start would ignore the Ctrl-C they send. A handler here is reset to the default in
# each child at exec, so the suite behaves the same however it is launched.
for _sig in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import TEST_POLICY, Harness, victims  # noqa: E402

from krex.node.freezer import remove_leftovers  # noqa: E402


@pytest.fixture(scope="session")
def bins() -> dict[str, Path]:
    """{name: executable} for every tests/c/NAME.c, and NAME.cpp where its headers exist."""
    return victims()


@pytest.fixture
def harness(tmp_path: Path, bins: dict[str, Path]) -> Iterator[Harness]:
    """A private KREX segment, simulated device and trace; every child killed
    and every shared-memory name unlinked afterwards."""
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    # An empty collection must fail loudly, never pass as "exit 5" (see .ci/run).
    if not session.items and not session.config.getoption("collectonly"):
        pytest.exit("no tests were collected: the suite is broken", returncode=1)


@pytest.fixture
def krex_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An isolated KREX world for CLI-level tests: own state dir (socket, journal), own
    segment and simulated device, no inherited KREX variables; its daemon is stopped after."""
    import os
    import subprocess

    tag = f"{os.getpid()}-{tmp_path.name[-12:]}"
    env = dict(
        os.environ,
        KREX_STATE_DIR=str(tmp_path / "state"),
        KREX_SHM=f"/krex-t-{tag}",
        KREX_SIM_SHM=f"/krex-tsim-{tag}",
        KREX_SIM_TRACE=str(tmp_path / "trace.jsonl"),
        PYTHONUNBUFFERED="1",
        **TEST_POLICY,
    )
    for k in ("KREX_SOCKET", "KREX_SLOT", "KREX_GPU", "LD_PRELOAD"):
        env.pop(k, None)
    yield env
    subprocess.run(
        [sys.executable, "-m", "krex.cli.main", "daemon", "stop"], env=env, capture_output=True, timeout=30
    )
    for n in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
        Path("/dev/shm" + n).unlink(missing_ok=True)
    for pin in Path("/dev/shm").glob(env["KREX_SHM"].strip("/") + ".krex*"):  # krexd's pin links
        pin.unlink(missing_ok=True)
    remove_leftovers(env["KREX_SHM"])  # a krexd the test killed left its groups
