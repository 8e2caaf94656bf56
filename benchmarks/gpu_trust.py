#!/usr/bin/env python3
"""Trust checks on a real NVIDIA GPU (the trust issue, cases 6 and 7), in ONE call of
about 3 minutes. Writes logs to $OUT (default ./gpu-trust-out) and prints a table last.

  1. discovery: `--device auto` finds the GPU through NVML; CUDA_VISIBLE_DEVICES as the
     GPU's UUID selects the same GPU; `krex doctor` says segment and gpus are fine;
  2. attestation, clean: a torch region owner alone: the journal record has
     attest.nvml == "ok", SM clocks at entry and exit, no foreign process;
  3. attestation, foreign: the same owner while a torch process NOT under KREX runs
     matmuls on the same GPU: the region must be flagged "foreign-process" with its pid;
  4. cost: NVML sampling time per region (entry + exit samples), from 200 samples.

Needs torch with CUDA. Run: python benchmarks/gpu_trust.py  (as root for cgroups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "gpu-trust-out"))
OUT.mkdir(parents=True, exist_ok=True)
KREX = [sys.executable, "-m", "krex.cli.main"]
STATE = Path(tempfile.mkdtemp(prefix="krex-trust-"))
ENV = dict(os.environ, KREX_STATE_DIR=str(STATE), KREX_SHM=f"/krex-trust-{os.getpid()}")
ENV.pop("LD_PRELOAD", None)
rows: list[tuple[str, str, str]] = []

OWNER = r"""
import json, time, torch, krex
x = torch.randn(4096, 4096, device="cuda")
for _ in range(3): x @ x
torch.cuda.synchronize()
with krex.region() as r:
    t0 = time.time()
    while time.time() - t0 < 0.5:
        x @ x
    torch.cuda.synchronize()
print(json.dumps({"clean": r.clean, "flags": r.flags, "reasons": r.reasons, "pid": __import__("os").getpid()}))
"""
OUTSIDER = r"""
import time, torch
x = torch.randn(4096, 4096, device="cuda")
open(__import__("sys").argv[1], "w").close()
t0 = time.time()
while time.time() - t0 < 20:
    x @ x
    torch.cuda.synchronize()
"""


def sh(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, env=env or ENV, capture_output=True, text=True, timeout=timeout)
    with open(OUT / "log.txt", "a") as f:
        f.write(f"$ {' '.join(argv)}\nrc={p.returncode}\n{p.stdout}\n{p.stderr}\n")
    return p


def journal() -> list[dict[str, object]]:
    p = STATE / "journal.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def main() -> int:
    from krex.device.gpus import discover
    from krex.device.nvml import open_nvml

    info = discover("auto")
    rows.append(("discovery auto", info.kind, f"{info.count} GPU(s): {info.names[:1]}"))
    nv = open_nvml()
    uuid = nv.uuid(info.physical[0])
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    by_uuid = discover("auto")
    del os.environ["CUDA_VISIBLE_DEVICES"]
    rows.append(("CUDA_VISIBLE_DEVICES=<uuid>", "ok" if by_uuid.physical == [info.physical[0]] else "FAIL",
                 f"{uuid[:20]}... -> physical {by_uuid.physical}"))
    d = sh([*KREX, "doctor", "--json"])
    checks = {c["name"]: c["status"] for c in json.loads(d.stdout or "{}").get("checks", [])}
    rows.append(("doctor gpus/segment", f"{checks.get('gpus')}/{checks.get('segment')}", ""))
    env = dict(ENV, CUDA_VISIBLE_DEVICES=str(info.physical[0]))
    p = sh([*KREX, "run", "--device", "gpu", "--gpu", "0", "--", sys.executable, "-c", OWNER], env=env)
    own = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
    rec = journal()[-1] if journal() else {}
    att = rec.get("attest") or {}
    rows.append(("region alone", "ok" if own.get("clean") else "FLAGGED", f"attest {json.dumps(att)[:150]}"))
    ready = OUT / "outsider.ready"
    outsider = subprocess.Popen([sys.executable, "-c", OUTSIDER, str(ready)], env=dict(os.environ))
    try:
        t0 = time.time()
        while not ready.exists() and time.time() - t0 < 60:
            time.sleep(0.1)
        p = sh([*KREX, "run", "--device", "gpu", "--gpu", "0", "--", sys.executable, "-c", OWNER], env=env)
        own2 = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
        rec2 = journal()[-1] if journal() else {}
    finally:
        outsider.kill()
    foreign = [f.get("pid") for f in (rec2.get("attest") or {}).get("foreign", [])]  # type: ignore[union-attr]
    ok = "foreign-process" in (own2.get("flags") or []) and outsider.pid in foreign
    rows.append(("region + outsider", "FLAGGED (expected)" if ok else "NOT FLAGGED",
                 f"outsider pid {outsider.pid}, foreign {foreign}, flags {own2.get('flags')}"))
    from krex.node.attest import Attestor

    a = Attestor("nvidia", info.physical)
    t = time.perf_counter()
    for _ in range(200):
        a.sample(0)
    per = (time.perf_counter() - t) / 200
    rows.append(("NVML sample cost", f"{per * 1e3:.3f} ms", "x2 per region (entry, exit), off the owner's path"))
    sh([*KREX, "daemon", "stop"])
    (OUT / "rows.json").write_text(json.dumps(rows, indent=1))
    w = max(len(r[0]) for r in rows)
    for name, res, note in rows:
        print(f"{name:<{w}}  {res:<20}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
