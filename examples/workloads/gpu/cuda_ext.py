#!/usr/bin/env python3
"""C++/CUDA extension: a candidate built with torch.utils.cpp_extension.load_inline
(nvcc + ninja), the way an agent that writes raw CUDA builds it.

--op saxpy: out = a * x + y over --n float32 elements (memory-bound, short);
--op sgemm: a shared-memory tiled fp32 matrix product of two --n x --n matrices.
The build goes to $TORCH_EXTENSIONS_DIR (krex bench gives every run a fresh one, so
each run compiles, like a new candidate would). Correctness: against torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402

CUDA_SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__global__ void saxpy_kernel(long n, float a, const float* __restrict__ x, const float* __restrict__ y,
                             float* __restrict__ out) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a * x[i] + y[i];
}

#define TILE 32
__global__ void sgemm_kernel(int n, const float* __restrict__ A, const float* __restrict__ B,
                             float* __restrict__ C) {
  __shared__ float As[TILE][TILE];
  __shared__ float Bs[TILE][TILE];
  int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
  float acc = 0.f;
  for (int t = 0; t < n; t += TILE) {
    As[threadIdx.y][threadIdx.x] = (row < n && t + threadIdx.x < n) ? A[row * n + t + threadIdx.x] : 0.f;
    Bs[threadIdx.y][threadIdx.x] = (col < n && t + threadIdx.y < n) ? B[(t + threadIdx.y) * n + col] : 0.f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
    __syncthreads();
  }
  if (row < n && col < n) C[row * n + col] = acc;
}

torch::Tensor saxpy(torch::Tensor x, torch::Tensor y, double a, torch::Tensor out) {
  long n = x.numel();
  saxpy_kernel<<<(n + 255) / 256, 256>>>(n, (float)a, x.data_ptr<float>(), y.data_ptr<float>(),
                                         out.data_ptr<float>());
  return out;
}

torch::Tensor sgemm(torch::Tensor A, torch::Tensor B, torch::Tensor C) {
  int n = A.size(0);
  dim3 block(TILE, TILE), grid((n + TILE - 1) / TILE, (n + TILE - 1) / TILE);
  sgemm_kernel<<<grid, block>>>(n, A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>());
  return C;
}
"""

CPP_SRC = """
torch::Tensor saxpy(torch::Tensor x, torch::Tensor y, double a, torch::Tensor out);
torch::Tensor sgemm(torch::Tensor A, torch::Tensor B, torch::Tensor C);
"""


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--op", choices=["saxpy", "sgemm"], required=True)
    p.add_argument("--n", type=int, required=True)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        from torch.utils.cpp_extension import load_inline

    with cmd.phase("compile"):
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        ext = load_inline(
            name="krex_wl_ext",
            cpp_sources=CPP_SRC,
            cuda_sources=CUDA_SRC,
            functions=["saxpy", "sgemm"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )

    with cmd.phase("inputs"):
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        if a.op == "saxpy":
            x = torch.randn(a.n, device="cuda", generator=g)
            y = torch.randn(a.n, device="cuda", generator=g)
            out = torch.empty_like(x)

            def run() -> None:
                ext.saxpy(x, y, 2.0, out)
        else:
            x = torch.randn(a.n, a.n, device="cuda", generator=g)
            y = torch.randn(a.n, a.n, device="cuda", generator=g)
            out = torch.empty_like(x)

            def run() -> None:
                ext.sgemm(x, y, out)

    with cmd.phase("check"):
        run()
        torch.cuda.synchronize()
        if a.op == "saxpy":
            correct = bool(torch.allclose(out, 2.0 * x + y, rtol=1e-6, atol=1e-6))
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            ref = x @ y
            correct = float((out - ref).norm() / ref.norm()) < 1e-4
            del ref

    ms = cmd.timed(lambda: _wl.do_bench_ms(run))
    cmd.emit(ms, correct, op=a.op, n=a.n, kernel="cuda-extension", torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
