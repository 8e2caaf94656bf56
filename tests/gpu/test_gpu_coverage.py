"""Real-GPU checks (marker `gpu`): skipped where no NVIDIA GPU is visible.

On the H200 these run through benchmarks/h200_*.sh; results in docs/results/gate-coverage/."""

from __future__ import annotations

import pytest

from krex.device.gpus import discover

try:
    HAVE_GPU = discover("auto").kind == "nvidia"
except Exception:  # noqa: BLE001 - any discovery failure means "no GPU here"
    HAVE_GPU = False

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU")]


def test_every_kernel_and_copy_passes_the_gate() -> None:
    from krex.doctor.coverage import run_all

    rows = run_all()
    bad = [r for r in rows if not r.ok]
    assert not bad, [(r.workload, r.shim, r.cupti, r.note) for r in bad]
    assert {r.workload for r in rows} >= {"eager", "cublas_bf16", "triton", "compile", "graph", "copies"}
