"""krex.region()'s own bookkeeping (the process lock, nesting depth, soft regions, fork),
against a fake krexd connection: real threads, real fork, real signals. Each of these once
left a later region a silent no-op or ran a benchmark unprotected without a word."""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from krex.errors import Busy
from krex.proc import region as R


class FakeKrexd:
    """Answers begin/end; a begin may be held (`hold`) or refused (`refuse`)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.refuse = False
        self.refuse_next = 0  # refuse this many begins, then go by `refuse`
        self.interrupt_begin = False

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "begin":
            if self.interrupt_begin:
                self.interrupt_begin = False
                raise KeyboardInterrupt
            self.hold.wait()
            if self.refuse_next:
                self.refuse_next -= 1
                raise Busy("no region for you", "ask again")
            if self.refuse:
                raise Busy("no region for you", "ask again")
        self.log.append((op, os.getpid()))
        return {"ok": True, "clean": True, "region": {}} if op == "end" else {"ok": True}

    def close(self) -> None:
        pass


def lock_free() -> bool:
    """Can another thread take the process lock now? (RLock has no locked() before 3.14.)"""
    got: list[bool] = []

    def probe() -> None:
        ok = R._proc_lock.acquire(blocking=False)
        if ok:
            R._proc_lock.release()
        got.append(ok)

    t = threading.Thread(target=probe)
    t.start()
    t.join(5)
    return got == [True]


def region_in_thread() -> tuple[threading.Thread, threading.Event]:
    """Another thread that takes a region and holds it until the returned event is set."""
    a_in, a_out = threading.Event(), threading.Event()

    def thread_a() -> None:
        with R.region():
            a_in.set()
            a_out.wait(5)

    ta = threading.Thread(target=thread_a)
    ta.start()
    a_in.wait(5)
    return ta, a_out


def interrupted_region(after_s: float) -> None:
    """Enter a region with SIGALRM raising KeyboardInterrupt `after_s` in; it must raise."""
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.setitimer(signal.ITIMER_REAL, after_s)
    try:
        with pytest.raises(KeyboardInterrupt), R.region():
            pass
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def krexd(monkeypatch: pytest.MonkeyPatch) -> FakeKrexd:
    fake = FakeKrexd()
    monkeypatch.setenv("KREX_SHM", "/krex-fake")
    monkeypatch.setattr(R, "_get_client", lambda: fake)
    monkeypatch.setattr(R, "_our_gate_word", lambda: 0)
    yield fake
    assert lock_free(), "a region left the process lock held"
    assert getattr(R._local, "depth", 0) == 0, "a region left a nesting depth behind"


def test_an_interrupt_while_a_region_is_requested_leaves_no_lock_or_depth(krexd: FakeKrexd) -> None:
    krexd.interrupt_begin = True
    with pytest.raises(KeyboardInterrupt), R.region():
        pass
    # The next region is a real one, not a nested no-op.
    with R.region() as r:
        assert r._active
    assert krexd.log == [("begin", os.getpid()), ("end", os.getpid())]


def test_a_signal_handler_raising_mid_begin_is_recovered_from(krexd: FakeKrexd) -> None:
    """The interrupt as a real signal, delivered while begin waits for its grant."""
    krexd.hold.clear()
    threading.Timer(0.2, krexd.hold.set).start()
    interrupted_region(0.05)
    krexd.hold.set()
    with R.region() as r:
        assert r._active


def test_an_interrupt_while_waiting_for_another_threads_region_leaves_no_depth(krexd: FakeKrexd) -> None:
    """Ctrl-C while blocked behind another thread's region: the next region is real."""
    ta, a_out = region_in_thread()
    interrupted_region(0.1)
    a_out.set()
    ta.join(5)
    with R.region() as r:
        assert r._active, "the region after the interrupt was a silent no-op"
    assert [op for op, _ in krexd.log] == ["begin", "end", "begin", "end"]


def test_a_child_forked_inside_a_region_is_not_its_owner(krexd: FakeKrexd) -> None:
    rd, wr = os.pipe()
    with R.region() as outer:
        assert outer._active
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            ok = 0
            try:
                # The child starts afresh: a region of its own is real, not nested.
                with R.region() as mine:
                    ok = int(mine._active)
                outer.__exit__(None, None, None)  # leaving the inherited region ends nothing
                ends = sum(1 for op, p in krexd.log if op == "end" and p == os.getpid())
                ok = ok and ends == 1 and lock_free() and R._local.depth == 0
            finally:
                os.write(wr, b"1" if ok else b"0")
                os._exit(0)
        os.close(wr)
        got = os.read(rd, 1)
        os.waitpid(pid, 0)
        assert got == b"1", "the forked child's regions were no-ops or it ended its parent's region"
        assert not lock_free()  # the parent still holds its region
    assert [op for op, p in krexd.log if p == os.getpid()] == ["begin", "end"]


