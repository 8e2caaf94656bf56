"""Region markers (Python API semantics, C/C++ krex.h), the opt-in environment
(`krex env`: self-registration of unmodified processes) and CLI errors that need
no daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import krex
import krex.proc.region
from krex.errors import NotFound

ROOT = Path(__file__).resolve().parents[2]
KREX = [sys.executable, "-m", "krex.cli.main"]
NVCC = shutil.which("nvcc") or next(iter(sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


@pytest.fixture
def iso(krex_env: dict[str, str]) -> dict[str, str]:
    return krex_env


def journal(env: dict[str, str]) -> list[dict[str, object]]:
    p = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


# ------------------------------------------------------------ Python API


def test_outside_krex_region_warns_once_and_strict_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("KREX_SHM", "KREX_SOCKET", "KREX_STRICT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sys.modules["krex.proc.region"], "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with krex.region() as r:
            pass
        with krex.region():
            pass
    assert r.grant is None
    assert len([x for x in w if "not running under KREX" in str(x.message)]) == 1
    monkeypatch.setenv("KREX_STRICT", "1")
    with pytest.raises(NotFound, match="outside KREX"), krex.region():
        pass


def test_region_decorator_nesting_and_threads(iso: dict[str, str]) -> None:
    src = textwrap.dedent("""
        import json, threading, krex
        log = []
        @krex.region()
        def timed(tag):
            with krex.region() as inner:          # nested: a no-op, no deadlock
                log.append((tag, inner.grant))
            return tag
        ts = [threading.Thread(target=timed, args=(i,)) for i in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(json.dumps({"n": len(log), "inner_grants": [g for _, g in log]}))
    """)
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", src],
        env=iso,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"n": 4, "inner_grants": [None] * 4}
    recs = journal(iso)
    assert len(recs) == 4 and all(r["end"] == "end" for r in recs)  # one region per decorated call


# --------------------------------------------------------------- C / C++


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cpp_example_regions_on_the_simulated_gpu(iso: dict[str, str], tmp_path: Path) -> None:
    inc = subprocess.run([*KREX, "include-dir"], capture_output=True, text=True, check=True).stdout.strip()
    lib = str(ROOT / "krex" / "_lib")
    exe = tmp_path / "bench"
    subprocess.run(
        [
            str(NVCC),
            "-O2",
            "-cudart",
            "shared",
            f"-I{inc}",
            str(ROOT / "examples/cpp/bench.cu"),
            "-o",
            str(exe),
            f"-L{lib}",
            "-Xlinker",
            f"-rpath,{lib}",
        ],
        check=True,
        capture_output=True,
    )
    # Without KREX the macros do nothing.
    plain = subprocess.run([str(exe), "2560", "5"], env=iso, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and journal(iso) == []
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--", str(exe), "2560", "5"],
        env=iso,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["iters"] == 5
    recs = journal(iso)
    assert len(recs) == 1 and recs[0]["end"] == "end"


# --------------------------------------------------------------- opt-in


def test_krex_env_opt_in_self_registers_and_is_gated(iso: dict[str, str], tmp_path: Path) -> None:
    out = subprocess.run(
        [*KREX, "env", "--device", "sim"], env=iso, capture_output=True, text=True, check=True
    )
    opt = dict(line.split("=", 1) for line in out.stdout.splitlines())
    for k in ("LD_PRELOAD", "KREX_SHM", "KREX_SOCKET", "KREX_DAEMON_CMD", "LD_LIBRARY_PATH", "PYTHONPATH"):
        assert k in opt, out.stdout
    env = dict(iso, **{k: v.strip("'") for k, v in opt.items()})
    # An unmodified process (ctypes on the simulated cudart): no krex import, no KREX_SLOT.
    src = textwrap.dedent("""
        import ctypes, json, os, time
        rt = ctypes.CDLL("libcudart.so.13")
        class dim3(ctypes.Structure):
            _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
        launch = rt.cudaLaunchKernel
        launch.argtypes = [ctypes.c_void_p, dim3, dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        t_end = time.time() + float(os.environ["RUN_S"])
        n = 0
        while time.time() < t_end:
            launch(None, dim3(50, 1, 1), dim3(1, 1, 1), None, 0, None); rt.cudaDeviceSynchronize(); n += 1
        print(json.dumps({"n": n, "pid": os.getpid()}))
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", src], env=dict(env, RUN_S="4"), stdout=subprocess.PIPE, text=True
    )
    import time

    deadline = time.monotonic() + 30
    rec: list[dict[str, object]] = []
    while time.monotonic() < deadline and not rec:  # look while it runs: its record goes with its slot
        time.sleep(0.3)
        st = subprocess.run([*KREX, "status", "--json"], env=env, capture_output=True, text=True)
        if st.returncode == 0:
            snap = json.loads(st.stdout)
            rec = [r for r in snap["procs"] if r["pid"] == p.pid and r["submits"]["kernel"] > 0]
    out_p, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    assert rec, "the process never registered with krexd"
    assert rec[0]["slot"] >= 0  # a slot handed out by the daemon, not by any variable
    assert any(s["slot"] == rec[0]["slot"] and s["kind"] == "auto" for s in snap["daemon"]["slots"])


# --------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    ("args", "extra_env", "code", "message"),
    [
        (["status"], {}, 3, "no KREX shared memory"),
        (["resume", "--gpu", "0"], {}, 3, "no KREX shared memory"),
        (["pause", "--gpu", "0"], {}, 3, "no KREX shared memory"),
        (["status"], {"KREX_SHM": "bad name"}, 2, "not a valid shared-memory name"),
        (["run", "--device", "sim", "--"], {}, 125, "no command given"),  # krex run's own failure
        (["run", "--device", "sim", "--", "/nonexistent/cmd"], {}, 127, "command not found"),
        (["run", "--device", "sim", "--", "/etc/hostname"], {}, 126, "cannot execute"),
        (["env", "--device", "sim"], {"KREX_SIM_GPUS": "abc"}, 2, "KREX_SIM_GPUS"),
    ],
)
def test_cli_errors_name_problem_and_fix(
    iso: dict[str, str], args: list[str], extra_env: dict[str, str], code: int, message: str
) -> None:
    p = subprocess.run([*KREX, *args], env=dict(iso, **extra_env), capture_output=True, text=True, timeout=60)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert message in p.stderr and "fix:" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_pause_unknown_gpu_and_stragglers(iso: dict[str, str]) -> None:
    from krex.node.shm import Segment

    seg = Segment.create(iso["KREX_SHM"], n_gpus=1)
    try:
        p = subprocess.run(
            [*KREX, "pause", "--gpu", "3"], env=iso, capture_output=True, text=True, timeout=30
        )
        assert p.returncode == 3 and "unknown GPU 3" in p.stderr
        # A fake in-flight submitter that never finishes: pause must time out, name it, reopen the gate.
        idx = seg.raw.procs[0]
        idx.pid, idx.gpu, idx.slot, idx.inflight = os.getpid(), 0, 5, 1
        p = subprocess.run(
            [*KREX, "pause", "--gpu", "0", "--timeout", "0.3"],
            env=iso,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert p.returncode == 5 and str(os.getpid()) in p.stderr, p.stderr
        assert seg.gate_word(0) == 0, "a failed pause must leave the gate open"
    finally:
        seg.raw.procs[0].pid = 0
        seg.close()
