#!/usr/bin/env python3
"""torch.compile: a candidate built by Inductor (which emits Triton kernels).

--op norm-gelu: y = gelu(layer_norm(x) * w + b) + x over a (rows, cols) fp32 tensor
                (memory-bound, one or two fused kernels);
--op mm-epilogue: y = relu(a @ b + bias) (cuBLAS GEMM, fused Triton epilogue), in
                --dtype bf16 or IEEE fp32 (no TF32; the corpus uses fp32: a full-GPU
                bf16 GEMM is power-limited on the H200 and its time wanders by 5-15 %).
Correctness: against the same function run eagerly.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--op", choices=["norm-gelu", "mm-epilogue"], required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--cols", type=int, required=True)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="mm-epilogue's dtype")
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import torch.nn.functional as F  # noqa: N812

    g = torch.Generator(device="cuda").manual_seed(a.seed)
    if a.op == "norm-gelu":

        def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.gelu(F.layer_norm(x, (x.shape[-1],)) * w + b) + x

        with cmd.phase("inputs"):
            args = (
                torch.randn(a.rows, a.cols, device="cuda", generator=g),
                torch.randn(a.cols, device="cuda", generator=g),
                torch.randn(a.cols, device="cuda", generator=g),
            )
        rtol, atol = 1e-4, 1e-4
    else:

        def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ w + b)

        dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        torch.backends.cuda.matmul.allow_tf32 = False
        with cmd.phase("inputs"):
            args = (
                torch.randn(a.rows, a.cols, device="cuda", dtype=dt, generator=g),
                torch.randn(a.cols, a.cols, device="cuda", dtype=dt, generator=g),
                torch.randn(a.cols, device="cuda", dtype=dt, generator=g),
            )
        rtol, atol = (2e-2, 2e-1) if a.dtype == "bf16" else (1e-3, 1e-3)

    with cmd.phase("compile"):
        cfn = torch.compile(fn)
        out = cfn(*args)  # compiles here
        torch.cuda.synchronize()

    with cmd.phase("check"):
        ref = fn(*args)
        correct = bool(torch.allclose(out.float(), ref.float(), rtol=rtol, atol=atol))
        del ref, out

    ms = cmd.timed(lambda: _wl.do_bench_ms(lambda: cfn(*args)))
    cmd.emit(ms, correct, op=a.op, rows=a.rows, cols=a.cols, kernel="torch.compile", torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
