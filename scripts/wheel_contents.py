"""Check a built KREX wheel from the outside (binutils' readelf, the zip listing,
the metadata), independent of the build's own ELF reader:

  * the tag is cp310-abi3-manylinux_2_X_<arch> with 2.X <= --max-glibc;
  * the shim, the NVTX injection, the simulated GPU, the marker header, the extension, the corpus,
    the sitecustomize hook and the LICENSE are inside;
  * every ELF file is for <arch>, needs at most glibc --max-glibc and is stripped (no symbol
    table, no debug info: nothing of the build directory inside);
  * the metadata says License-Expression: Apache-2.0.

Prints one line per library (arch, highest GLIBC_ symbol version) and exits 1 on
any failure.  Usage: python scripts/wheel_contents.py WHEEL --arch x86_64"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRED = [
    "krex/_native.abi3.so",
    "krex/_lib/libkrex_interpose.so",
    "krex/_lib/libkrex_nvtx.so",
    "krex/_lib/libkrexsim.so",
    "krex/_lib/libcuda.so.1",
    "krex/_lib/libcudart.so.13",
    "krex/_lib/libamdhip64.so",
    "krex/_lib/krex.h",
    "krex/proc/_hook/sitecustomize.py",
    "krex/workloads/manifest.py",
    "krex/workloads/sim/sim_cmd.py",
    "krex/workloads/gpu/matmul.py",
    "krex/cli/main.py",
    "krex/proc/pytest_plugin.py",
    # one module of each package (a package missing from pyproject's list would be left out)
    "krex/node/freezer.py",
    "krex/proc/region.py",
    "krex/proc/autoregion/hook.py",
    "krex/device/gpus.py",
    "krex/doctor/checks.py",
    "krex/doctor/coverage.py",
    "krex/compare/stats.py",
    "krex/executor.py",
]
MACHINE = {"x86_64": "Advanced Micro Devices X86-64", "aarch64": "AArch64"}


def vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def readelf(path: Path) -> tuple[str, list[str]]:
    """(machine, GLIBC versions the file needs) as binutils reads them."""
    hdr = subprocess.run(["readelf", "-h", str(path)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Machine:\s+(.+)", hdr)
    ver = subprocess.run(
        ["readelf", "-V", "-W", str(path)], capture_output=True, text=True, check=True
    ).stdout
    needs = sorted(set(re.findall(r"Name: GLIBC_([\d.]+)", ver)), key=vtuple)
    return (m.group(1).strip() if m else "?"), needs


def unstripped(path: Path) -> list[str]:
    """The sections a shipped file should not carry: the symbol table and debug info."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    return sorted({s for s in re.findall(r"\]\s+(\.\S+)", out) if s == ".symtab" or s.startswith(".debug")})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--arch", required=True, choices=sorted(MACHINE))
    ap.add_argument("--max-glibc", default="2.17")
    a = ap.parse_args()
    problems: list[str] = []
    name = a.wheel.name
    m = re.match(r"krex_gpu-[^-]+-cp310-abi3-(.+)\.whl$", name)
    plats = m.group(1).split(".") if m else []
    want = re.compile(rf"manylinux_(\d+)_(\d+)_{a.arch}$")
    tagged = [want.match(p) for p in plats]
    if not m or not any(tagged):
        problems.append(f"tag of {name} is not cp310-abi3-manylinux_2_X_{a.arch}")
    for t in filter(None, tagged):
        if (int(t.group(1)), int(t.group(2))) > vtuple(a.max_glibc):
            problems.append(f"tag {t.group(0)} needs more than glibc {a.max_glibc}")
    print(f"wheel: {name}")
    with zipfile.ZipFile(a.wheel) as z, tempfile.TemporaryDirectory() as tmp:
        names = z.namelist()
        for r in REQUIRED:
            if r not in names:
                problems.append(f"{r} is missing from the wheel")
        if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
            problems.append("LICENSE is missing from the wheel's dist-info")
        meta = next((z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA")), "")
        if "License-Expression: Apache-2.0" not in meta:
            problems.append("METADATA has no License-Expression: Apache-2.0")
        z.extractall(tmp)
        print(f"{'library':34} {'machine':32} {'highest GLIBC_ needed':>22}")
        for n in sorted(names):
            p = Path(tmp) / n
            if p.read_bytes()[:4] != b"\x7fELF":
                continue
            machine, needs = readelf(p)
            top = needs[-1] if needs else "-"
            print(f"{n:34} {machine:32} {top:>22}")
            if machine != MACHINE[a.arch]:
                problems.append(f"{n} is for {machine}, not {a.arch}")
            if needs and vtuple(top) > vtuple(a.max_glibc):
                problems.append(f"{n} needs GLIBC_{top} > {a.max_glibc}")
            extra = unstripped(p)
            if extra:
                problems.append(f"{n} is not stripped ({', '.join(extra)}: {p.stat().st_size} bytes)")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    print("wheel contents: " + ("FAILED" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
