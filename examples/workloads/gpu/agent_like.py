#!/usr/bin/env python3
"""An agent-shaped, CPU-heavy command: heavy imports, a GB-scale input generated on the CPU
and copied to the GPU, torch.compile of the candidate, a correctness check on the CPU, and
the timed loop in the harness's own `triton.testing.do_bench`, which KREX wraps in an
automatic region (KREX_AUTO_REGION=do_bench, set by the manifest): the code never calls
krex.region().

Candidate: y = a chain of --iters fused multiply-adds over the first --n fp32 elements.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, required=True, help="elements the candidate works on")
    p.add_argument("--iters", type=int, required=True, help="fused multiply-adds per element")
    p.add_argument("--input-gb", type=float, default=2.0, help="size of the input generated on the CPU")
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        import torch
        import torch._dynamo  # noqa: F401  (what an agent's harness pulls in)
        import torch._inductor.config  # noqa: F401
        import triton
        import triton.testing

    with cmd.phase("inputs"):
        g = torch.Generator().manual_seed(a.seed)
        total = max(a.n, int(a.input_gb * (1 << 30)) // 4)
        host = torch.randn(total, generator=g)  # CPU-bound: GB-scale random input
        dev = host.cuda()  # one long synchronous host-to-device copy
        x = dev[: a.n]

    iters = a.iters

    def fn(t: torch.Tensor) -> torch.Tensor:
        for i in range(iters):
            t = t * 0.999 + (0.001 * (i % 7))
        return t

    with cmd.phase("compile"):
        cfn = torch.compile(fn)
        out = cfn(x)
        torch.cuda.synchronize()

    with cmd.phase("check"):  # on the CPU, over a slice, as a harness would
        m = 1 << 20
        ref = fn(host[:m].double()).float()
        correct = bool(torch.allclose(out[:m].cpu(), ref, rtol=1e-4, atol=1e-4))
        del host, ref

    # The harness's own timing call; KREX_AUTO_REGION=do_bench makes it a region.
    t0 = time.perf_counter()
    ms = float(
        triton.testing.do_bench(
            lambda: cfn(x), warmup=_wl.warmup_ms(), rep=_wl.rep_ms(), return_mode="median"
        )
    )
    t1 = time.perf_counter()
    cmd.t_region_s += t1 - t0
    cmd.region_entry_s = None  # the command cannot see its automatic region's entry
    cmd.phases["timed"] = t1 - t0
    del dev
    cmd.emit(
        ms,
        correct,
        n=a.n,
        iters=a.iters,
        kernel="torch.compile",
        region="auto (do_bench)",
        torch=torch.__version__,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
