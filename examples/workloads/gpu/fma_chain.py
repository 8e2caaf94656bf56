#!/usr/bin/env python3
"""Triton: a compute-bound chain of ITERS fused multiply-adds per element.

y = x; repeat ITERS times: y = y * a + b. The work scales exactly with --iters
(and --n), so a family whose ITERS grows by a known factor has a known true order.
Correctness: against the closed form a^k x + b (1 - a^k) / (1 - a) in float64.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, required=True, help="elements")
    p.add_argument("--iters", type=int, required=True, help="multiply-adds per element")
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import triton
        from _kernels import fma_kernel

    with cmd.phase("inputs"):
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        x = torch.rand(a.n, device="cuda", generator=g)
        y = torch.empty_like(x)
        block, ca, cb = 1024, 0.999, 0.001
        grid = (triton.cdiv(a.n, block),)

        def run() -> None:
            fma_kernel[grid](x, y, a.n, a.iters, ca, cb, BLOCK=block, num_warps=4)

    with cmd.phase("compile"):
        run()  # the first launch JIT-compiles for exactly these arguments
        torch.cuda.synchronize()

    with cmd.phase("check"):
        ak = ca**a.iters
        ref = (x.double() * ak + cb * (1 - ak) / (1 - ca)).float()
        correct = bool(torch.allclose(y, ref, rtol=1e-3, atol=1e-3))
        del ref

    ms = cmd.timed(lambda: _wl.do_bench_ms(run))
    cmd.emit(
        ms, correct, n=a.n, iters=a.iters, kernel="triton", torch=torch.__version__, triton=triton.__version__
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
