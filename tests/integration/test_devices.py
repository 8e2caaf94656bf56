"""`--device gpu` and `krex doctor` on a ROCm node whose discovery layer is a fake amdsmi
(first on PYTHONPATH, NVIDIA bindings blocked): the CLI, krexd and the guardian all
treat it as AMD. Nothing here ran on real AMD hardware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.fakes import write_fake_amd_node  # noqa: E402

KREX = [sys.executable, "-m", "krex.cli.main"]


def krex(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, *args], env=env, capture_output=True, text=True, timeout=90)


def test_rocm_node_doctor_run_and_env(krex_env: dict[str, str], tmp_path: Path) -> None:
    fake = write_fake_amd_node(tmp_path / "fake-rocm")
    env = dict(krex_env, PYTHONPATH=os.pathsep.join([str(fake), krex_env.get("PYTHONPATH", "")]).rstrip(":"))
    env["KREX_GPU_DEVICE_NODES"] = str(fake / "kfd")
    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        env.pop(k, None)
    d = krex(env, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(d.stdout)["checks"]}
    g = checks["gpus"]
    assert g["status"] == "ok", g
    assert g["finding"].startswith("2 AMD GPU(s) through amdsmi: 0: AMD Instinct MI300X (a)"), g
    assert g["details"]["kind"] == "amd" and g["details"]["tried"][0].startswith("nvml: ")
    # --device gpu: krexd sees two AMD GPUs; the command gets its GPU by HIP's numbering.
    show = "echo HIP=$HIP_VISIBLE_DEVICES CUDA=$CUDA_VISIBLE_DEVICES"
    r = krex(env, "run", "--device", "gpu", "--gpu", "1", "--", "sh", "-c", show)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "HIP=1 CUDA=1"
    st = json.loads(krex(env, "daemon", "status", "--json").stdout)
    assert st["daemon"]["device"] == "amd" and st["daemon"]["gpus"] == 2
    e = krex(env, "env", "--device", "gpu")
    assert e.returncode == 0 and "LD_PRELOAD=" in e.stdout and "KREX_DEVICE" not in e.stdout
    # The coverage check needs CUPTI: refused with a reason on an AMD node.
    cov = krex(env, "doctor", "--gpu")
    assert cov.returncode == 1
    line = next(ln for ln in cov.stdout.splitlines() if "gpu coverage" in ln)
    assert "no NVIDIA GPU" in line and "AMD" in line
