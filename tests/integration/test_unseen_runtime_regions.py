"""A sibling left running under `--freeze gpu`, quiet since its last drain, that loads a
library bringing its own CUDA runtime (`__cudaRegisterFatBinary` outside libcudart) and
launches through it, past every hook: just before another command's region, or inside it.
The region is flagged with why (or the sibling's work is drained and it is frozen), never
clean with the sibling's kernel inside it on the simulated GPU's timeline. A sibling whose
drain helper cannot answer the region end's look flags the region, and the end waits for
it at most KREX_LOOK_TIMEOUT_MS. A real krexd, `krex run` guardians, cgroups, the shim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.krex_world import Krex
from helpers.unseen_runtime import (
    SIBLING,
    end,
    hidden_op,
    hold,
    lines,
    load_in_region,
    overlaps,
    quiet,
    quiet_sibling,
    step,
    unseen_reason,
    world,
)

from krex.native import lib
from krex.node.shm import Segment

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups"),
]


def test_a_runtime_loaded_by_a_quiet_sibling_just_before_a_region_never_leaves_it_clean(
    kx: Krex, tmp_path: Path
) -> None:
    """Loaded and launched through right after the owner's first region drained the sibling
    (its helper's next look between drains is up to a second away), and the owner's next
    region begins at once: its drain request makes the helper look before it acks as quiet,
    and krexd judges the records again at the end. Flagged, or drained (its kernel over by
    the grant) and frozen: never clean with the kernel inside it."""
    so = world(kx, tmp_path)
    kx.start_daemon(slots=4)
    kx.run_argv("sib", [sys.executable, "-c", SIBLING, str(so), str(kx.out), "2000000"])  # 2 s
    sib = int(step(kx, "sib", "ready")["pid"])
    go = kx.out / "b.go"
    kx.run("b", "regions", "-n", "1", "--kernels", "0", "--sleep-ms", "200", "--go", str(go), "--prime")
    kx.wait(lambda: (kx.out / "b.waiting").exists(), 30, "the owner's first region")
    kx.wait(lambda: quiet(kx, sib), 10, "the sibling's record to read quiet")
    kx.touch("sib", "go")
    step(kx, "sib", "hidden")
    go.touch()
    res = kx.result("b", timeout=30)
    assert not res["errors"] and len(res["regions"]) == 1, res
    kx.wait(lambda: len([r for r in kx.journal() if r["owner_pid"] == res["pid"]]) == 2, 10, "the journal")
    rec = [r for r in kx.journal() if r["owner_pid"] == res["pid"]][-1]
    kx.touch("sib")
    op = hidden_op(kx, sib)
    if not rec["contaminated"]:
        assert not overlaps(op, rec), (
            f"clean, with the sibling's hidden kernel inside it: op {op['start']}..{op['end']}, "
            f"region {rec['t_grant_ns']}..{rec['t_end_ns']}, frozen {rec['frozen_slots']}"
        )
    else:
        assert "unheld-sibling" in rec["flags"] and unseen_reason(rec, sib), rec["reasons"]


def test_a_runtime_loaded_by_a_running_sibling_during_a_region_flags_it_at_its_end(
    kx: Krex, tmp_path: Path
) -> None:
    """Quiet and held as the region began, so it keeps running; inside the region it loads
    the library and launches through it: the end's look round sees the flag."""
    so = world(kx, tmp_path)
    sib = quiet_sibling(kx, so)
    rec, _ = load_in_region(kx, sib)
    assert "unheld-sibling" in rec["flags"] and unseen_reason(rec, sib), rec["reasons"]
    assert rec.get("look_s") is not None and rec["look_s"] < lib.KREX_LOOK_TIMEOUT_MS / 1e3, rec.get("look_s")


def test_a_runtime_in_a_library_loaded_rtld_local_is_seen_too(kx: Krex, tmp_path: Path) -> None:
    """A library loaded RTLD_LOCAL is outside the global scope that a lookup by name
    (dlsym(RTLD_DEFAULT)) searches: the helper reads every loaded object's own symbols, so
    its runtime flags the region it loaded and launched in all the same."""
    so = world(kx, tmp_path)
    sib = quiet_sibling(kx, so, mode="local")
    rec, _ = load_in_region(kx, sib)
    assert "unheld-sibling" in rec["flags"] and unseen_reason(rec, sib), rec["reasons"]


def test_a_sibling_inside_a_slow_library_load_answers_the_look_at_once(kx: Krex, tmp_path: Path) -> None:
    """A sibling inside a dlopen whose constructors take long (a cuBLAS or cuDNN load: the
    loader's big lock held meanwhile) as the region ends: its helper's look takes no lock a
    dlopen holds, so it acks within the bound and the region stays clean (the library brings
    no runtime). A look through dlsym would wait for the whole load and flag the region."""
    world(kx, tmp_path)
    src = tmp_path / "slow.c"
    marker = kx.out / "slow.loading"
    src.write_text(
        "#include <stdio.h>\n#include <unistd.h>\n"
        f'__attribute__((constructor)) static void slow(void) {{ fclose(fopen("{marker}", "w")); '
        "usleep(1500000); }\n"
    )
    so = tmp_path / "libslow.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    sib = quiet_sibling(kx, so, us=0)
    ready = hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    kx.touch("sib", "go")
    kx.wait(marker.exists, 30, "the sibling inside the library's constructor")
    rec = end(kx, "b", ready["pid"])
    still_loading = not any(d.get("step") == "loaded" for d in lines(kx, "sib"))
    kx.touch("sib")
    assert still_loading, "the load ended before the region did: the test would prove nothing"
    assert not rec["contaminated"], rec["reasons"]
    assert rec.get("look_s") is not None and rec["look_s"] < lib.KREX_LOOK_TIMEOUT_MS / 1e3, rec.get("look_s")
    flags = next((p.flags for p in kx.snapshot().procs if p.pid == sib), None)
    assert flags is not None and "unseen-runtime" not in flags, flags


def test_a_running_sibling_that_cannot_answer_the_look_flags_the_region_within_its_bound(
    kx: Krex, tmp_path: Path
) -> None:
    """Stopped (by someone else than krexd) while a region runs: its helper cannot look at
    what it loaded. The region is flagged, and its end waits for it no longer than the
    bound."""
    so = world(kx, tmp_path)
    sib = quiet_sibling(kx, so)
    ready = hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    os.kill(sib, signal.SIGSTOP)
    try:
        time.sleep(0.05)
        rec = end(kx, "b", ready["pid"])
    finally:
        os.kill(sib, signal.SIGCONT)
    kx.touch("sib", "go")
    kx.touch("sib")
    assert "unheld-sibling" in rec["flags"], rec["reasons"]
    assert any(f"[{sib}]" in r and "did not look" in r for r in rec["reasons"]), rec["reasons"]
    bound = lib.KREX_LOOK_TIMEOUT_MS / 1e3
    assert bound <= rec["look_s"] < bound + 0.25, rec["look_s"]


def test_a_look_is_owed_by_a_live_helper_until_it_acks_and_by_an_exit_until_its_own_look() -> None:
    """krex_look_pending on a record of a live process: owed from the request until the
    helper's ack; by a process inside its exit (its helper stopped) until its exit handler
    looked; never by a record with no helper (krexd judges it unheld) or of another pid."""
    name = f"/krex-look-{os.getpid()}"
    child = subprocess.Popen(["sleep", "30"])
    try:
        with Segment.create(name, n_gpus=1) as seg:
            raw = seg.raw
            i = int(lib.krex_proc_register(raw, 2, 0, child.pid))
            p = raw.procs[i]
            p.helper_tid = child.pid

            def owed(seq: int) -> bool:
                return child.pid in seg.wait_look(0, [child.pid, 1], seq, 0.0).stragglers

            seq = seg.look_request(0)
            assert int(raw.gpus[0].look_seq) == seq == int(raw.gpus[0].drain_seq)
            assert owed(seq) and not seg.wait_look(0, [1], seq, 0.0).stragglers
            p.look_ack = seq
            assert not owed(seq)
            seq = seg.look_request(0)
            assert owed(seq)
            p.helper_tid = 0
            assert not owed(seq)  # no helper, not exiting: judged by its record instead
            p.flags |= lib.KREX_PF_IN_EXIT
            assert owed(seq)
            p.exit_looked = 1
            assert not owed(seq)
            assert seg.bypass_procs(0, 1) == {}
            p.flags |= lib.KREX_PF_UNSEEN
            start = int(lib.krex_pid_start_ticks(child.pid))
            assert seg.bypass_procs(0, 1) == {(child.pid, start): int(lib.KREX_PF_UNSEEN)}
            assert seg.bypass_procs(0, 2) == {}  # the owner's own
    finally:
        child.kill()
        child.wait()
        Segment.unlink(name)
