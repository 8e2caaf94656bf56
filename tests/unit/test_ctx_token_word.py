"""The node's context-creation token word (interpose/ctx_token.c, krex_abi.h
KREX_CTX_TOKEN_LEASE_MS): who holds it, its lease, a dead holder's takeover, giving it back
only while still held, and krexd's drop of a frozen holder's token."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from krex.native import lib
from krex.node.shm import Segment

LEASE_NS = lib.KREX_CTX_TOKEN_LEASE_MS * 1_000_000


@pytest.fixture
def seg() -> Iterator[Segment]:
    name = f"/krex-ctxtok-{os.getpid()}"
    s = Segment.create(name, 1)
    try:
        yield s
    finally:
        s.close()
        Segment.unlink(name)


def test_the_word_names_its_holder_and_lapses_at_the_lease() -> None:
    now = lib.krex_now_ns()
    w = lib.krex_ctx_token_word(4321, now)
    assert w != 0 and lib.krex_ctx_token_pid(w) == 4321
    assert not lib.krex_ctx_token_lapsed(w, now)
    assert not lib.krex_ctx_token_lapsed(w, now + LEASE_NS - 1_000_000)
    assert lib.krex_ctx_token_lapsed(w, now + LEASE_NS + 1_000)
    # A pid that does not fit, or one in another pid namespace: 0, the lease still holds.
    assert lib.krex_ctx_token_pid(lib.krex_ctx_token_word(1 << 30, now)) == 0
    # A word whose lease ends further off than one lease is no holder's (another clock, garbage).
    assert lib.krex_ctx_token_lapsed(lib.krex_ctx_token_word(7, now + 3 * LEASE_NS), now)


def test_one_holder_at_a_time_and_a_give_back_only_while_held(seg: Segment) -> None:
    raw, now, me = seg.raw, lib.krex_now_ns(), os.getpid()
    assert seg.ctx_token_holder() == -1
    held = lib.krex_ctx_token_try(raw, me, now, 1)
    assert held and seg.ctx_token_holder() == me
    assert lib.krex_ctx_token_try(raw, me + 1, now, 1) == 0  # a live holder keeps it
    assert lib.krex_ctx_token_give(raw, held) == 1 and seg.ctx_token_holder() == -1
    held = lib.krex_ctx_token_try(raw, me, now, 1)
    # Its lease ended: another takes it, and the first one's give-back then changes nothing.
    later = lib.krex_ctx_token_try(raw, me + 1, now + LEASE_NS + 1_000_000, 1)
    assert later and lib.krex_ctx_token_give(raw, held) == 0
    assert lib.krex_ctx_token_pid(raw.hdr.ctx_token) == me + 1


def test_a_dead_holders_token_is_taken_over_at_once(seg: Segment) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    raw, now = seg.raw, lib.krex_now_ns()
    assert lib.krex_ctx_token_try(raw, p.pid, now, 1)
    assert lib.krex_ctx_token_try(raw, os.getpid(), now, 0) == 0  # no liveness check: the lease holds
    assert lib.krex_ctx_token_try(raw, os.getpid(), now, 1)  # the holder is gone: taken over
    assert seg.ctx_token_holder() == os.getpid()


def test_krexd_drops_the_token_of_a_process_it_froze(seg: Segment) -> None:
    raw, now, me = seg.raw, lib.krex_now_ns(), os.getpid()
    assert lib.krex_ctx_token_try(raw, me, now, 1)
    assert seg.ctx_token_drop([me + 1]) == 0 and seg.ctx_token_holder() == me
    assert seg.ctx_token_drop([me + 1, me]) == me and seg.ctx_token_holder() == -1
