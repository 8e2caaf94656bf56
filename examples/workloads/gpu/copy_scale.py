#!/usr/bin/env python3
"""Triton: a memory-bound scaled copy, y = x * s, over --n float32 elements.

The bytes moved scale exactly with --n, so a family over N * (1 + k * step) has
a known true order. Correctness: against torch's x * s.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, required=True, help="elements (float32)")
    p.add_argument("--block", type=int, default=4096)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import triton
        from _kernels import scale_kernel

    with cmd.phase("inputs"):
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        x = torch.randn(a.n, device="cuda", generator=g)
        y = torch.empty_like(x)
        s = 1.5
        grid = (triton.cdiv(a.n, a.block),)

        def run() -> None:
            scale_kernel[grid](x, y, a.n, s, BLOCK=a.block, num_warps=8)

    with cmd.phase("compile"):
        run()
        torch.cuda.synchronize()

    with cmd.phase("check"):
        correct = bool(torch.equal(y, x * s))

    ms = cmd.timed(lambda: _wl.do_bench_ms(run))
    cmd.emit(
        ms,
        correct,
        n=a.n,
        gbps=8.0 * a.n / (ms * 1e6),
        kernel="triton",
        torch=torch.__version__,
        triton=triton.__version__,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
