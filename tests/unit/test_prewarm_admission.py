"""krexd's admission with pre-warmed starts (Daemon._pick_gpu, _promote), on stub slots:
FIFO promotion, a GPU with warm commands is full to newcomers, the slot table's limit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from krex.native import lib
from krex.node.config import Config
from krex.node.daemon import Daemon


class _Stub:
    _load = Daemon._load
    _pick_gpu = Daemon._pick_gpu
    _promote = Daemon._promote

    def __init__(self, gpus: int, per_gpu: int, prewarm: int) -> None:
        self.cfg = Config(prewarm=prewarm, slots_per_gpu=per_gpu)
        self.info = SimpleNamespace(count=gpus)
        self.slots: dict[int, Any] = {}
        self.set_warm: list[tuple[int, int]] = []
        self.seg = SimpleNamespace(raw=None)
        self.changed = SimpleNamespace(notify_all=lambda: None)

    def slots_per_gpu(self, gpu: int) -> int:
        return int(self.cfg.slots_per_gpu or 1)

    def add(self, gpu: int, warm: bool, created: float) -> Any:
        n = len(self.slots)
        s = SimpleNamespace(slot=n, gpu=gpu, warm=warm, created=created, warm_s=None)
        self.slots[n] = s
        return s


def _patch(monkeypatch: Any, stub: _Stub) -> None:
    monkeypatch.setattr(
        "krex.node.slots.lib",
        SimpleNamespace(
            KREX_MAX_SLOTS=lib.KREX_MAX_SLOTS,
            krex_slot_set_warm=lambda raw, n, w: stub.set_warm.append((n, w)),
        ),
    )


def test_free_slot_first_then_prewarm_then_queue(monkeypatch: Any) -> None:
    st = _Stub(gpus=1, per_gpu=2, prewarm=1)
    _patch(monkeypatch, st)
    assert st._pick_gpu(None) == (0, False)
    st.add(0, False, 1.0)
    assert st._pick_gpu(None) == (0, False)
    st.add(0, False, 2.0)
    assert st._pick_gpu(None) == (0, True)
    st.add(0, True, 3.0)
    assert st._pick_gpu(None) is None  # slots and the pre-warmed place taken: queue


def test_promotion_is_oldest_first_and_blocks_newcomers(monkeypatch: Any) -> None:
    st = _Stub(gpus=1, per_gpu=1, prewarm=2)
    _patch(monkeypatch, st)
    st.add(0, False, 1.0)
    late = st.add(0, True, 5.0)
    early = st.add(0, True, 3.0)
    del st.slots[0]  # the running command ends
    # A newcomer never takes the freed slot while pre-warmed ones wait: they go first.
    assert st._pick_gpu(None) == (0, True)
    assert early.warm is False and late.warm is True and st.set_warm == [(early.slot, 0)]


def test_a_prewarmed_start_never_takes_the_last_slot_records(monkeypatch: Any) -> None:
    st = _Stub(gpus=1, per_gpu=64, prewarm=4)
    _patch(monkeypatch, st)
    for i in range(lib.KREX_MAX_SLOTS):
        st.add(0, False, float(i))
    assert st._pick_gpu(None) is None  # queue, not "all 64 slots are taken"
