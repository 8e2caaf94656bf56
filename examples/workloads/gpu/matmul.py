#!/usr/bin/env python3
"""Triton: a tiled matrix product C = A @ B (the Triton tutorial's kernel, no autotune).

--dtype bf16 uses the tensor cores (fp32 accumulate); --dtype fp32 computes in IEEE
fp32 (no TF32), which is slow and compute-bound: the long kernels of the corpus.
Tiling is chosen on the command line (--bm/--bn/--bk/--warps/--stages), so tiling
variants are distinct candidates; a family that scales K at fixed tiling has a known
true order. Correctness: relative error against torch.matmul in float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--bm", type=int, default=128)
    p.add_argument("--bn", type=int, default=128)
    p.add_argument("--bk", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import triton
        from _kernels import matmul_kernel

    with cmd.phase("inputs"):
        dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        x = torch.randn(a.m, a.k, device="cuda", dtype=dt, generator=g)
        w = torch.randn(a.k, a.n, device="cuda", dtype=dt, generator=g)
        out = torch.empty(a.m, a.n, device="cuda", dtype=dt)
        grid = (triton.cdiv(a.m, a.bm) * triton.cdiv(a.n, a.bn),)

        def run() -> None:
            matmul_kernel[grid](
                x,
                w,
                out,
                a.m,
                a.n,
                a.k,
                x.stride(0),
                x.stride(1),
                w.stride(0),
                w.stride(1),
                out.stride(0),
                out.stride(1),
                BM=a.bm,
                BN=a.bn,
                BK=a.bk,
                GROUP=a.group,
                IEEE=a.dtype == "fp32",
                num_warps=a.warps,
                num_stages=a.stages,
            )

    with cmd.phase("compile"):
        run()
        torch.cuda.synchronize()

    with cmd.phase("check"):
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = torch.matmul(x.float(), w.float())
        err = float((out.float() - ref).norm() / ref.norm())
        correct = err < (2e-2 if a.dtype == "bf16" else 1e-4)
        del ref
        torch.cuda.synchronize()

    ms = cmd.timed(lambda: _wl.do_bench_ms(run))
    cmd.emit(
        ms,
        correct,
        rel_err=err,
        tflops=2.0 * a.m * a.n * a.k / (ms * 1e9),
        dtype=a.dtype,
        tile=[a.bm, a.bn, a.bk, a.warps, a.stages],
        kernel="triton",
        torch=torch.__version__,
        triton=triton.__version__,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
