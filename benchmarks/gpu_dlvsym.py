"""Does a dlvsym() lookup of a versioned CUDA symbol reach an ungated entry point?

NVIDIA's libraries version their exports (cudaLaunchKernel@@libcudart.so.13): besides
dlsym, a program (or a library that loads CUDA itself) can ask for a symbol of one
version with dlvsym(handle, name, version). The shim intercepts dlsym through its tables
and, since this check was written, dlvsym too (interpose/resolve.c). This script checks it
on the real libraries:

    python benchmarks/gpu_dlvsym.py                  # the H200: real libcudart and libcuda
    python benchmarks/gpu_dlvsym.py --device sim     # the simulated GPU (logic only)

For libcudart (found next to torch's CUDA wheels, or --cudart PATH) and libcuda.so.1
(--cuda PATH), it reads every versioned symbol each defines (its ELF version tables, no
binutils needed), keeps those the shim's tables gate (interpose/api_*.def), and, in a
command under `krex run --device D` (the shim active), looks each up three ways:
  dlvsym   the process's dlvsym (the shim's, first in the global scope);
  libc     glibc's own dlvsym, called directly: what a shim without a dlvsym hook gave;
  dlsym    the process's dlsym, for comparison (known to be hooked).
Each pointer is placed with dladdr: in libkrex_interpose.so (a gate wrapper) or in the
vendor library (ungated). The same lookups run once more without KREX (the baseline: the
versioned symbols exist and resolve).

Prints one JSON line per library and a verdict; exit status 0 when no versioned gated
entry is reachable ungated through the process's dlvsym under KREX, 1 when some is (their
names are listed), 2 when the check could not run. Writes $OUT/gpu_dlvsym.json (default
/tmp)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
KREX = [PY, "-c", "import sys; from krex.cli.main import main; sys.exit(main())"]


def table_names() -> set[str]:
    """Every entry of the shim's tables (the names its dlsym binds to wrappers)."""
    names: set[str] = set()
    for t in ("api_cudart.def", "api_driver.def", "api_hip.def"):
        names |= set(re.findall(r"^X\((\w+),", (REPO / "interpose" / t).read_text(), re.M))
    return names


def versioned_symbols(path: str) -> dict[str, list[str]]:
    """name -> the versions it is defined with (ELF64 little-endian: .dynsym, .gnu.version,
    .gnu.version_d by their section types)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    by_type = {s[1]: s for s in secs}
    dynsym, versym, verdef = by_type.get(11), by_type.get(0x6FFFFFFF), by_type.get(0x6FFFFFFD)
    if dynsym is None or versym is None or verdef is None:
        return {}
    strtab = secs[dynsym[6]]
    strs = data[strtab[4]:strtab[4] + strtab[5]]

    def cstr(off: int) -> str:
        return strs[off:strs.index(b"\0", off)].decode()

    vnames: dict[int, str] = {}
    off = verdef[4]
    for _ in range(verdef[7] or 64):  # sh_info: the number of definitions
        _ver, _flags, ndx, _cnt, _hash, aux, nxt = struct.unpack_from("<HHHHIII", data, off)
        name_off, = struct.unpack_from("<I", data, off + aux)
        vnames[ndx] = cstr(name_off)
        if not nxt:
            break
        off += nxt
    out: dict[str, list[str]] = {}
    n = dynsym[5] // 24
    for i in range(n):
        st_name, _info, _other, shndx, _value, _size = struct.unpack_from("<IBBHQQ", data, dynsym[4] + 24 * i)
        v, = struct.unpack_from("<H", data, versym[4] + 2 * i)
        idx = v & 0x7FFF
        if shndx == 0 or idx < 2 or idx not in vnames:
            continue
        out.setdefault(cstr(st_name), []).append(vnames[idx])
    return out


def find_cudart(device: str) -> str | None:
    if device == "sim":
        import krex.native as n

        return str(Path(n.LIB_DIR) / "libcudart.so.13")
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r and os.path.isdir(r)):
        for pat in ("nvidia/cu13/lib/libcudart.so.1*", "nvidia/cuda_runtime/lib/libcudart.so.1*",
                    "nvidia/*/lib/libcudart.so.1*", "torch/lib/libcudart*.so*"):
            hits = sorted(glob.glob(os.path.join(root, pat)))
            if hits:
                return hits[-1]
    for d in ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"):
        hits = sorted(glob.glob(os.path.join(d, "libcudart.so.1*")))
        if hits:
            return hits[-1]
    return None


def find_cuda(device: str) -> str | None:
    if device == "sim":
        import krex.native as n

        return str(Path(n.LIB_DIR) / "libcuda.so.1")
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    m = re.search(r"libcuda\.so\.1 .*=> (\S+)", out)
    return m.group(1) if m else None


# The lookups, in the command (under KREX or not). argv: JSON {path: {name: [versions]}}.
CHILD = r"""
import ctypes, json, sys
want = json.loads(sys.argv[1])
RTLD_NOW, RTLD_GLOBAL = 2, 0x100
glob_ = ctypes.CDLL(None)                  # the process's global scope: the shim's hooks first
own_dlvsym = glob_.dlvsym
own_dlsym = glob_.dlsym
libc_dlvsym = ctypes.CDLL("libc.so.6").dlvsym  # glibc's own (looked up in libc's handle)
for f in (own_dlvsym, libc_dlvsym):
    f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
