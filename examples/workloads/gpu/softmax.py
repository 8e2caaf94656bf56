#!/usr/bin/env python3
"""Triton: row-wise softmax (one program per row), the corpus's short kernels.

Correctness: against torch.softmax.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--cols", type=int, required=True)
    p.add_argument("--warps", type=int, default=8)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import triton
        from _kernels import softmax_kernel

    with cmd.phase("inputs"):
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        x = torch.randn(a.rows, a.cols, device="cuda", generator=g)
        y = torch.empty_like(x)
        block = triton.next_power_of_2(a.cols)

        def run() -> None:
            softmax_kernel[(a.rows,)](x, y, x.stride(0), a.cols, BLOCK=block, num_warps=a.warps)

    with cmd.phase("compile"):
        run()
        torch.cuda.synchronize()

    with cmd.phase("check"):
        correct = bool(torch.allclose(y, torch.softmax(x, dim=1), rtol=1e-4, atol=1e-6))

    ms = cmd.timed(lambda: _wl.do_bench_ms(run))
    cmd.emit(
        ms,
        correct,
        rows=a.rows,
        cols=a.cols,
        kernel="triton",
        torch=torch.__version__,
        triton=triton.__version__,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
