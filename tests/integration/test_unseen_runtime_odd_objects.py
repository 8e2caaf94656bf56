"""The drain helper's look for a CUDA runtime the hooks cannot see reads every loaded
object's dynamic symbols from memory (krex_object_defines, interpose/resolve.c). Objects
laid out unlike an ordinary PIC library must neither crash the helper nor hide a runtime:
a library with only a SysV hash table (DT_HASH), one linked at an address it cannot be
loaded at (loaded below its link address: the loader's base offset wraps), the vdso, and
libraries that bring no runtime (never flagged), and ones whose dynamic section the loader
leaves unrelocated (a read-only PT_DYNAMIC, as the vdso's)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import Child, Harness

from krex.native import lib

LOADER = r"""
import ctypes, json, sys
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(5, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
assert rt.cudaDeviceSynchronize() == 0
print(json.dumps({"act": "ready"}), flush=True)
for line in sys.stdin:
    path = line.strip()
    if not path:
        break
    h = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    print(json.dumps({"act": "loaded", "path": path}), flush=True)
"""

RUNTIME = "void __cudaRegisterFatBinary(void) {}\n"
PLAIN = "int not_a_runtime(void) { return 1; }\n"


def _so(tmp: Path, name: str, src: str, *flags: str) -> Path:
    c = tmp / f"{name}.c"
    c.write_text(src)
    so = tmp / f"lib{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", *flags, "-o", str(so), str(c)], check=True)
    return so


def _dynamic_read_only(so: Path) -> None:
    """Clear PF_W in the PT_DYNAMIC program header: glibc then leaves the dynamic section's
    pointers unrelocated (link-time values), as it does the vdso's (l_ld_readonly)."""
    b = bytearray(so.read_bytes())
    phoff, phentsize, phnum = struct.unpack_from("<Q", b, 0x20)[0], *struct.unpack_from("<HH", b, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if struct.unpack_from("<I", b, at)[0] == 2:  # PT_DYNAMIC
            struct.pack_into("<I", b, at + 4, 4)  # p_flags = PF_R
    so.write_bytes(bytes(b))


def _look(h: Harness, pid: int) -> set[str]:
    seq = h.seg.look_request(0)
    r = h.seg.wait_look(0, [pid], seq, 5.0)
    assert r.ok, f"the helper did not answer a look: {r}"
    rec = h.proc(pid)
    assert rec is not None, "the loader's record is gone (did its helper crash the process?)"
    return set(rec.flags)


# A link address no mapping can take (above the user address space): the loader maps the
# library elsewhere, below it, and its base offset (dlpi_addr) wraps.
HIGH = "-Wl,-Ttext-segment=0xffff800000000"


@pytest.mark.parametrize(
    ("name", "src", "flags", "runtime"),
    [
        ("sysv_rt", RUNTIME, ("-Wl,--hash-style=sysv",), True),
        ("gnu_rt", RUNTIME, ("-Wl,--hash-style=gnu",), True),
        ("high_rt", RUNTIME, (HIGH,), True),
        ("high_sysv_rt", RUNTIME, (HIGH, "-Wl,--hash-style=sysv"), True),
        ("high_plain", PLAIN, (HIGH,), False),
        ("sysv_plain", PLAIN, ("-Wl,--hash-style=sysv",), False),
        ("rodyn_rt", RUNTIME, ("RODYN",), True),
        ("rodyn_high_rt", RUNTIME, (HIGH, "RODYN"), True),
        ("rodyn_sysv_rt", RUNTIME, ("-Wl,--hash-style=sysv", "RODYN"), True),
    ],
)
def test_odd_objects_are_read_without_a_crash_and_their_runtime_seen(
    harness: Harness, tmp_path: Path, name: str, src: str, flags: tuple[str, ...], runtime: bool
) -> None:
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)  # (the pid namespace: helpers publish their tid)
    so = _so(tmp_path, name, src, *(f for f in flags if f != "RODYN"))
    if "RODYN" in flags:
        _dynamic_read_only(so)
    child = Child([sys.executable, "-c", LOADER], h.env(h.claim()))
    h.children.append(child)
    child.expect(lambda d: d["act"] == "ready", 30, "ready")
    assert "unseen-runtime" not in _look(h, child.pid)  # the vdso, libc, python: none
    child.send(f"{so}\n")
    child.expect(lambda d: d["act"] == "loaded", 30, "loaded")
    got = _look(h, child.pid)
    assert child.alive(), f"the process died after the look: {child.stderr[-1500:]}"
    assert ("unseen-runtime" in got) == runtime, (name, got, child.stderr[-3000:])
    assert int(lib.KREX_PF_UNSEEN)  # (the flag the snapshot names unseen-runtime)


EXE = r"""
#include <stdio.h>
#include <unistd.h>
typedef struct { unsigned x, y, z; } dim3;
extern int cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **a, unsigned long sh, void *s);
extern int cudaDeviceSynchronize(void);
#ifdef RUNTIME
void __cudaRegisterFatBinary(void) {}
#endif
int main(void) {
    dim3 g = {5, 1, 1}, b = {1, 1, 1};
    if (cudaLaunchKernel((const void *)0x1234, g, b, 0, 0, 0) || cudaDeviceSynchronize()) return 1;
    printf("{\"act\": \"ready\"}\n");
    fflush(stdout);
    char buf[8];
    return fgets(buf, sizeof buf, stdin) ? 0 : 0;
}
"""


@pytest.mark.parametrize(
    ("name", "flags", "runtime"),
    [
        ("nopie", ("-no-pie",), False),
        ("nopie_rt", ("-no-pie", "-DRUNTIME"), True),
        ("nopie_rt_exported", ("-no-pie", "-DRUNTIME", "-rdynamic"), True),
        ("nopie_rt_stripped_exported", ("-no-pie", "-DRUNTIME", "-rdynamic", "-s"), True),
        ("pie_rt_exported_sysv", ("-DRUNTIME", "-rdynamic", "-s", "-Wl,--hash-style=sysv"), True),
    ],
)
def test_executables_are_read_without_a_crash_and_their_runtime_seen(
    harness: Harness, tmp_path: Path, name: str, flags: tuple[str, ...], runtime: bool
) -> None:
    """A non-PIE executable (loaded at its link address, dlpi_addr 0), with or without a
    runtime of its own, in its symbol table only or exported too, stripped or not."""
    from krex.native import LIB_DIR

    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    src = tmp_path / f"{name}.c"
    src.write_text(EXE)
    exe = tmp_path / name
    cc = ["gcc", *flags, "-o", str(exe), str(src), f"-L{LIB_DIR}", "-l:libcudart.so.13"]
    subprocess.run(cc, check=True)
    child = Child([str(exe)], h.env(h.claim()))
    h.children.append(child)
    child.expect(lambda d: d["act"] == "ready", 30, "ready")
    got = _look(h, child.pid)
    assert child.alive(), f"the process died after the look: {child.stderr[-1500:]}"
    assert ("unseen-runtime" in got) == runtime, (name, got)


def test_a_runtime_in_a_library_under_a_directory_named_like_libcudart_is_seen(
    harness: Harness, tmp_path: Path
) -> None:
    """libcudart itself is skipped (the hooks see its callers); a library of another name that
    brings its own runtime is not libcudart because a directory on its path is named so."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    d = tmp_path / "libcudart-bundle"
    d.mkdir()
    so = _so(d, "myext", RUNTIME)
    child = Child([sys.executable, "-c", LOADER], h.env(h.claim()))
    h.children.append(child)
    child.expect(lambda d: d["act"] == "ready", 30, "ready")
    child.send(f"{so}\n")
    child.expect(lambda d: d["act"] == "loaded", 30, "loaded")
    assert "unseen-runtime" in _look(h, child.pid), f"{so} was taken for libcudart by its directory's name"
