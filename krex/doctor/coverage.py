"""Interposition coverage on a real GPU: does every kernel and copy pass the gate?

Each workload runs in its own process under the shim. Inside it, the shim's
per-class counters (read from this process's record in the segment) are
compared with what CUPTI (through torch.profiler) saw execute in the same
window. Graph replays count as graph launches; their kernels are matched
against (replays x kernels captured). Used by `krex doctor --gpu` and by
benchmarks/h200_dataplane.sh."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from krex.pystart import module_argv

WORKLOADS = ("eager", "cublas_bf16", "cublas_fp32", "triton", "compile", "graph", "copies", "graph_drain")


@dataclass
class CoverageRow:
    workload: str
    shim: dict[str, int]
    cupti: dict[str, int]
    expected_kernels: int
    expected_copies: int
    ok: bool
    note: str = ""


def _my_counters() -> dict[str, int]:
    from krex.node.shm import CLASS_NAMES, Segment

    with Segment.attach() as seg:
        raw = seg.raw
        from krex.native import lib

        for i in range(lib.KREX_MAX_PROCS):
            r = raw.procs[i]
            if r.pid == os.getpid():
                return {n: int(r.submits[k]) for k, n in enumerate(CLASS_NAMES)}
    return dict.fromkeys(CLASS_NAMES, 0)


def _cupti_counts(trace_path: str) -> dict[str, int]:
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    out = {"kernel": 0, "memcpy": 0, "memset": 0}
    for e in events:
        cat = e.get("cat", "")
        if cat == "kernel":
            out["kernel"] += 1
        elif cat == "gpu_memcpy":
            out["memcpy"] += 1
        elif cat == "gpu_memset":
            out["memset"] += 1
    return out


def _workload(name: str) -> tuple[Callable[[], None], int]:
    """Returns (one iteration, graph kernels per iteration known after warm-up)."""
    import torch

    dev = torch.device("cuda")
    if name == "eager":
        x = torch.randn(1 << 20, device=dev)

        def step() -> None:
            y = x + 1
            y.mul_(2)
            y.zero_()
            torch.randn(1024, device=dev)
            x.to(torch.bfloat16)

        return step, 0
    if name in ("cublas_bf16", "cublas_fp32"):
        dt = torch.bfloat16 if name == "cublas_bf16" else torch.float32
        a = torch.randn(2048, 2048, device=dev, dtype=dt)
        b = torch.randn(2048, 2048, device=dev, dtype=dt)
        return (lambda: (a @ b, None)[1]), 0
    if name == "triton":
        import triton
        import triton.language as tl

        @triton.jit
        def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            pid = tl.program_id(0)
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

        x = torch.randn(1 << 20, device=dev)
        y = torch.randn_like(x)
        o = torch.empty_like(x)
        n = x.numel()
        return (lambda: add_kernel[(triton.cdiv(n, 1024),)](x, y, o, n, BLOCK=1024) and None), 0
    if name == "compile":
        x = torch.randn(4096, 4096, device=dev)

        @torch.compile
        def f(t: Any) -> Any:
            return torch.nn.functional.gelu(t * 2 + 1).sum(dim=1)

        return (lambda: (f(x), None)[1]), 0
    if name in ("graph", "graph_drain"):
        x = torch.randn(1 << 20, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                (x * 2 + 1).relu()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        before = _my_counters()["kernel"]
        if name == "graph_drain":
            # A drain request while this thread captures in global mode must not
            # invalidate the capture (DESIGN.md consequence 7).
            import threading

            from krex.node.shm import Segment

            def drain_soon() -> None:
                with Segment.attach() as seg:
                    seg.drain(int(os.environ.get("KREX_GPU", "0")), None)

            t = threading.Thread(target=drain_soon)
            with torch.cuda.graph(g):
                t.start()
                for _ in range(200):
                    x = (x * 2 + 1).relu()
                t.join()
        else:
            with torch.cuda.graph(g):
                for _ in range(5):
                    x = (x * 2 + 1).relu()
        per_graph = _my_counters()["kernel"] - before
        return g.replay, per_graph
    if name == "copies":
        h = torch.randn(1 << 22).pin_memory()
        d = torch.empty(1 << 22, device=dev)

        def step() -> None:
            d.copy_(h, non_blocking=True)
            h.copy_(d, non_blocking=True)
            torch.cuda.synchronize()

        return step, 0
    raise ValueError(name)


def child_main(name: str, out_path: str, iters: int = 20) -> None:
    """Runs inside the shimmed process."""
    import warnings

    # torch.profiler warns once per process that it clears events per cycle; `krex doctor
    # --gpu` would print it for every workload. One cycle is all we record.
    warnings.filterwarnings("ignore", message=r"Warning: Profiler clears events", category=UserWarning)
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, per_graph = _workload(name)
    for _ in range(3):  # warm-up: JIT, cuBLAS handles, autotuning stay outside the window
        step()
    torch.cuda.synchronize()
    before = _my_counters()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    after = _my_counters()
    shim = {k: after[k] - before[k] for k in after}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        path = tf.name
    prof.export_chrome_trace(path)
    cupti = _cupti_counts(path)
    os.unlink(path)
    exp_k = shim["kernel"] + shim["graph"] * per_graph
    exp_c = shim["copy"]
    ok = cupti["kernel"] <= exp_k and cupti["memcpy"] <= exp_c and cupti["memset"] <= shim["memset"]
    note = f"{per_graph} kernels per graph" if per_graph else ""
    row = CoverageRow(name, shim, cupti, exp_k, exp_c, ok, note)
    with open(out_path, "w") as f:
        json.dump(asdict(row), f)


def run_all(workloads: tuple[str, ...] = WORKLOADS, device: str = "gpu",
            progress: Callable[[str], None] | None = None) -> list[CoverageRow]:
    """Launch every workload under the shim (one process each) and collect rows; `progress`
    gets each workload's name as it starts."""
    from krex.device.gpus import discover
    from krex.proc.launcher import run_direct

    info = discover(device)
    rows = []
    for w in workloads:
        if progress is not None:
            progress(w)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
            out = tf.name
        rc = run_direct([*module_argv("krex.doctor.coverage"), w, out], "gpu", 0, info.count)
        try:
            with open(out) as f:
                d = json.load(f)
            rows.append(CoverageRow(**d))
        except (OSError, ValueError):
            rows.append(CoverageRow(w, {}, {}, 0, 0, False, f"workload failed (exit {rc})"))
        finally:
            if os.path.exists(out):
                os.unlink(out)
    return rows


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
