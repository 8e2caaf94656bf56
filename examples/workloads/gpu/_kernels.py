"""The corpus's Triton kernels, at module level (Triton resolves `tl` and friends
through the kernel's module globals). Importing this module compiles nothing: each
kernel is JIT-compiled at its first launch, in the command's "compile" phase."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fma_kernel(x_ptr, y_ptr, n, iters, ca, cb, BLOCK: tl.constexpr):  # noqa: N803
    """y = x; ITERS times y = y * ca + cb (compute-bound; work exactly proportional to ITERS)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    for _ in range(iters):
        v = v * ca + cb
    tl.store(y_ptr + offs, v, mask=m)


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, s, BLOCK: tl.constexpr):  # noqa: N803
    """y = x * s (memory-bound; bytes exactly proportional to n)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * s, mask=m)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, stride, n_cols, BLOCK: tl.constexpr):  # noqa: N803
    """Row-wise softmax, one program per row."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    v = tl.load(x_ptr + row * stride + offs, mask=m, other=-float("inf"))
    v = v - tl.max(v, axis=0)
    e = tl.exp(v)
    tl.store(y_ptr + row * stride + offs, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,  # noqa: N803
    s_am,
    s_ak,
    s_bk,
    s_bn,
    s_cm,
    s_cn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,  # noqa: N803
    GROUP: tl.constexpr,
    IEEE: tl.constexpr,
):  # noqa: N803
    """C = A @ B, grouped tile order (the Triton tutorial's kernel); IEEE: fp32 without TF32."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    in_group = GROUP * num_n
    first_m = (pid // in_group) * GROUP
    size_m = min(num_m - first_m, GROUP)
    pid_m = first_m + ((pid % in_group) % size_m)
    pid_n = (pid % in_group) // size_m
    offs_m = (pid_m * BM + tl.arange(0, BM)) % M
    offs_n = (pid_n * BN + tl.arange(0, BN)) % N
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        av = tl.load(a_ptrs, mask=offs_k[None, :] < K - kk * BK, other=0.0)
        bv = tl.load(b_ptrs, mask=offs_k[:, None] < K - kk * BK, other=0.0)
        if IEEE:  # noqa: SIM108 - a compile-time branch on a constexpr
            acc = tl.dot(av, bv, acc, input_precision="ieee")
        else:
            acc = tl.dot(av, bv, acc)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    offs_cm = pid_m * BM + tl.arange(0, BM)
    offs_cn = pid_n * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + offs_cm[:, None] * s_cm + offs_cn[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))
