"""Build the native parts of KREX from the ONE C core in interpose/.

* ``ffibuilder`` -> the cffi extension ``krex._native`` (core + ABI, no hooks).
* ``build_native(outdir)`` -> ``libkrex_interpose.so`` (core + hooks), the NVTX
  injection ``libkrex_nvtx.so`` (KREX_NVTX_REGION: regions from NVTX ranges) and the
  simulated GPU (``libkrexsim.so``, ``libcuda.so.1``, ``libcudart.so.13``,
  ``libamdhip64.so``) plus the marker header ``krex.h``.

setup.py calls both; ``python krex_build.py [--strip] DIR`` runs the second by hand (a
wheel's files are stripped: ``--strip``). No build path is embedded (``-ffile-prefix-map``):
builds of the same sources from two directories are byte-identical.

The compiler (``toolchain()``): ``$KREX_CC`` if set, else ``$CC`` if set, else
``zig cc`` from the ``ziglang`` package targeting glibc ``$KREX_GLIBC`` (2.17), so
the wheel loads on RHEL/Rocky 7-8, Ubuntu 18.04+ and Amazon Linux 2, else gcc.
``KREX_TARGET=aarch64`` cross-builds with zig (Grace Hopper nodes).
``elf_requirements()`` reads what a built file needs from the C library; setup.py
tags the wheel from it, so a tag never claims more than the files deliver.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from cffi import FFI

ROOT = Path(__file__).resolve().parent
INTERPOSE = ROOT / "interpose"
# The core: krex._native and the shim both link it (so do test victims that use it).
CORE_SOURCES = ("krex_core.c", "seg_guard.c", "slot_table.c", "ctx_token.c")
# libkrex_interpose.so: the shim's parts (interpose/shim.h says what each holds) and the core.
SHIM_SOURCES = (
    "shim.c", "hooks.c", "resolve.c", "drain.c", "pace.c", "ctx_gate.c", "client.c", "wire.c", "nvtx_env.c",
    *CORE_SOURCES,
)
# The build directory never lands in what is built (debug info, __FILE__): two builds of the
# same sources from different directories give the same bytes.
PREFIX_MAP = [f"-ffile-prefix-map={ROOT}=.", f"-fdebug-prefix-map={ROOT}=."]
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fPIC", "-fvisibility=hidden",
          *PREFIX_MAP]


def cflags(strip: bool) -> list[str]:
    """CFLAGS; `strip` (what a wheel ships): no debug info and no symbol table (-s), about a
    tenth of the size (the shim: 5 MB with -g)."""
    return [("-s" if f == "-g" else f) for f in CFLAGS] if strip else list(CFLAGS)


def op_rows() -> list[tuple[str, int, str, str]]:
    """The KREX_OPS table of krex_abi.h: (NAME, code, request body, reply body)."""
    abi = (INTERPOSE / "krex_abi.h").read_text()
    table = abi.split("#define KREX_OPS(X)", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"X\((\w+),\s*(\d+),\s*(\w+),\s*(\w+)\)", table)
    return [(n, int(c), rq, rp) for n, c, rq, rp in rows]


def cdef_text() -> str:
    """The ABI header plus the core's CDEF block, with the preprocessor lines
    cffi cannot read removed, and the KREX_OPS rows as KREX_OP_* constants.
    Nothing is copied by hand."""
    abi = (INTERPOSE / "krex_abi.h").read_text()
    keep = []
    continued = False
    for line in abi.splitlines():
        if continued or line.startswith("#"):
            continued = line.rstrip().endswith("\\")
            if re.match(r"#define\s+KREX_\w+\s+-?\d+\s*$", line):
                keep.append(line)
            continue
        if "KREX_OPS(" in line:  # the C enum made from the table; cffi gets constants below
            continue
        keep.append(line)
    keep += [f"#define KREX_OP_{n} {c}" for n, c, _rq, _rp in op_rows()]
    core = (INTERPOSE / "krex_core.h").read_text()
    block = core.split("/* CDEF-BEGIN */")[1].split("/* CDEF-END */")[0]
    return "\n".join(keep) + "\n" + block + "\n" + OPS_CDEF + "void krex_abi_layout_c(size_t *out, int n);\n"


# The KREX_OPS table for Python (krex/protocol.py), expanded by the C preprocessor
# from the header's rows, so the op list exists once.
OPS_CDEF = """
struct krex_op_row { const char *name; int code; const char *request; const char *reply; };
int krex_op_rows(const struct krex_op_row **rows);
"""
OPS_C = r"""
struct krex_op_row { const char *name; int code; const char *request; const char *reply; };
static const struct krex_op_row krex_op_table[] = {
#define KREX_OP_ROW_(name, code, req, rep) {#name, code, #req, #rep},
    KREX_OPS(KREX_OP_ROW_)
#undef KREX_OP_ROW_
};
int krex_op_rows(const struct krex_op_row **rows) {
    *rows = krex_op_table;
    return (int)(sizeof krex_op_table / sizeof krex_op_table[0]);
}
"""


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
        sizeof(struct krex_msg_hdr), sizeof(struct krex_req_register), sizeof(struct krex_rep_register),
        sizeof(struct krex_req_begin), sizeof(struct krex_rep_begin), sizeof(struct krex_rep_end),
        F(krex_msg_hdr, op), F(krex_msg_hdr, status), F(krex_msg_hdr, body_len), F(krex_msg_hdr, json_len),
        F(krex_req_begin, gpu), F(krex_rep_end, cut),
    };
    for (int i = 0; i < n && i < (int)(sizeof v / sizeof v[0]); i++) out[i] = v[i];
}
"""

ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "krex._native",
    '#include "krex_core.h"\n' + LAYOUT_C + OPS_C,
    sources=[os.path.relpath(INTERPOSE / f, ROOT) for f in CORE_SOURCES],
    include_dirs=[os.path.relpath(INTERPOSE, ROOT)],
    extra_compile_args=["-O2"],
)