own_dlsym.restype, own_dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]

class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
dladdr = glob_.dladdr
dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]

def where(p):
    if not p:
        return "none"
    i = DlInfo()
    if not dladdr(p, ctypes.byref(i)) or not i.fname:
        return "unknown"
    f = i.fname.decode(errors="replace")
    return "shim" if "libkrex_interpose" in f else "vendor"

try:
    active = bool(glob_.krex_shim_active())
except AttributeError:
    active = False
res = {"shim_active": active, "libs": {}}
for path, syms in want.items():
    h = ctypes.CDLL(path, mode=RTLD_NOW | RTLD_GLOBAL)._handle
    rows = []
    for name, versions in sorted(syms.items()):
        for v in versions:
            rows.append({"name": name, "version": v,
                         "dlvsym": where(own_dlvsym(h, name.encode(), v.encode())),
                         "libc": where(libc_dlvsym(h, name.encode(), v.encode())),
                         "dlsym": where(own_dlsym(h, name.encode()))})
    res["libs"][path] = rows
print("RESULT " + json.dumps(res), flush=True)
"""


def run_child(argv_prefix: list[str], want: dict[str, dict[str, list[str]]], env: dict[str, str]) -> dict:
    p = subprocess.run([*argv_prefix, PY, "-c", CHILD, json.dumps(want)], env=env, capture_output=True,
                       text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"the lookup command failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["gpu", "sim"], default="gpu")
    ap.add_argument("--cudart", default=None, help="libcudart to check (default: found next to the CUDA wheels)")
    ap.add_argument("--cuda", default=None, help="libcuda.so.1 to check (default: ldconfig's)")
    a = ap.parse_args()
    names = table_names()
    libs = [p for p in (a.cudart or find_cudart(a.device), a.cuda or find_cuda(a.device)) if p]
    if not libs:
        print("krex: error: found neither libcudart nor libcuda.so.1\n  fix: give --cudart and --cuda",
              file=sys.stderr)
        return 2
    want: dict[str, dict[str, list[str]]] = {}
    summary: dict[str, dict] = {}
    for path in libs:
        real = os.path.realpath(path)
        syms = versioned_symbols(real)
        gated = {n: v for n, v in syms.items() if n in names}
        want[real] = gated
        summary[real] = {"versioned_symbols": len(syms), "versioned_table_entries": len(gated),
                         "versions": sorted({v for vs in syms.values() for v in vs})}
    env = dict(os.environ)
    baseline = run_child([], want, {k: v for k, v in env.items() if not k.startswith("KREX_")
                                    and k != "LD_PRELOAD"})
    under = run_child([*KREX, "-q", "run", "--device", a.device, "--"], want, env)
    if not under["shim_active"]:
        print("krex: error: the shim was not active under `krex run`: the check proves nothing",
              file=sys.stderr)
        return 2
    ungated: list[str] = []
    for path, rows in under["libs"].items():
        s = summary[path]
        s["krex_dlvsym_in_shim"] = sum(r["dlvsym"] == "shim" for r in rows)
        s["krex_dlvsym_in_vendor"] = [f"{r['name']}@{r['version']}" for r in rows if r["dlvsym"] == "vendor"]
        s["krex_libc_dlvsym_in_vendor"] = sum(r["libc"] == "vendor" for r in rows)  # without a dlvsym hook
        s["krex_dlsym_in_shim"] = sum(r["dlsym"] == "shim" for r in rows)
        s["baseline_resolved"] = sum(r["dlvsym"] == "vendor" for r in baseline["libs"][path])
        ungated += s["krex_dlvsym_in_vendor"]
        print(json.dumps({"lib": path, **s}))
    out = Path(os.environ.get("OUT", "/tmp")) / "gpu_dlvsym.json"
    out.write_text(json.dumps({"device": a.device, "summary": summary, "under_krex": under,
                               "baseline": baseline}, indent=1))
    n = sum(s["versioned_table_entries"] for s in summary.values())
    hook_mattered = sum(s["krex_libc_dlvsym_in_vendor"] for s in summary.values())
    if ungated:
        print(f"VERDICT: {len(ungated)} of {n} versioned gated entries reach an ungated entry point through "
              f"dlvsym under KREX: {ungated[:10]}")
        return 1
    print(f"VERDICT: all {n} versioned gated entries come back gated through dlvsym under KREX; without the "
          f"shim's dlvsym hook {hook_mattered} of them would have been ungated (glibc's own dlvsym). "
          f"Raw rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
