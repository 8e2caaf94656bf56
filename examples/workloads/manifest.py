"""The `krex bench` corpus: every command, as plain data.

`krex bench` loads this file (it is not imported as a package) and reads
``WORKLOADS``: a list of dicts with these keys

  name        unique name of the command
  device      "gpu" (real GPU: torch, Triton) or "sim" (the simulated GPU)
  script      path of the Python script, relative to this directory
  args        its arguments (``--name/--family/--param`` are added by `_cmd`)
  family      ranking family, or None: candidates of one family are ranked together
  param       the candidate's parameter within its family
  truth       how the family's true order is known:
                "param"    the work scales exactly with ``work`` (true order = order of work)
                "measured" tiling variants: the order of a long exclusive reference
                           measurement (`krex bench`'s ``reference`` pass)
                None       not in a family
  work        relative amount of work (truth "param"): true duration is proportional to it
  quick       part of the ``--quick`` subset
  expect_ms   rough kernel duration on an H200 (gpu) or exact simulated length (sim);
              for planning the duration bands only, never used as a result
  est_wall_s  rough wall time of the whole command when it runs alone (schedules the
              longest commands first in concurrent cells until a native-serial pass exists)
  env         extra environment variables of the command (e.g. KREX_AUTO_REGION)

GPU corpus (run it on the H200; see docs/bench.md): Triton JIT kernels (fma chain,
scaled copy, matmul in bf16 (on 32 SMs) and IEEE fp32, softmax), torch.compile candidates, one
C++/CUDA extension built with load_inline, the CPU-heavy family and the fused family (gpu/fused.py:
conv/GEMM + norm + activation + reduction chains timed by a KernelBench-style harness under an
automatic region). Duration bands (by expected kernel time): >10 ms: 11 commands, 1-10 ms: 21,
0.1-1 ms: 17, <0.1 ms: 4 (14 us to ~21 ms). Ranking
families: fma-short, fma-long, copy-scale, matmul-k, sgemm-k (truth "param", steps of 1.5-2 % so pairwise gaps
cover <2 %, 2-5 % and 5-10 %) and matmul-tiles (truth "measured": six fp32 tilings).

SIM corpus: the same shape on the simulated GPU (sim/sim_cmd.py, and sim/sim_fused.py for
the fused family); import and compile
are CPU sleeps, the timed loop runs simulated kernels of exactly ``--us`` microseconds,
so every family's true order is exact. Logic demo only, never performance evidence.
"""

from __future__ import annotations

from typing import Any