def test_a_soft_region_waits_for_another_threads_region_still_awaiting_its_grant(krexd: FakeKrexd) -> None:
    krexd.hold.clear()
    granted_at: list[float] = []
    a_in = threading.Event()
    a_out = threading.Event()

    def thread_a() -> None:
        with R.region():
            granted_at.append(time.monotonic())
            a_in.set()
            a_out.wait(5)

    ta = threading.Thread(target=thread_a)
    ta.start()
    time.sleep(0.1)  # A holds the process lock and waits for its grant
    soft_done: list[tuple[float, R.region]] = []

    def thread_b() -> None:
        with R.region(soft=True) as r:
            soft_done.append((time.monotonic(), r))

    tb = threading.Thread(target=thread_b)
    tb.start()
    time.sleep(0.3)
    assert not soft_done, "the soft region ran while another thread's region had no grant yet"
    krexd.hold.set()
    a_in.wait(5)
    tb.join(5)
    a_out.set()
    ta.join(5)
    (t_soft, r), = soft_done
    assert t_soft >= granted_at[0]
    assert r.grant is None and not r.unprotected  # it ran inside A's granted region
    assert [op for op, _ in krexd.log] == ["begin", "end"]


def test_a_soft_region_takes_its_own_when_the_other_threads_is_refused(krexd: FakeKrexd) -> None:
    krexd.hold.clear()
    krexd.refuse_next = 1  # A's begin, the first to reach krexd
    errs: list[BaseException] = []

    def thread_a() -> None:
        try:
            with R.region():
                pass
        except Busy as e:
            errs.append(e)

    ta = threading.Thread(target=thread_a)
    ta.start()
    time.sleep(0.1)
    result: list[R.region] = []

    def thread_b() -> None:
        with R.region(soft=True) as r:
            result.append(r)

    tb = threading.Thread(target=thread_b)
    tb.start()
    time.sleep(0.1)
    krexd.hold.set()
    ta.join(5)
    tb.join(5)
    assert len(errs) == 1
    (r,) = result
    assert r.grant == {"ok": True} and not r.unprotected  # its own region
    assert [op for op, _ in krexd.log] == ["begin", "end"]