ARCHES = {"x86_64": 62, "aarch64": 183}  # ELF e_machine
DEFAULT_GLIBC = "2.17"
# What a manylinux wheel may need from the system (PEP 600); everything else ships inside.
SYSTEM_LIBS = re.compile(
    r"^(libc\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libm\.so\.6|"
    r"ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1)$"
)


# NamedTuple, not dataclass: cffi executes this file outside any module.
class Toolchain(NamedTuple):
    cc: tuple[str, ...]  # the compiler command (may be several words: zig cc -target ...)
    arch: str
    kind: str  # "zig" or "cc"


def host_arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _zig() -> str | None:
    try:
        import ziglang  # type: ignore[import-not-found]
    except ImportError:
        return None
    z = Path(ziglang.__file__).resolve().parent / "zig"
    return str(z) if z.is_file() else None


def toolchain() -> Toolchain:
    arch = os.environ.get("KREX_TARGET") or host_arch()
    if arch not in ARCHES:
        raise SystemExit(f"KREX_TARGET={arch!r}: KREX builds for {', '.join(ARCHES)}")
    cross = arch != host_arch()
    for var in ("KREX_CC", "CC"):
        raw = os.environ.get(var, "").strip()
        if raw and not (cross and var == "CC"):
            return Toolchain(tuple(shlex.split(raw)), arch, "zig" if "zig" in raw else "cc")
    zig = _zig()
    if zig:
        glibc = os.environ.get("KREX_GLIBC", DEFAULT_GLIBC)
        return Toolchain((zig, "cc", "-target", f"{arch}-linux-gnu.{glibc}"), arch, "zig")
    if cross:
        raise SystemExit(f"cross-building for {arch} needs zig: pip install ziglang")
    return Toolchain(("gcc",), arch, "cc")


def _cc(args: list[str]) -> None:
    subprocess.run([*toolchain().cc, *args], check=True, cwd=ROOT)


class ElfNeeds(NamedTuple):
    arch: str  # "x86_64", "aarch64" or "e_machine=N"
    needed: list[str]  # DT_NEEDED
    versions: dict[str, list[str]]  # library -> symbol versions it needs (GLIBC_2.17, ...)

    @property
    def max_glibc(self) -> tuple[int, ...]:
        vs = [
            tuple(int(x) for x in v[6:].split("."))
            for vv in self.versions.values()
            for v in vv
            if re.match(r"^GLIBC_\d+(\.\d+)*$", v)
        ]
        return max(vs, default=(2, 17))


