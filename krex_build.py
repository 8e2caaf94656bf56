"""Build the native parts of KREX from the ONE C core in interpose/.

* ``ffibuilder`` -> the cffi extension ``krex._native`` (core + ABI, no hooks).
* ``build_native(outdir)`` -> ``libkrex_interpose.so`` (core + hooks) and the
  simulated GPU (``libkrexsim.so``, ``libcuda.so.1``, ``libcudart.so.13``,
  ``libamdhip64.so``) plus the marker header ``krex.h``.

setup.py calls both; ``python krex_build.py DIR`` runs the second by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent
INTERPOSE = ROOT / "interpose"
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fPIC", "-fvisibility=hidden"]


def cdef_text() -> str:
    """The ABI header plus the core's CDEF block, with the preprocessor lines
    cffi cannot read removed. Nothing is copied by hand."""
    abi = (INTERPOSE / "krex_abi.h").read_text()
    keep = []
    for line in abi.splitlines():
        if line.startswith("#"):
            if re.match(r"#define\s+KREX_\w+\s+-?\d+\s*$", line):
                keep.append(line)
            continue
        keep.append(line)
    core = (INTERPOSE / "krex_core.h").read_text()
    block = core.split("/* CDEF-BEGIN */")[1].split("/* CDEF-END */")[0]
    return "\n".join(keep) + "\n" + block + "\nvoid krex_abi_layout_c(size_t *out, int n);\n"


# Offsets as C sees them, for tests/unit/test_abi.py to compare with cffi's.
LAYOUT_C = r"""
#include <stddef.h>
#define F(s, f) offsetof(struct s, f)
void krex_abi_layout_c(size_t *out, int n) {
    size_t v[] = {
        sizeof(struct krex_header), sizeof(struct krex_gpu), sizeof(struct krex_slot),
        sizeof(struct krex_proc), sizeof(struct krex_shm),
        F(krex_header, heartbeat_ns), F(krex_header, proc_overflows),
        F(krex_gpu, gate), F(krex_gpu, drain_seq), F(krex_gpu, epoch), F(krex_gpu, lease_deadline_ns),
        F(krex_gpu, fail_opens), F(krex_slot, inflight), F(krex_slot, generation),
        F(krex_proc, inflight), F(krex_proc, drain_ack), F(krex_proc, submits), F(krex_proc, blocked_ns),
        F(krex_proc, drains), F(krex_shm, gpus), F(krex_shm, slots), F(krex_shm, procs),
    };
    for (int i = 0; i < n && i < (int)(sizeof v / sizeof v[0]); i++) out[i] = v[i];
}
"""

ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "krex._native",
    '#include "krex_core.h"\n' + LAYOUT_C,
    sources=[os.path.relpath(INTERPOSE / "krex_core.c", ROOT)],
    include_dirs=[os.path.relpath(INTERPOSE, ROOT)],
    extra_compile_args=["-O2"],
)


def _cc(args: list[str]) -> None:
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, *args], check=True, cwd=ROOT)


def build_native(outdir: str | os.PathLike[str]) -> list[Path]:
    """Compile the shim and the simulated GPU into ``outdir``; return the files."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    i, sim = str(INTERPOSE), str(INTERPOSE / "sim")
    _cc(
        [
            *CFLAGS,
            "-shared",
            "-o",
            str(out / "libkrex_interpose.so"),
            f"{i}/shim.c",
            f"{i}/krex_core.c",
            "-ldl",
            "-lpthread",
        ]
    )
    _cc(
        [
            *CFLAGS,
            "-shared",
            "-o",
            str(out / "libkrexsim.so"),
            f"{sim}/simgpu.c",
            "-Wl,-soname,libkrexsim.so",
            "-lpthread",
        ]
    )
    # -Bsymbolic: a simulated library's own references must not be interposed by the shim.
    common = ["-Wl,-Bsymbolic", f"-L{out}", "-lkrexsim", "-Wl,-rpath,$ORIGIN", "-ldl"]
    _cc(
        [
            *CFLAGS,
            "-shared",
            "-DSIM_API=1",
            "-o",
            str(out / "libcuda.so.1"),
            f"{sim}/sim_api.c",
            "-Wl,-soname,libcuda.so.1",
            *common,
        ]
    )
    _cc(
        [
            *CFLAGS,
            "-shared",
            "-DSIM_API=0",
            "-o",
            str(out / "libcudart.so.13"),
            f"{sim}/sim_api.c",
            "-Wl,-soname,libcudart.so.13",
            *common,
            "-l:libcuda.so.1",
        ]
    )
    _cc(
        [
            *CFLAGS,
            "-shared",
            "-DSIM_API=2",
            "-o",
            str(out / "libamdhip64.so"),
            f"{sim}/sim_api.c",
            "-Wl,-soname,libamdhip64.so",
            *common,
        ]
    )
    # Development links, so that `-lcuda -lcudart` work against the simulator.
    for link, target in (("libcuda.so", "libcuda.so.1"), ("libcudart.so", "libcudart.so.13")):
        p = out / link
        if p.is_symlink() or p.exists():
            p.unlink()
        p.symlink_to(target)
    shutil.copy2(INTERPOSE / "include" / "krex.h", out / "krex.h")
    return sorted(out.iterdir())


if __name__ == "__main__":
    for f in build_native(sys.argv[1] if len(sys.argv) > 1 else ROOT / "krex" / "_lib"):
        print(f)
