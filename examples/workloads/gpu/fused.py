#!/usr/bin/env python3
"""A fused operator chain (convolution or GEMM, then normalisation, activation and a
reduction), eager or torch.compile'd, timed through a harness's own timing function.

Shaped like an agent's command on a KernelBench-style problem: import torch, make the
inputs on the CPU (seeded) and copy them to the GPU, build the candidate (eager PyTorch,
or ``torch.compile`` of the same function), check it against a reference written with
torch.nn's modules, then time it with ``_timing.time_execution_with_cuda_event``
(100 trials, 3 warm-ups, an L2 flush before each trial; the reported ``ms`` is the mean
over the trials, as KernelBench reports). The command never calls krex.region(): the
manifest sets ``KREX_AUTO_REGION=_timing:time_execution_with_cuda_event@kernelbench``,
so under KREX the trial loop is an automatic region.

Chains (--chain), all fp32 (convolutions may use TF32, torch's default; GEMMs do not):
  conv-gn      y = logsumexp_c(silu(group_norm(conv2d(x))) + conv2d(x))   [N, H, W]
  gemm-ln      y = sum_n(gelu(layer_norm(x @ w + b)))                     [M]
  convt3d-gn   y = mean_{c,d,h,w}(group_norm(relu(conv_transpose3d(x))))  [N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _timing  # noqa: E402
import _wl  # noqa: E402

CHAINS = ("conv-gn", "gemm-ln", "convt3d-gn")


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--chain", choices=CHAINS, required=True)
    p.add_argument("--compile", action="store_true", help="torch.compile the chain (Inductor)")
    p.add_argument("--n", type=int, required=True, help="batch (conv chains) or rows M (gemm-ln)")
    p.add_argument("--cin", type=int, default=64, help="input channels, or K (gemm-ln)")
    p.add_argument("--cout", type=int, default=128, help="output channels, or N (gemm-ln)")
    p.add_argument("--hw", type=int, default=64, help="spatial size (H = W; D = H / 2 for convt3d)")
    p.add_argument("--groups", type=int, default=8, help="group norm groups")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import torch.nn as nn
        import torch.nn.functional as F  # noqa: N812

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(a.seed)

    def cpu(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    with cmd.phase("inputs"):  # made on the CPU, then copied, as an agent's harness does
        torch.manual_seed(a.seed)  # the modules' initial weights
        if a.chain == "conv-gn":
            conv = nn.Conv2d(a.cin, a.cout, 3, padding=1).cuda()
            gn = nn.GroupNorm(a.groups, a.cout).cuda()
            host = cpu(a.n, a.cin, a.hw, a.hw)
        elif a.chain == "gemm-ln":
            lin = nn.Linear(a.cin, a.cout).cuda()
            ln = nn.LayerNorm(a.cout).cuda()
            host = cpu(a.n, a.cin)
        else:
            convt = nn.ConvTranspose3d(a.cin, a.cout, 3, stride=2, padding=1, output_padding=1).cuda()
            gn = nn.GroupNorm(a.groups, a.cout).cuda()
            host = cpu(a.n, a.cin, a.hw // 2, a.hw, a.hw)
        x = host.cuda()
        del host
        torch.cuda.synchronize()

    # The candidate: the chain written out by hand (group and layer norm as their formulas),
    # so that the reference below (torch.nn's modules) is an independent computation.
    if a.chain == "conv-gn":
        w, b, gw, gb = conv.weight.detach(), conv.bias.detach(), gn.weight.detach(), gn.bias.detach()
        groups = a.groups

        def chain(t: torch.Tensor) -> torch.Tensor:
            y = F.conv2d(t, w, b, padding=1)
            n, c, h, ww = y.shape
            z = y.view(n, groups, -1)
            mu = z.mean(-1, keepdim=True)
            var = z.var(-1, unbiased=False, keepdim=True)
            z = ((z - mu) * torch.rsqrt(var + 1e-5)).view(n, c, h, ww) * gw.view(1, -1, 1, 1) + gb.view(
                1, -1, 1, 1
            )
            return torch.logsumexp(F.silu(z) + y, dim=1)

        def reference(t: torch.Tensor) -> torch.Tensor:
            y = conv(t)
            return torch.logsumexp(F.silu(gn(y)) + y, dim=1)

    elif a.chain == "gemm-ln":
        w, b, lw, lb = lin.weight.detach(), lin.bias.detach(), ln.weight.detach(), ln.bias.detach()

        def chain(t: torch.Tensor) -> torch.Tensor:
            y = torch.addmm(b, t, w.t())
            mu = y.mean(-1, keepdim=True)
            var = y.var(-1, unbiased=False, keepdim=True)
            z = (y - mu) * torch.rsqrt(var + 1e-5) * lw + lb
            return F.gelu(z).sum(-1)

        def reference(t: torch.Tensor) -> torch.Tensor:
            return F.gelu(ln(lin(t))).sum(-1)

    else:
        w, b, gw, gb = convt.weight.detach(), convt.bias.detach(), gn.weight.detach(), gn.bias.detach()
        groups = a.groups

        def chain(t: torch.Tensor) -> torch.Tensor:
            y = torch.relu(F.conv_transpose3d(t, w, b, stride=2, padding=1, output_padding=1))
            n = y.shape[0]
            z = y.view(n, groups, -1)
            mu = z.mean(-1, keepdim=True)
            var = z.var(-1, unbiased=False, keepdim=True)
            z = ((z - mu) * torch.rsqrt(var + 1e-5)).view_as(y) * gw.view(1, -1, 1, 1, 1) + gb.view(
                1, -1, 1, 1, 1
            )
            return z.mean(dim=(1, 2, 3, 4))

        def reference(t: torch.Tensor) -> torch.Tensor:
            return gn(torch.relu(convt(t))).mean(dim=(1, 2, 3, 4))

    with torch.no_grad():
        with cmd.phase("compile"):
            fn = torch.compile(chain) if a.compile else chain
            out = fn(x)  # the first call: Inductor compiles here, cuDNN picks its algorithms
            torch.cuda.synchronize()

        with cmd.phase("check"):
            ref = reference(x)
            correct = bool(torch.allclose(out, ref, rtol=2e-3, atol=2e-3))
            del ref, out

        # The harness's own timing call; KREX_AUTO_REGION makes its trial loop a region.
        t0 = time.perf_counter()
        times = _timing.time_execution_with_cuda_event(fn, [x], num_warmup=a.warmup, num_trials=a.trials)
        t1 = time.perf_counter()
    stats = _timing.timing_stats(times)
    cmd.t_region_s = t1 - t0  # the whole timing call (its 3 warm-up calls included)
    cmd.region_entry_s = None  # the command cannot see its automatic region's entry
    cmd.phases["timed"] = t1 - t0
    cmd.emit(
        stats["mean"],
        correct,
        chain=a.chain,
        compiled=a.compile,
        ms_median=stats["median"],
        ms_std=stats["std"],
        ms_min=stats["min"],
        trials=len(times),
        kernel="torch.compile" if a.compile else "eager",
        region="auto (KernelBench-style cuda-event timing)",
        torch=torch.__version__,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
