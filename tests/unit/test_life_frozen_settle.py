"""What a sibling frozen inside a LIFE call had queued (krex/node/unheld.py,
life_frozen_settle): on the simulated GPU the device timeline says when it ends, and the
region waits until then, or is flagged when that is past the drain timeout; on a real GPU
a fixed short wait."""

from __future__ import annotations

import os
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex.node import unheld


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A simulated device model's shared memory (struct sim_dev_shm) of our own, krexd's
    own too (KREX_SIM_SHM): no other test's device is read."""
    name = f"/krex-test-lfs-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KREX_SIM_SHM", name)
    path = Path("/dev/shm") / name.lstrip("/")
    yield name, path
    path.unlink(missing_ok=True)


def _busy_until(path: Path, ns: int) -> None:
    path.write_bytes(struct.pack("<II", 0x53494D47, 1) + struct.pack("<16Q", ns, *([0] * 15)))


def test_the_region_waits_until_the_simulated_device_has_run_what_was_queued(
    device: tuple[str, Path],
) -> None:
    name, path = device
    _busy_until(path, time.monotonic_ns() + 80_000_000)
    reasons, waited = unheld.life_frozen_settle("sim", 0, [os.getpid()], 5.0, lambda _pid: name)
    assert reasons == []
    assert 0.06 < waited < 1.0, waited


def test_work_queued_past_the_drain_timeout_flags_the_region(device: tuple[str, Path]) -> None:
    name, path = device
    _busy_until(path, time.monotonic_ns() + 10_000_000_000)
    reasons, waited = unheld.life_frozen_settle("sim", 0, [4242], 0.5, lambda _pid: name)
    assert [f for f, _t in reasons] == [unheld.LIFE_FLAG] and "4242" in reasons[0][1], reasons
    assert waited < 0.4


def test_a_real_gpu_waits_the_fixed_settle_and_no_sibling_waits_nothing() -> None:
    _r, waited = unheld.life_frozen_settle("nvidia", 0, [4242], 5.0, lambda _pid: None)
    assert unheld.LIFE_FROZEN_SETTLE_S <= waited < unheld.LIFE_FROZEN_SETTLE_S + 0.1
    assert unheld.life_frozen_settle("nvidia", 0, [], 5.0, lambda _pid: None) == ([], 0.0)