def elf_requirements(path: str | os.PathLike[str]) -> ElfNeeds | None:
    """DT_NEEDED and the symbol versions of .gnu.version_r of a 64-bit little-endian
    ELF file, or None when it is not one."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (machine,) = struct.unpack_from("<H", data, 0x12)
    arch = next((a for a, m in ARCHES.items() if m == machine), f"e_machine={machine}")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def cstr(off: int) -> str:
        return data[off : data.index(b"\0", off)].decode(errors="replace")

    needed: list[str] = []
    versions: dict[str, list[str]] = {}
    for _n, typ, _fl, _addr, off, size, link, info, _al, _es in secs:
        stroff = secs[link][4] if link < len(secs) else 0
        if typ == 6:  # SHT_DYNAMIC
            for j in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, off + j)
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(stroff + val))
        elif typ == 0x6FFFFFFE:  # SHT_GNU_verneed: `info` entries
            p = off
            for _ in range(info):
                _ver, cnt, file_, aux, nxt = struct.unpack_from("<HHIII", data, p)
                lib_versions = versions.setdefault(cstr(stroff + file_), [])
                a = p + aux
                for _ in range(cnt):
                    _hash, _flags, _other, name, anext = struct.unpack_from("<IHHII", data, a)
                    lib_versions.append(cstr(stroff + name))
                    a += anext
                p += nxt
    return ElfNeeds(arch, needed, versions)


def platform_tag(files: list[Path]) -> str | None:
    """The most compatible platform tag that ``files`` (ELF objects of one wheel)
    honour: manylinux_2_X_<arch> when they need only the system libraries PEP 600
    allows (the rest must be among ``files``) and glibc 2.X at most, else
    linux_<arch>; None when there is no ELF file."""
    own = {f.name for f in files}
    arch, glibc, foreign = None, (2, 17), False
    for f in files:
        e = elf_requirements(f)
        if e is None:
            continue
        if arch not in (None, e.arch):
            raise SystemExit(f"{f} is for {e.arch}, other files for {arch}")
        arch = e.arch
        glibc = max(glibc, e.max_glibc)
        foreign |= any(not SYSTEM_LIBS.match(n) and n not in own for n in e.needed)
    if arch is None:
        return None
    if foreign or arch not in ARCHES:
        return f"linux_{arch}"
    tag = f"manylinux_{glibc[0]}_{glibc[1]}_{arch}"
    if glibc <= (2, 17):  # pip < 20.3 knows only the legacy alias
        tag += f".manylinux2014_{arch}"
    return tag


def build_native(outdir: str | os.PathLike[str], strip: bool = False) -> list[Path]:
    """Compile the shim and the simulated GPU into ``outdir``; return the files. ``strip``:
    as a wheel ships them (no debug info, no symbol table)."""
    flags = cflags(strip)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    i, sim = str(INTERPOSE), str(INTERPOSE / "sim")
    _cc(
        [
            *flags,
            "-shared",
            "-o",
            str(out / "libkrex_interpose.so"),
            *(f"{i}/{f}" for f in SHIM_SOURCES),
            "-ldl",
            "-lpthread",
        ]
    )
    # The NVTX injection: libc only; it finds the shim's region client at run time.
    _cc([*flags, "-shared", "-o", str(out / "libkrex_nvtx.so"), f"{i}/nvtx_inject.c", "-ldl", "-lpthread"])
    _cc(
        [
            *flags,
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
            *flags,
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
            *flags,
            "-shared",
            "-DSIM_API=0",
            "-o",
            str(out / "libcudart.so.13"),
            f"{sim}/sim_api.c",
            "-Wl,-soname,libcudart.so.13",
            # NVIDIA's libcudart versions its symbols (cudaLaunchKernel@@libcudart.so.13): a
            # dlvsym() lookup must find them here too (the shim's dlvsym is tested on it).
            f"-Wl,--version-script={sim}/cudart.map",
            *common,
            "-l:libcuda.so.1",
        ]
    )
    _cc(
        [
            *flags,
            "-shared",
            "-DSIM_API=2",
            "-o",
            str(out / "libamdhip64.so"),
            f"{sim}/sim_api.c",
            "-Wl,-soname,libamdhip64.so",
            f"-Wl,--version-script={sim}/hip.map",  # as AMD's (hipMalloc@@hip_4.2)
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
    try:
        build_guardian(out / "krex", strip)
    except (subprocess.CalledProcessError, OSError) as e:  # the Python `krex` still works
        print(f"krex_build: the native krex command was not built ({e}); `krex` stays the Python one",
              file=sys.stderr)
    return sorted(out.iterdir())


# The native `krex` (guardian.h holds what its files share).
GUARDIAN_SOURCES = ("guardian.c", "guardian_wire.c", "guardian_proc.c", "wire.c")  # wire.c: the shim's too
RUNOPTS = ROOT / "krex" / "proc" / "runopts.py"


def runopts_rows() -> list[tuple[str, str, bool]]:
    """(dest, flag, takes a value) of each option the native guardian takes: runopts.py's
    OPTIONS with native=True (the default), read from its source: the build cannot import
    krex (its C core is not built yet)."""
    import ast

    rows = []
    for node in ast.walk(ast.parse(RUNOPTS.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "RunOption"):
            continue
        dest, flag = (ast.literal_eval(a) for a in node.args[:2])
        typ = getattr(node.args[2], "id", "")
        native = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "native"), True)
        if native:
            rows.append((dest, flag, typ != "bool"))
    return rows


def runopts_header() -> str:
    """krex_runopts.h: the options guardian.c parses, as an X-macro (one table: runopts.py)."""
    rows = [f'    X({d}, "{f}", {int(v)})' for d, f, v in runopts_rows()]
    return (
        "/* Generated by krex_build.py from krex/proc/runopts.py (OPTIONS, native=True): the\n"
        " * options of `krex run` the native guardian takes. Do not edit. */\n"
        "#define KREX_RUNOPTS(X) \\\n" + " \\\n".join(rows) + "\n"
    )


def build_guardian(out: str | os.PathLike[str], strip: bool = False, lib_dir: Path | None = None) -> Path:
    """The native `krex` command (interpose/guardian.c: `krex run` without Python, and a
    hand-over to the Python CLI for everything else): GUARDIAN_SOURCES, libc only (wire.c,
    the frames of krexd's socket, is the shim's too).

    lib_dir names the krex/_lib it serves when no site-packages holds one: an editable
    install's bin/krex and `make native` (guardian.c own_install). A wheel's guardian finds
    site-packages, so its build names no path and two builds give the same bytes."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = [f for f in cflags(strip) if f not in ("-fPIC", "-fvisibility=hidden")]
    built = str((ROOT / "krex" / "_lib").resolve())
    if lib_dir is None and path.resolve().parent == Path(built):
        lib_dir = Path(built)
    # (A directory with a quote, backslash or newline is not named: that guardian hands
    # every command to the Python one, which finds its package itself.)
    if lib_dir is not None and not set(str(lib_dir.resolve())) & set('"\\\n'):
        flags.append(f'-DKREX_BUILT_LIB_DIR="{lib_dir.resolve()}"')
    sources = [str(INTERPOSE / f) for f in GUARDIAN_SOURCES]
    gen = ROOT / "build" / "guardian"
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "krex_runopts.h").write_text(runopts_header())
    _cc([*flags, "-std=gnu11", f"-I{gen}", f"-I{INTERPOSE}", "-o", str(path), *sources])
    return path


def build_cffi_inplace() -> Path:
    """`make native`: krex/_native.abi3.so from the same ffibuilder, without setuptools
    (a dev venv's may be too old to read pyproject.toml)."""
    import sysconfig

    src = ROOT / "build" / "_native.c"
    src.parent.mkdir(exist_ok=True)
    ffibuilder.emit_c_code(str(src))
    out = ROOT / "krex" / "_native.abi3.so"
    inc = sysconfig.get_paths()["include"]
    core = [str(INTERPOSE / f) for f in CORE_SOURCES]
    _cc([*CFLAGS, "-shared", f"-I{inc}", f"-I{INTERPOSE}", "-o", str(out), str(src), *core])
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--cffi"]:
        print(build_cffi_inplace())
        sys.exit(0)
    args = sys.argv[1:]
    strip = "--strip" in args  # as the wheel ships them
    args = [a for a in args if a != "--strip"]
    for f in build_native(args[0] if args else ROOT / "krex" / "_lib", strip=strip):
        print(f)
