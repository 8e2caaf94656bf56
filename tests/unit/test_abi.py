"""The shared-memory layout must look the same from Python (cffi, which parses
interpose/krex_abi.h) and from C (the compiler that builds the shim)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import CC, CORE_SOURCES, INTERPOSE, REPO, SHIM_FILES

from krex.native import ffi, lib
from krex.node.shm import CLASS_NAMES, HOLDER_NAMES, PROC_FLAG_NAMES, PROC_STATE_BITS

STRUCTS = (
    "krex_header",
    "krex_gpu",
    "krex_slot",
    "krex_proc",
    "krex_shm",
    "krex_msg_hdr",
    "krex_req_register",
    "krex_rep_register",
    "krex_req_begin",
    "krex_rep_begin",
    "krex_rep_end",
)
ABI_H = (INTERPOSE / "krex_abi.h").read_text()
ABI_DEFINES = {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(KREX_\w+)\s+(-?\d+)\s*$", ABI_H, re.M)}


def _layout_c_items() -> list[tuple[str, str, str | None]]:
    """The expressions krex_abi_layout_c() evaluates, in order, read from
    LAYOUT_C in krex_build.py: ("sizeof", struct, None) or ("offsetof", struct, field)."""
    text = (REPO / "krex_build.py").read_text()
    body = text.split("size_t v[] = {", 1)[1].split("};", 1)[0]
    items: list[tuple[str, str, str | None]] = []
    for m in re.finditer(r"sizeof\(struct (\w+)\)|F\((\w+),\s*(\w+)\)", body):
        if m[1]:
            items.append(("sizeof", m[1], None))
        else:
            items.append(("offsetof", m[2], m[3]))
    return items


LAYOUT_ITEMS = _layout_c_items()


def _cffi_value(kind: str, struct: str, fld: str | None) -> int:
    if kind == "sizeof":
        return int(ffi.sizeof(f"struct {struct}"))
    return int(ffi.offsetof(f"struct {struct}", fld))


def test_layout_c_parsed() -> None:
    assert len(LAYOUT_ITEMS) >= 20, LAYOUT_ITEMS
    assert {s for k, s, _ in LAYOUT_ITEMS if k == "sizeof"} == set(STRUCTS)


def test_layout_c_count_matches_parse() -> None:
    """krex_abi_layout_c fills exactly as many values as LAYOUT_C lists, so the
    parse above cannot silently drop items."""
    sentinel = 0xDEADBEEF
    n = len(LAYOUT_ITEMS) + 4
    out = ffi.new(f"size_t[{n}]", [sentinel] * n)
    lib.krex_abi_layout_c(out, n)
    vals = list(out)
    assert sentinel not in vals[: len(LAYOUT_ITEMS)]
    assert vals[len(LAYOUT_ITEMS) :] == [sentinel] * 4


@pytest.mark.parametrize(
    "item", LAYOUT_ITEMS, ids=lambda it: f"{it[0]}-{it[1]}" + (f".{it[2]}" if it[2] else "")
)
def test_layout_c_matches_cffi(item: tuple[str, str, str | None]) -> None:
    n = len(LAYOUT_ITEMS)
    out = ffi.new(f"size_t[{n}]")
    lib.krex_abi_layout_c(out, n)
    idx = LAYOUT_ITEMS.index(item)
    assert int(out[idx]) == _cffi_value(*item), f"C says {int(out[idx])}, cffi says {_cffi_value(*item)}"


def _all_fields() -> list[tuple[str, str]]:
    return [(s, name) for s in STRUCTS for name, _ in ffi.typeof(f"struct {s}").fields]


def test_every_field_matches_gcc(tmp_path: Path) -> None:
    """Beyond LAYOUT_C's selection: every field of every struct, compiled by gcc
    from the same header, against cffi's view."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "krex_abi.h"', "int main(void) {"]
    for s in STRUCTS:
        lines.append(f'printf("sizeof {s} %zu\\n", sizeof(struct {s}));')
    for s, f in _all_fields():
        lines.append(f'printf("offsetof {s}.{f} %zu\\n", offsetof(struct {s}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([CC, "-O0", f"-I{INTERPOSE}", "-o", str(exe), str(src)], check=True)
    c_side = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        kind, what, val = line.split()
        c_side[(kind, what)] = int(val)
    py_side = {("sizeof", s): int(ffi.sizeof(f"struct {s}")) for s in STRUCTS}
    py_side.update({("offsetof", f"{s}.{f}"): int(ffi.offsetof(f"struct {s}", f)) for s, f in _all_fields()})
    diff = {k: (c_side.get(k), py_side[k]) for k in py_side if c_side.get(k) != py_side[k]}
    assert not diff, f"(C, cffi) disagree: {diff}"


def test_array_lengths_match_limits() -> None:
    """The header spells array lengths as literals (cffi cannot evaluate macros
    there); they must equal the KREX_MAX_* / KREX_NGATED constants."""
    shm = dict(ffi.typeof("struct krex_shm").fields)
    assert shm["gpus"].type.length == lib.KREX_MAX_GPUS
    assert shm["slots"].type.length == lib.KREX_MAX_SLOTS
    assert shm["procs"].type.length == lib.KREX_MAX_PROCS
    proc = dict(ffi.typeof("struct krex_proc").fields)
    assert proc["submits"].type.length == lib.KREX_NGATED
    assert len(CLASS_NAMES) == lib.KREX_NGATED


def test_every_abi_define_reaches_python() -> None:
    assert len(ABI_DEFINES) > 20
    missing = [n for n in ABI_DEFINES if not hasattr(lib, n)]
    assert not missing, f"defined in krex_abi.h but not in krex._native: {missing}"
    wrong = {n: (getattr(lib, n), v) for n, v in ABI_DEFINES.items() if getattr(lib, n) != v}
    assert not wrong, wrong


@pytest.mark.parametrize(
    "name",
    [
        "KREX_MAGIC",
        "KREX_ABI_VERSION",
        "KREX_MAX_GPUS",
        "KREX_MAX_SLOTS",
        "KREX_MAX_PROCS",
        "KREX_GATE_OPEN",
        "KREX_OWNER_NONE",
        "KREX_HOLDER_NONE",
        "KREX_HOLDER_REGION",
        "KREX_HOLDER_PAUSE",
        "KREX_SLOT_FREE",
        "KREX_SLOT_ACTIVE",
        "KREX_CLS_KERNEL",
        "KREX_CLS_COPY",
        "KREX_CLS_MEMSET",
        "KREX_CLS_GRAPH",
        "KREX_CLS_PREFETCH",
        "KREX_NGATED",
        "KREX_CLS_LOOKUP",
        "KREX_CLS_CTX",
        "KREX_PF_FAILED_OPEN",
        "KREX_HEARTBEAT_TIMEOUT_NS",
    ],
)
def test_named_constant_exists(name: str) -> None:
    assert isinstance(getattr(lib, name), int)


def test_constants_used_by_the_c_side_exist_in_python() -> None:
    """Every KREX_ identifier shim.c / krex_core.c use that names an ABI constant
    (as opposed to a macro or enum of the tables header) is visible to Python."""

    def code(f: str) -> str:  # without comments and string literals ("KREX_SHM" is an env var)
        text = (INTERPOSE / f).read_text()
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
        return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)

    used: set[str] = set()
    for f in (*SHIM_FILES, *CORE_SOURCES):
        used |= set(re.findall(r"\bKREX_[A-Z][A-Z0-9_]*\b", code(f)))
    local: set[str] = set()
    for f in (*SHIM_FILES, "krex_tables.h", "krex_cuda_types.h", "krex_env.h"):
        text = code(f)
        local |= set(re.findall(r"#define\s+(KREX_\w+)", text))
        for body in re.findall(r"\benum\s+\w+\s*\{(.*?)\}", text, flags=re.S):
            local |= set(re.findall(r"\b(KREX_\w+)", body))
    abi_used = {
        n
        for n in used
        if n not in local
        and not n.startswith(("KREX_ID_", "KREX_BODY_", "KREX_VAR_", "KREX_WRAP_"))
        and not n.endswith("_")  # a prefix of a pasted name (KREX_CLS_##cls)
    }
    assert {"KREX_MAX_GPUS", "KREX_HOLDER_REGION", "KREX_NGATED"} <= abi_used
    missing = sorted(n for n in abi_used if not hasattr(lib, n))
    assert not missing, f"the shim uses ABI names cffi does not know: {missing}"


def test_python_name_tables_cover_constants() -> None:
    holders = {v for k, v in ABI_DEFINES.items() if k.startswith("KREX_HOLDER_")}
    assert set(HOLDER_NAMES) == holders
    flags = {v for k, v in ABI_DEFINES.items() if k.startswith("KREX_PF_")}
    # Every KREX_PF_* bit is either a problem flag (named in reports) or a state, never both.
    assert not set(PROC_FLAG_NAMES) & set(PROC_STATE_BITS)
    assert set(PROC_FLAG_NAMES) | set(PROC_STATE_BITS) == flags
    classes = sorted(v for k, v in ABI_DEFINES.items() if k.startswith("KREX_CLS_"))
    assert len(set(classes)) == len(classes), "two KREX_CLS_* share a value"
    assert list(range(lib.KREX_NGATED)) == [
        lib.KREX_CLS_KERNEL,
        lib.KREX_CLS_COPY,
        lib.KREX_CLS_MEMSET,
        lib.KREX_CLS_GRAPH,
        lib.KREX_CLS_PREFETCH,
        lib.KREX_CLS_LIFE,
    ]
    assert len(CLASS_NAMES) == lib.KREX_NGATED and CLASS_NAMES[lib.KREX_CLS_LIFE] == "life"
