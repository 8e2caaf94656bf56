"""krex/node/optin.py: the ONE source of the command's environment and of `krex run`'s
notes, shared by both guardians (the native one gets them through krexd's replies)."""

from __future__ import annotations

from krex.node import optin
from krex.proc.envvars import opt_in_env


def test_prepend_puts_krex_first_and_drops_only_its_other_copies() -> None:
    assert optin.prepend("", "/k.so", ": ") == "/k.so"
    assert optin.prepend("/a.so /k.so:/b.so::", "/k.so", ": ") == "/k.so:/a.so:/b.so"
    # PYTHONPATH keeps paths with spaces and the user's own duplicates.
    assert optin.prepend("/p q:/p q:/hook", "/hook", ":") == "/hook:/p q:/p q"


def test_opt_in_env_applies_the_parts() -> None:
    base = {"LD_PRELOAD": "/x.so", "PYTHONPATH": "/a"}
    env = opt_in_env("sim", "/krex-t", base=base)
    put, pre = optin.opt_in_parts("sim", "/krex-t", env["KREX_SOCKET"], None)
    assert env["LD_PRELOAD"] == pre["LD_PRELOAD"][0] + ":/x.so"
    assert env["PYTHONPATH"] == pre["PYTHONPATH"][0] + ":/a"
    assert env["LD_LIBRARY_PATH"] == pre["LD_LIBRARY_PATH"][0]
    assert {k: env[k] for k in ("KREX_SHM", "KREX_DEVICE")} == {"KREX_SHM": "/krex-t", "KREX_DEVICE": "sim"}
    assert "LD_LIBRARY_PATH" not in opt_in_env("gpu", "/krex-t", base=base)


def test_release_notes_in_the_python_guardians_order() -> None:
    regs = [{"contaminated": True, "flags": ["drain-timeout"]}, {"cut": True}, {}]
    tally = optin.region_tally(regs)
    assert tally["region_count"] == 3 and tally["cut_regions"] == 1 and tally["contaminated_regions"] == 1
    again = optin.region_tally(regs[2:], optin.region_tally(regs[:2]))  # krexd's running tally
    assert again == tally
    rel = {"leftovers": [{"pid": 5, "cmd": "sleep 9"}], "action": "killed", "journal_error": "disk full"}
    notes = optin.release_notes(rel, tally)
    assert notes[0] == "krex: 1 process(es) outlived the command and were killed: pid 5 (sleep 9)"
    assert notes[1] == "krex: warning: disk full"
    assert "cut by --max-region" in notes[2] and "drain-timeout x1" in notes[3]
    auto = {"region_count": 0, "auto_region": {"value": "x:y", "processes": 0, "targets": []}}
    assert "KREX_AUTO_REGION='x:y'" in optin.release_notes({}, auto)[0]
    assert optin.start_notes(False) == [] and "SIMULATED" in optin.start_notes(True)[0]


def test_inductor_regions_are_told_apart_by_their_labels() -> None:
    """The labels autoregion gives Inductor's regions: torch's hook, or the whole-call wrapper."""
    from krex.proc.autoregion import inductor

    (t,) = inductor.TARGETS["inductor"]
    assert f"auto:{t.module}:" == optin.INDUCTOR_LABEL
    whole = f"auto:{t.module}:InductorBenchmarker.benchmark_gpu:whole"
    regs = [{"label": f"auto:{t.name}"}, {"label": whole}, {"label": "auto:triton.testing:do_bench"}, {}]
    tally = optin.region_tally(regs)
    assert tally["inductor_regions"] == {"hook": 1, "fallback": 1}
    notes = optin.inductor_notes(tally)
    assert "1 region(s) through KREX's fallback wrapper" in notes[0] and "hook" in notes[1]


def _daemon_env(kind: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """What krexd's _command_env sends for a slot, without a daemon."""
    from types import SimpleNamespace

    from krex.node.daemon import Daemon

    info = SimpleNamespace(kind=kind, visible_token=lambda g: str(g), physical=[0])
    # With MPS on (krex/node/mps.py): the GPU's pipe and log directories and its UUID.
    mps = SimpleNamespace(command_env=lambda g: {"CUDA_MPS_PIPE_DIRECTORY": f"/run/krex/mps/gpu{g}/pipe",
                                                 "CUDA_MPS_LOG_DIRECTORY": f"/run/krex/mps/gpu{g}/log",
                                                 "CUDA_VISIBLE_DEVICES": "GPU-0000"})
    fake = SimpleNamespace(_opt_in={}, shm_name="/krex-t", sock_path="/tmp/k/krexd.sock", info=info, mps=mps)
    slot = SimpleNamespace(slot=3, generation=7)
    return Daemon._command_env(fake, slot, 0, "auto")  # type: ignore[arg-type]


def test_krexd_sends_only_what_a_guardian_takes() -> None:
    """interpose/krex_env.h is the list both guardians keep; krexd sends nothing else,
    so nothing it sends is dropped on the way (a variable added to _command_env must be
    added there too)."""
    import os
    import sys

    for kind in ("sim", "gpu", "amd"):
        put, pre = _daemon_env(kind)
        own_put, own_pre = optin.own_env(put, pre)
        assert own_put == put, set(put) ^ set(own_put)
        assert own_pre == pre, (own_pre, pre)
        assert optin.daemon_cmd_ok(put["KREX_DAEMON_CMD"], [os.path.dirname(sys.executable)])


def test_own_env_keeps_only_this_installations_code() -> None:
    import os
    import sys

    from krex.native import shim_path, sim_dir

    here = os.path.dirname(sys.executable)
    put = {
        "KREX_SLOT": "1",
        "KREX_PYTHON": "/evil/python",
        "BASH_ENV": "/evil/env",
        "KREX_DAEMON_CMD": "touch /tmp/x",
        "CUDA_VISIBLE_DEVICES": 5,  # not a string: dropped
    }
    pre = {"LD_PRELOAD": ["/evil.so", ": "], "PYTHONPATH": ["/evil", ":"], "LD_AUDIT": ["/evil.so", ":"]}
    own_put, own_pre = optin.own_env(put, pre)
    assert own_put == {"KREX_SLOT": "1"}
    assert own_pre == {"LD_PRELOAD": [str(shim_path()), ": "], "PYTHONPATH": [str(optin.hook_dir()), ":"]}
    assert optin.own_env({}, {"LD_LIBRARY_PATH": ["/evil", ":"]})[1]["LD_LIBRARY_PATH"][0] == str(sim_dir())
    ok = f"exec env -u LD_PRELOAD {sys.executable} -m krex.node.daemon --device sim --on-demand"
    assert optin.daemon_cmd_ok(ok, [here])
    for bad in (
        ok.replace(sys.executable, "/usr/local/evil/python3"),  # another Python's directory
        ok + "; touch /tmp/x",
        ok + " $(touch /tmp/x)",
        ok.replace(" -m krex.node.daemon", " -m evil"),
        ok.replace("exec env -u LD_PRELOAD ", "exec env LD_PRELOAD=/evil.so "),
        "exec env -u LD_PRELOAD python3 -m krex.node.daemon",  # not an absolute path
    ):
        assert not optin.daemon_cmd_ok(bad, [here]), bad
