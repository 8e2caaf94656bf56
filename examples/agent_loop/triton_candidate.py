#!/usr/bin/env python3
"""One candidate of the agent loop on a real GPU: a Triton kernel y = x * a + b over --n
fp32 elements, with a tunable block size and warp count. It checks its output against
torch, times the kernel with triton.testing.do_bench and prints "<ms> ms" (krex
compare's do_bench figure). It never calls krex: run it with KREX_AUTO_REGION=do_bench
(Executor.submit(..., auto_region="do_bench"), krex compare --auto-region do_bench) and
the do_bench call becomes the region.

    python triton_candidate.py --block 1024 --warps 4
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=1024, help="BLOCK_SIZE (a power of 2)")
    p.add_argument("--warps", type=int, default=4, help="num_warps")
    p.add_argument("--n", type=int, default=1 << 26, help="elements")
    a = p.parse_args()

    import torch
    import triton
    import triton.language as tl
    import triton.testing

    @triton.jit
    def axpb(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):  # noqa: N803 - Triton's convention
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, x * a + b, mask=mask)

    x = torch.randn(a.n, device="cuda")
    y = torch.empty_like(x)
    grid = (triton.cdiv(a.n, a.block),)

    def run() -> None:
        axpb[grid](x, y, a.n, 2.0, 1.0, BLOCK=a.block, num_warps=a.warps)

    run()
    torch.cuda.synchronize()
    if not torch.allclose(y, x * 2.0 + 1.0):
        print("candidate output is wrong", file=sys.stderr)
        return 1
    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    print(f"block {a.block} warps {a.warps}: {ms:.6f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
