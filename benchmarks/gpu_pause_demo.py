"""`krex pause` stops a running torch loop in another process; `krex resume`
restarts it. Prints progress and GPU utilisation (NVML) in each phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VICTIM = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
i = 0
while True:
    a @ a
    torch.cuda.synchronize()
    i += 1
    with open(sys.argv[1], 'w') as f:
        f.write(str(i))
"""


def progress(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def util(h: object) -> list[int]:
    import pynvml

    out = []
    for _ in range(10):
        out.append(int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
        time.sleep(0.1)
    return out


def main() -> None:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    prog = "/tmp/krex_pause_progress"
    krex = [sys.executable, "-m", "krex.cli.main"]
    victim = subprocess.Popen([*krex, "run", "--device", "gpu", "--", sys.executable, "-c", VICTIM, prog])
    phases = []
    try:
        for _ in range(120):
            if progress(prog) > 5:
                break
            time.sleep(0.5)
        p0 = progress(prog)
        u = util(h)
        phases.append({"phase": "running", "iters_in_1s": progress(prog) - p0, "util": u})
        t = time.monotonic()
        r = subprocess.run(
            [*krex, "pause", "--gpu", "0", "--timeout", "10", "--for", "60"], capture_output=True, text=True
        )
        phases.append(
            {
                "phase": "pause-cmd",
                "rc": r.returncode,
                "seconds": time.monotonic() - t,
                "out": r.stdout + r.stderr,
            }
        )
        time.sleep(0.5)
        p0 = progress(prog)
        u = util(h)
        time.sleep(1.0)
        phases.append({"phase": "paused", "iters_in_2s": progress(prog) - p0, "util": u})
        r = subprocess.run([*krex, "resume", "--gpu", "0"], capture_output=True, text=True)
        phases.append({"phase": "resume-cmd", "rc": r.returncode, "out": r.stdout + r.stderr})
        time.sleep(0.5)
        p0 = progress(prog)
        u = util(h)
        phases.append({"phase": "resumed", "iters_in_1s": progress(prog) - p0, "util": u})
    finally:
        victim.terminate()
        victim.wait(timeout=30)
    print(json.dumps(phases))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