def _cmd(
    name: str,
    device: str,
    script: str,
    args: list[str],
    *,
    family: str | None = None,
    param: float = 0.0,
    truth: str | None = None,
    work: float | None = None,
    quick: bool = False,
    expect_ms: float = 0.0,
    est_wall_s: float = 5.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    full = ["--name", name, *(["--family", family] if family else []), "--param", f"{param:g}", *args]
    return {
        "name": name,
        "device": device,
        "script": script,
        "args": full,
        "family": family,
        "param": param,
        "truth": truth,
        "work": work,
        "quick": quick,
        "expect_ms": expect_ms,
        "est_wall_s": est_wall_s,
        "env": env or {},
    }


def _mm(m: int, n: int, k: int, dtype: str, tile: tuple[int, int, int, int, int]) -> list[str]:
    bm, bn, bk, w, st = tile
    return [
        "--m",
        str(m),
        "--n",
        str(n),
        "--k",
        str(k),
        "--dtype",
        dtype,
        "--bm",
        str(bm),
        "--bn",
        str(bn),
        "--bk",
        str(bk),
        "--warps",
        str(w),
        "--stages",
        str(st),
    ]


def _gpu() -> list[dict[str, Any]]:
    """Kernel times in the comments were measured on an H200 (torch 2.11, triton 3.6),
    native, one command at a time."""
    out: list[dict[str, Any]] = []
    fma, mm = "gpu/fma_chain.py", "gpu/matmul.py"
    for k in range(5):
        # fma-short: 2^22 elements, 1800 * (1 + 0.015 k) multiply-adds each (0.263-0.278 ms).
        it = round(1800 * (1 + 0.015 * k))
        out.append(
            _cmd(
                f"fma-short-{k}",
                "gpu",
                fma,
                ["--n", str(1 << 22), "--iters", str(it)],
                family="fma-short",
                param=k,
                truth="param",
                work=it,
                quick=True,
                expect_ms=0.27,
                est_wall_s=5,
            )
        )
    for k in range(5):
        # fma-long: 2^24 elements, 36000 * (1 + 0.015 k) multiply-adds (about 20-21 ms;
        # 20000 iterations took 11.1 ms).
        it = round(36000 * (1 + 0.015 * k))
        out.append(
            _cmd(
                f"fma-long-{k}",
                "gpu",
                fma,
                ["--n", str(1 << 24), "--iters", str(it)],
                family="fma-long",
                param=k,
                truth="param",
                work=it,
                expect_ms=20.0,
                est_wall_s=6,
            )
        )
    for k in range(5):
        # copy-scale: 2^27 * (1 + 0.02 k) float32 elements, whole 4096-blocks (0.268-0.288 ms).
        n = round((1 << 27) * (1 + 0.02 * k) / 4096) * 4096
        out.append(
            _cmd(
                f"copy-scale-{k}",
                "gpu",
                "gpu/copy_scale.py",
                ["--n", str(n)],
                family="copy-scale",
                param=k,
                truth="param",
                work=n,
                expect_ms=0.28,
                est_wall_s=5,
            )
        )
    for k in range(5):
        # matmul-k: bf16 1024 x 1024 x K, K = 131072 + 2048 k (steps of 1.56 %), fixed 128x256
        # tiling: 32 tiles, so 32 of the 132 SMs each run one long K loop and the time is
        # exactly proportional to K. A full-GPU bf16 GEMM (8192^2 x K) near peak is
        # power-limited and varies by 5-15 % between native runs, so it could
        # not follow K.
        kk = 131072 + 2048 * k
        out.append(
            _cmd(
                f"matmul-k-{k}",
                "gpu",
                mm,
                _mm(1024, 1024, kk, "bf16", (128, 256, 64, 8, 3)),
                family="matmul-k",
                param=k,
                truth="param",
                work=kk,
                quick=True,
                expect_ms=1.4,
                est_wall_s=6,
            )
        )
    for k in range(5):
        # sgemm-k: IEEE fp32 4096 x 4096 x K, K = 16384 + 256 k (steps of 1.56 %), about 12.5-13.3 ms
        # (44 TFLOP/s: K = 8192 took 6.25 ms).
        kk = 16384 + 256 * k
        out.append(
            _cmd(
                f"sgemm-k-{k}",
                "gpu",
                mm,
                _mm(4096, 4096, kk, "fp32", (64, 64, 32, 4, 3)),
                family="sgemm-k",
                param=k,
                truth="param",
                work=kk,
                quick=True,
                expect_ms=12.5,
                est_wall_s=6,
            )
        )
    # matmul-tiles: IEEE fp32 4096^3 under six tilings; the true order comes from the
    # reference pass. (bf16 8192^3 tilings were tried first: power-limited, they varied by
    # up to 15 % between two native runs, more than the gaps between tilings.)
    tiles = [
        (64, 64, 32, 4, 3),
        (128, 64, 32, 4, 3),
        (64, 128, 32, 4, 3),
        (128, 128, 32, 8, 3),
        (32, 64, 32, 4, 3),
        (64, 64, 64, 4, 2),
    ]
    for i, t in enumerate(tiles):
        bm, bn, bk, w, st = t
        out.append(
            _cmd(
                f"matmul-tiles-{bm}x{bn}x{bk}w{w}s{st}",
                "gpu",
                mm,
                _mm(4096, 4096, 4096, "fp32", t),
                family="matmul-tiles",
                param=i,
                truth="measured",
                expect_ms=3.2,
                est_wall_s=6,
            )
        )
    # Short kernels: row softmax (0.014, 0.037, 0.070 ms).
    for rows, cols, ms in ((4096, 1024, 0.014), (8192, 2048, 0.037), (16384, 2048, 0.070)):
        out.append(
            _cmd(
                f"softmax-{rows}x{cols}",
                "gpu",
                "gpu/softmax.py",
                ["--rows", str(rows), "--cols", str(cols)],
                quick=rows == 8192,
                expect_ms=ms,
                est_wall_s=5,
            )
        )
    # torch.compile candidates (Inductor; 0.050, 0.29, 1.26 ms; mm-epilogue in IEEE fp32, ~2.8 ms).
    for rows, cols, ms in ((4096, 4096, 0.05), (16384, 8192, 0.29), (32768, 16384, 1.26)):
        out.append(
            _cmd(
                f"compiled-norm-gelu-{rows}x{cols}",
                "gpu",
                "gpu/compiled_fused.py",
                ["--op", "norm-gelu", "--rows", str(rows), "--cols", str(cols)],
                quick=rows == 16384,
                expect_ms=ms,
                est_wall_s=22,
            )
        )
    out.append(
        _cmd(
            "compiled-mm-epilogue-8192",  # the first corpus's name, kept so results stay resumable
            "gpu",
            "gpu/compiled_fused.py",
            ["--op", "mm-epilogue", "--rows", "4096", "--cols", "4096", "--dtype", "fp32"],
            expect_ms=2.8,
            est_wall_s=18,
        )
    )
    # The CPU-heavy family, shaped like an agent's command: heavy imports, a GB-scale input
    # generated on the CPU, torch.compile, a CPU-side correctness check, and the timed loop
    # in the harness's own do_bench under an automatic region (no krex.region() in the code).
    # A chain of `iters` fused multiply-adds over 2^26 fp32 elements (~0.3-0.5 ms).
    for k in range(3):
        it = round(128 * (1 + 0.05 * k))
        out.append(
            _cmd(
                f"cpu-heavy-{k}",
                "gpu",
                "gpu/agent_like.py",
                ["--n", str(1 << 26), "--iters", str(it), "--input-gb", "2"],
                family="cpu-heavy",
                param=k,
                truth="param",
                work=it,
                quick=True,
                expect_ms=0.3 * (1 + 0.05 * k),
                est_wall_s=35,
                env={"KREX_AUTO_REGION": "do_bench"},
            )
        )
    # A C++/CUDA extension (load_inline: nvcc + ninja, ~47 s to compile afresh in every run; 1.9 ms).
    out.append(
        _cmd(
            "cuda-ext-sgemm-2048",
            "gpu",
            "gpu/cuda_ext.py",
            ["--op", "sgemm", "--n", "2048"],
            expect_ms=1.9,
            est_wall_s=52,
        )
    )
    out += _fused_gpu()
    return out


# The fused family: operator chains of our own (a convolution or GEMM, then normalisation,
# activation and a reduction), eager and torch.compile'd, each timed by a harness's own
# KernelBench-style timing function (100 trials) under an automatic region; inputs are made
# on the CPU and copied. Nobody tunes them: the sizes span ~0.5 to ~11 ms a call, estimated
# from FLOPs and bytes (fp32 GEMM ~50 TFLOP/s, TF32 convolutions, ~4 TB/s), not measured.
FUSED_AUTO_REGION = {"KREX_AUTO_REGION": "_timing:time_execution_with_cuda_event@kernelbench"}


def _fused_gpu() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    # (chain, compiled, n, cin, cout, hw, expected ms, quick)
    shapes = [
        ("conv-gn", False, 32, 64, 128, 64, 0.5, True),
        ("conv-gn", False, 64, 128, 256, 64, 2.0, False),
        ("conv-gn", False, 128, 256, 256, 64, 5.5, False),
        ("gemm-ln", False, 4096, 1024, 4096, 0, 0.9, False),
        ("gemm-ln", False, 8192, 2048, 4096, 0, 3.0, True),
        ("gemm-ln", False, 8192, 4096, 8192, 0, 11.5, True),
        ("convt3d-gn", False, 8, 32, 32, 32, 1.0, False),
        ("convt3d-gn", False, 16, 64, 64, 32, 3.2, True),
        ("conv-gn", True, 64, 128, 256, 64, 1.4, True),
        ("gemm-ln", True, 8192, 2048, 4096, 0, 3.0, False),
        ("convt3d-gn", True, 16, 64, 64, 32, 3.0, False),
    ]
    for chain, compiled, n, cin, cout, hw, ms, quick in shapes:
        size = f"m{n}k{cin}n{cout}" if chain == "gemm-ln" else f"n{n}c{cin}x{cout}s{hw}"
        out.append(
            _cmd(
                f"fused-{'compiled-' if compiled else ''}{chain}-{size}",
                "gpu",
                "gpu/fused.py",
                ["--chain", chain, "--n", str(n), "--cin", str(cin), "--cout", str(cout)]
                + (["--hw", str(hw)] if hw else [])
                + (["--compile"] if compiled else []),
                quick=quick,
                expect_ms=ms,
                est_wall_s=(28 if compiled else 9) + ms * 0.11,
                env=FUSED_AUTO_REGION,
            )
        )
    return out


def _fused_sim() -> list[dict[str, Any]]:
    """The fused family on the simulated GPU: the same phases and the same timing function
    (sim/sim_fused.py), chains of simulated kernels of exactly --us microseconds a call."""
    out: list[dict[str, Any]] = []
    # (chain, compiled, us, quick)
    shapes = [
        ("conv-gn", False, 500, True),
        ("conv-gn", False, 2000, False),
        ("gemm-ln", False, 9000, False),
        ("convt3d-gn", False, 3200, False),
        ("conv-gn", True, 1400, True),
        ("gemm-ln", True, 3000, False),
    ]
    for chain, compiled, us, quick in shapes:
        comp = 0.8 if compiled else 0.1
        out.append(
            _cmd(
                f"sim-fused-{'compiled-' if compiled else ''}{chain}-{us}us",
                "sim",
                "sim/sim_fused.py",
                ["--chain", chain, "--us", str(us), "--compile-s", f"{comp:g}"]
                + (["--compile"] if compiled else []),
                quick=quick,
                expect_ms=us / 1000,
                est_wall_s=0.6 + 0.15 + 0.02 + comp + 0.103 * us / 1000 + 0.3,
                env=FUSED_AUTO_REGION,
            )
        )
    return out


def _sim() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    families = [  # (family, base us, step, quick)
        ("sim-a", 400, 0.015, True),  # 400..424 us: >0.1 ms band, gaps 1.5-6 %
        ("sim-b", 2000, 0.025, True),  # 2000..2200 us: >1 ms band, gaps 2.5-10 %
        ("sim-c", 12000, 0.012, False),  # 12..12.58 ms: >10 ms band, gaps 1.2-4.8 %
        ("sim-d", 200, 0.03, False),  # 200..224 us: gaps 3-12 %
    ]
    i = 0
    for fam, base, step, quick in families:
        for k in range(5):
            us = round(base * (1 + step * k))
            imp, comp = (
                (0.25 + 0.05 * (i % 4), 0.1 + 0.05 * (i % 3))
                if quick
                else (0.3 + 0.1 * (i % 5), 0.15 + 0.1 * (i % 3))
            )
            out.append(
                _cmd(
                    f"{fam}-{k}",
                    "sim",
                    "sim/sim_cmd.py",
                    ["--us", str(us), "--import-s", f"{imp:g}", "--compile-s", f"{comp:g}"],
                    family=fam,
                    param=k,
                    truth="param",
                    work=us,
                    quick=quick,
                    expect_ms=us / 1000,
                    est_wall_s=imp + comp + 0.2,
                )
            )
            i += 1
    for us, quick in (
        (12, False),
        (25, True),
        (50, False),
        (80, False),
        (700, False),
        (900, False),
        (3000, True),
        (5000, False),
        (8000, False),
        (15000, True),
        (20000, False),
        (30000, False),
    ):
        imp, comp = (0.3, 0.15) if quick else (0.3 + 0.1 * (i % 5), 0.15 + 0.1 * (i % 3))
        out.append(
            _cmd(
                f"sim-single-{us}us",
                "sim",
                "sim/sim_cmd.py",
                ["--us", str(us), "--import-s", f"{imp:g}", "--compile-s", f"{comp:g}"],
                quick=quick,
                expect_ms=us / 1000,
                est_wall_s=imp + comp + 0.2,
            )
        )
        i += 1
    out += _fused_sim()
    return out


WORKLOADS: list[dict[str, Any]] = _gpu() + _sim()