def test_a_soft_region_that_waits_too_long_says_it_is_unprotected(
    krexd: FakeKrexd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(R, "_SOFT_WAIT_S", 0.3)
    krexd.hold.clear()
    ta = threading.Thread(target=lambda: R.region().__enter__().__exit__(None, None, None))
    ta.start()
    time.sleep(0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        with R.region(soft=True) as r:
            pass
    assert 0.25 <= time.monotonic() - t0 < 3
    assert r.unprotected and r.clean is False and r.flags == ["soft-wait-timeout"]
    assert any("not exclusive" in str(x.message) for x in w)
    krexd.hold.set()
    ta.join(5)


def test_a_refused_soft_region_says_it_is_unprotected(krexd: FakeKrexd) -> None:
    krexd.refuse = True
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with R.region(soft=True) as r:
            pass
    assert r.unprotected and r.flags == ["refused"] and "no region for you" in r.reasons[0]
    with pytest.raises(Busy), R.region():
        pass


def test_the_decorator_keeps_soft(krexd: FakeKrexd) -> None:
    krexd.refuse = True

    @R.region("bench", soft=True)
    def bench() -> int:
        return 7

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert bench() == 7  # a hard region would raise Busy here


def test_an_interrupt_that_lands_as_the_lock_is_taken_leaves_no_lock(krexd: FakeKrexd) -> None:
    """Ctrl-C handled on another thread does not interrupt the main thread's wait for the
    lock: the main thread takes it when thread A's region ends, and the KeyboardInterrupt
    is raised right after the acquire returns (_thread.interrupt_main trips the same flag as
    a real signal)."""
    a_in = threading.Event()

    def thread_a() -> None:
        with R.region():
            a_in.set()
            time.sleep(0.3)  # the main thread now waits for the lock
            _thread.interrupt_main()

    ta = threading.Thread(target=thread_a)
    ta.start()
    a_in.wait(5)
    with pytest.raises(KeyboardInterrupt), R.region():
        pass
    ta.join(5)
    assert lock_free(), "the interrupt left the process lock held: every later region waits forever"


def test_a_soft_region_that_outlives_the_region_it_ran_inside_says_so(krexd: FakeKrexd) -> None:
    ta, a_go = region_in_thread()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with R.region(soft=True) as inside:
            pass  # A's region still runs: fine
        assert not inside.unprotected and not w
        with R.region(soft=True) as r:
            a_go.set()
            ta.join(5)  # A's region is over: the rest of this benchmark has no region
    assert r.unprotected and r.clean is False and r.flags == ["outlived"], (r.unprotected, r.flags)
    assert any("not exclusive" in str(x.message) for x in w)


def test_a_soft_region_never_raises_a_warning_into_the_program(krexd: FakeKrexd) -> None:
    """Under -W error a refused soft region still runs its block, flagged; a hard one raises."""
    krexd.refuse = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with R.region(soft=True) as r:
            ran = True
        assert ran and r.flags == ["refused"]
        krexd.refuse = False
        krexd.hold.set()


def test_a_soft_region_inside_another_processs_region_is_flagged_when_a_new_one_follows(
    krexd: FakeKrexd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside region R1 of another process of its command; R1 ends, another command's region
    runs, R2 of its command begins: at the end the gate is its command's again, but under
    another word (epoch), so it is flagged."""
    gate = {"word": (7 << 8) | 3}
    monkeypatch.setattr(R, "_our_gate_word", lambda: gate["word"])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with R.region(soft=True) as same:
            pass
        assert same.grant is None and not same.unprotected  # R1 lasted the whole benchmark
        with R.region(soft=True) as r:
            assert r.grant is None  # inside R1
            gate["word"] = 0  # R1 ends; another command's region runs
            gate["word"] = (9 << 8) | 3  # R2 of the same command
    assert r.unprotected and r.flags == ["outlived"], (r.unprotected, r.flags)


def test_a_soft_region_that_looks_right_after_the_grant_is_not_flagged_outlived(krexd: FakeKrexd) -> None:
    """Another thread's region is paused right after it marks itself granted (a thread switch
    there): a soft region that looks then runs inside it, and is not flagged `outlived` while
    that region still runs (the grant's number is bumped after that mark)."""
    at_gap, go = threading.Event(), threading.Event()
    lines = Path(R.__file__).read_text().splitlines()
    after = 1 + next(i for i, s in enumerate(lines, 1) if s.strip() == "_granted_tid = threading.get_ident()")

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_filename != R.__file__ or frame.f_code.co_name != "__enter__":
            return None

        def local(f, ev, a):  # type: ignore[no-untyped-def]
            if ev == "line" and f.f_lineno == after and not at_gap.is_set():
                at_gap.set()
                go.wait(5)
            return local

        return local

    a_out = threading.Event()

    def thread_a() -> None:
        sys.settrace(tracer)
        with R.region():
            sys.settrace(None)
            while not a_out.is_set():
                time.sleep(0.005)

    ta = threading.Thread(target=thread_a)
    ta.start()
    assert at_gap.wait(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with R.region(soft=True) as rs:
            go.set()
            time.sleep(0.05)  # A's region is still granted throughout
    a_out.set()
    ta.join(5)
    assert rs.grant is None and rs.flags == [], rs.flags


def test_a_region_waiting_for_a_parked_threads_region_says_it_may_never_end(
    krexd: FakeKrexd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`with krex.region(): pool.submit(timed).result()` with a hard region in `timed` waits
    for ever (the owner waits for the worker): the worker says so, once, with the way out,
    and takes its region as soon as the owner's ends."""
    import concurrent.futures as cf

    monkeypatch.setattr(R, "_HANG_WARN_S", 0.2)
    caught: list[str] = []

    def item() -> bool:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with R.region() as r:
                pass
        caught.extend(str(x.message) for x in w)
        return r.grant is not None

    with cf.ThreadPoolExecutor(1) as ex:
        with R.region():
            fut = ex.submit(item)
            with pytest.raises(cf.TimeoutError):
                fut.result(timeout=0.6)  # the owner parked: the worker waits, and warns
        assert fut.result(timeout=5)  # the owner's region over, the worker's own came
    assert len(caught) == 1 and "soft=True" in caught[0], caught


def test_a_region_waiting_for_a_busy_threads_region_does_not_warn(
    krexd: FakeKrexd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(R, "_HANG_WARN_S", 0.1)
    a_in, a_out = threading.Event(), threading.Event()

    def thread_a() -> None:
        with R.region():
            a_in.set()
            t_end = time.monotonic() + 0.5
            while time.monotonic() < t_end:  # busy, not waiting on anything
                pass
            a_out.set()  # inside: B may run the moment A's region has ended, before A's next line

    ta = threading.Thread(target=thread_a)
    ta.start()
    a_in.wait(5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with R.region() as r:
            assert a_out.is_set()
    ta.join(5)
    assert r.grant is not None and not [x for x in w if "itself waiting" in str(x.message)]


@pytest.mark.parametrize("refused", [True, False])
def test_a_refusal_sent_before_the_request_is_the_error_not_a_lost_daemon(refused: bool) -> None:
    """krexd refuses a connection over its limits with a reply and closes it at once: the
    request may then fail to send (EPIPE). The refusal waiting in the socket is the answer
    (Busy, with its fix); only a close with nothing to say is a lost daemon."""
    import socket

    from krex.errors import DaemonLost
    from krex.node.conns import _refusal
    from krex.proc.client import Client

    mine, krexd = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if refused:
        krexd.sendall(_refusal(Busy("pid 1 already holds 64 connections to krexd", "close some")))
    krexd.close()
    c = Client(mine)
    want = Busy if refused else DaemonLost
    with pytest.raises(want) as e:
        c.request({"op": "hello"})
    assert type(e.value) is want
    if refused:
        assert "64 connections" in str(e.value) and e.value.fix == "close some"
    c.close()
