"""The api_*.def tables: every prototype matches the vendor's, the tables are
well formed, and the types krex_cuda_types.h copies have the vendor's layout.

(a) needs the real CUDA 13 headers (skipped only where none are installed);
HIP rows are not compared (no HIP headers on CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import CC, INTERPOSE, driver_list
from helpers.tables import (
    GATED_CLASSES,
    OTHER_CLASSES,
    RET,
    TABLES,
    VARIANTS,
    Row,
    cuda_root,
    param_names,
    rows,
    split_top,
)

ROWS = rows()
CUDA_ROWS = [r for r in ROWS if r.api in ("cudart", "driver")]
ROOT = cuda_root()
needs_cuda = pytest.mark.skipif(
    ROOT is None, reason="no CUDA 13 headers (/usr/local/cuda*/include, $CUDA_HOME)"
)

# Rows whose vendor declaration a C compiler cannot see, with the reason. They are
# still checked: with nvcc when the toolkit has it, else against the declaration
# text extracted from the header.
CXX_ONLY = {
    "__cudaLaunchKernel": "declared only in crt/device_functions.h inside #ifdef __CUDACC__ "
    "(nvcc's host pass); neither C nor g++ -x c++ with crt/host_runtime.h sees it",
    "__cudaLaunchKernel_ptsz": "same as __cudaLaunchKernel",
}
SELFTEST = "__selftest_wrong_prototype__"


# ------------------------------------------------------------------ (a) prototypes


def _c_assert(r: Row, label: str | None = None, params: str | None = None) -> str:
    return (
        f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{r.name}), "
        f'{RET[r.api]} (*) {params or r.params}), "{label or r.name}");'
    )


def _compile_errors(cmd: list[str], pattern: str) -> tuple[int, dict[int, list[str]]]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    errs: dict[int, list[str]] = {}
    for m in re.finditer(pattern, p.stderr):
        errs.setdefault(int(m[1]), []).append(m[2].strip())
    return p.returncode, errs


def check_in_c(root: Path, tmp: Path) -> dict[str, str]:
    """One gcc run over all CUDA rows. `#undef NAME` first, so that a vendor
    macro renaming NAME (cuMemcpyHtoD -> cuMemcpyHtoD_v2) cannot hide the
    legacy symbol. Returns {name: "ok" | "undeclared" | "mismatch: ..."}."""
    lines = ["#include <cuda.h>", "#include <cuda_runtime_api.h>"]
    where: dict[int, str] = {}
    for r in CUDA_ROWS:
        lines.append(f"#undef {r.name}")
        lines.append(_c_assert(r))
        where[len(lines)] = r.name
    # A row with a deliberately wrong parameter type: proves a mismatch is caught.
    launch = next(r for r in CUDA_ROWS if r.name == "cudaLaunchKernel")
    lines.append(_c_assert(launch, SELFTEST, launch.params.replace("size_t sharedMem", "int sharedMem")))
    where[len(lines)] = SELFTEST
    src = tmp / "rows.c"
    src.write_text("\n".join(lines) + "\n")
    _, errs = _compile_errors(
        [CC, "-fsyntax-only", "-D__CUDA_API_VERSION_INTERNAL", f"-I{root / 'include'}", str(src)],
        r"rows\.c:(\d+):\d+: error: ([^\n]*)",
    )
    unmapped = set(errs) - set(where)
    assert not unmapped, f"errors outside the assertions: {[errs[k] for k in sorted(unmapped)]}"
    out = {}
    for line, name in where.items():
        msgs = errs.get(line, [])
        if not msgs:
            out[name] = "ok"
        elif any("undeclared" in m for m in msgs):
            out[name] = "undeclared"
        else:
            out[name] = "mismatch: " + "; ".join(msgs)
    return out


def check_with_nvcc(root: Path, tmp: Path, names: list[str]) -> dict[str, str] | None:
    """C++ static_asserts compiled by nvcc (host pass only; no GPU needed).
    None when nvcc is missing or cannot compile at all here."""
    nvcc = root / "bin" / "nvcc"
    if not nvcc.exists():
        return None
    lines = ["#include <type_traits>"]
    where = {}
    for r in CUDA_ROWS:
        if r.name in names:
            lines.append(
                f"static_assert(std::is_same<decltype(&{r.name}), {RET[r.api]} (*) {r.params}>::value, "
                f'"{r.name}");'
            )
            where[len(lines)] = r.name
    src = tmp / "rows.cu"
    src.write_text("\n".join(lines) + "\n")
    rc, errs = _compile_errors(
        [str(nvcc), "-c", "-o", str(tmp / "rows.o"), str(src)], r"rows\.cu\((\d+)\): error: ([^\n]*)"
    )
    if rc != 0 and not set(errs) & set(where):
        return None  # nvcc itself is unusable here (host compiler, ...): fall back
    return {n: ("mismatch: " + "; ".join(errs[ln]) if ln in errs else "ok") for ln, n in where.items()}


def check_extracted(root: Path, tmp: Path, names: list[str]) -> dict[str, str]:
    """Copy the vendor's declaration text out of crt/device_functions.h and let
    gcc compare it with the row."""
    text = (root / "include" / "crt" / "device_functions.h").read_text(errors="replace")
    lines = ["#include <cuda_runtime_api.h>"]
    where = {}
    out: dict[str, str] = {}
    for r in CUDA_ROWS:
        if r.name not in names:
            continue
        m = re.search(
            r'extern\s+"C"\s+cudaError_t\s+CUDARTAPI\s+' + re.escape(r.name) + r"\s*\(([^;]*?)\)\s*;", text
        )
        if not m:
            out[r.name] = "undeclared"
            continue
        lines.append(f"cudaError_t CUDARTAPI {r.name}({m[1]});")
        lines.append(_c_assert(r))
        where[len(lines)] = r.name
    src = tmp / "extracted.c"
    src.write_text("\n".join(lines) + "\n")
    _, errs = _compile_errors(
        [CC, "-fsyntax-only", f"-I{root / 'include'}", str(src)], r"extracted\.c:(\d+):\d+: error: ([^\n]*)"
    )
    for ln, n in where.items():
        out[n] = "mismatch: " + "; ".join(errs[ln]) if ln in errs else "ok"
    return out


@pytest.fixture(scope="module")
def vendor_check(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    assert ROOT is not None
    tmp = tmp_path_factory.mktemp("vendor")
    c = check_in_c(ROOT, tmp)
    undeclared = sorted(n for n, s in c.items() if s == "undeclared")
    cxx = check_with_nvcc(ROOT, tmp, undeclared)
    how = "nvcc"
    if cxx is None:
        cxx, how = check_extracted(ROOT, tmp, undeclared), "extracted declaration"
    final = dict(c)
    for n in undeclared:
        final[n] = f"{cxx[n]} (via {how})"
    return {"c": c, "final": final, "undeclared_in_c": undeclared, "how": how}


@needs_cuda
@pytest.mark.parametrize("row", CUDA_ROWS, ids=lambda r: r.name)
def test_row_matches_vendor_header(row: Row, vendor_check: dict[str, Any]) -> None:
    status = vendor_check["final"][row.name]
    assert status.startswith("ok"), f"{row.api} {row.name}{row.params}: {status}"


@needs_cuda
def test_vendor_check_can_fail(vendor_check: dict[str, Any]) -> None:
    assert vendor_check["c"][SELFTEST].startswith("mismatch"), vendor_check["c"][SELFTEST]


@needs_cuda
def test_only_known_rows_need_cxx(vendor_check: dict[str, Any]) -> None:
    assert vendor_check["undeclared_in_c"] == sorted(CXX_ONLY), (
        "rows a C compiler cannot find in the vendor headers changed; a new one is probably a typo "
        f"in the table: {vendor_check['undeclared_in_c']}"
    )


@needs_cuda
def test_extracted_declarations_match(tmp_path: Path) -> None:
    """The fallback used where nvcc is missing agrees too (exercised everywhere)."""
    assert ROOT is not None
    res = check_extracted(ROOT, tmp_path, sorted(CXX_ONLY))
    assert all(s == "ok" for s in res.values()), res


# -------------------------------------------------------- vendor entries vs table

GATED_FAMILY = re.compile(
    r"^(cu|cuda)(Memcpy|Memset|MemPrefetch|MemDiscardAndPrefetch|Launch|GraphLaunch|GraphUpload)"
)
# Ordering-only calls stay ungated by design (docs/design/data-plane.md, "Ungated on purpose").
UNGATED_BY_DESIGN = {
    "cuLaunchHostFunc",
    "cuLaunchHostFunc_ptsz",
    "cudaLaunchHostFunc",
    "cudaLaunchHostFunc_ptsz",
}


def _vendor_submission_names() -> list[str]:
    if ROOT is None:
        return []
    src = "#include <cuda.h>\n#include <cuda_runtime_api.h>\n"
    out = subprocess.run(
        [CC, "-E", "-P", "-D__CUDA_API_VERSION_INTERNAL", f"-I{ROOT / 'include'}", "-x", "c", "-"],
        input=src,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = set(re.findall(r"\b(?:CUresult|cudaError_t)\s+(\w+)\s*\(", out))
    return sorted(n for n in names if GATED_FAMILY.match(n) and n not in UNGATED_BY_DESIGN)


VENDOR_NAMES = _vendor_submission_names()


@needs_cuda
def test_vendor_names_found() -> None:
    assert len(VENDOR_NAMES) > 150 and "cuLaunchKernelEx" in VENDOR_NAMES


@needs_cuda
@pytest.mark.parametrize(
    "name",
    VENDOR_NAMES,
)
def test_vendor_submission_entry_is_gated(name: str) -> None:
    """Every kernel/copy/memset/prefetch/graph entry point the CUDA 13 headers
    declare (default, per-thread and legacy-ABI variants) has a gated table row."""
    by_name = {r.name: r for r in ROWS}
    assert name in by_name, f"{name} is declared by CUDA 13 but not intercepted"
    assert by_name[name].gated, f"{name} is in the table but as class {by_name[name].cls}"


# ----------------------------------------------------------------- (b) well formed


def test_rows_parsed() -> None:
    counts = Counter(r.api for r in ROWS)
    assert set(counts) == {api for api, _ in TABLES} and min(counts.values()) > 20, counts


def test_no_duplicate_names() -> None:
    dup = [n for n, k in Counter(r.name for r in ROWS).items() if k > 1]
    assert not dup, f"listed twice (the shim would export two hooks of one name): {dup}"


def _bodies(path: Path, prefix: str) -> set[str]:
    return set(re.findall(rf"#define\s+{prefix}_BODY_(\w+)\(", path.read_text()))


def test_classes_and_variants_known() -> None:
    """A class is known when the shim and the simulator both implement it; only
    the five submission classes are gated."""
    shim, sim = _bodies(INTERPOSE / "hooks.c", "KREX"), _bodies(INTERPOSE / "sim" / "sim_api.c", "SIM")
    assert set(GATED_CLASSES) | set(OTHER_CLASSES) <= shim & sim
    bad = [(r.name, r.cls, r.variant) for r in ROWS if r.cls not in shim & sim or r.variant not in VARIANTS]
    assert not bad, bad
    assert {r.cls for r in ROWS if r.gated} == set(GATED_CLASSES)


ORDERING_ONLY = re.compile(
    r"^(cu|cuda|hip)(StreamWriteValue|StreamWaitValue|StreamBatchMemOp|LaunchHostFunc|StreamAddCallback"
    r"|EventRecord|StreamWaitEvent|GreenCtxRecordEvent|GreenCtxWaitEvent)"
)


def test_calls_that_only_order_a_streams_work_are_not_gated() -> None:
    """Gated, a sibling's stream waiting for a value a parked call was to write would hold a
    region's drain to its timeout; they use no engine a region measures."""
    gated = [r.name for r in ROWS if r.gated and ORDERING_ONLY.match(r.name)]
    assert gated == [], gated


def test_every_gated_row_has_a_sample() -> None:
    bad = [r.name for r in ROWS if r.gated and not split_top(r.sample or "()")]
    assert not bad, f"gated rows without a sample: {bad}"


def test_sample_and_args_arity_match_params() -> None:
    bad = []
    for r in ROWS:
        n = len(param_names(r.params))
        if param_names(r.params) != split_top(r.args):
            bad.append((r.name, "args", r.args))
        if r.sample and len(split_top(r.sample)) != n:
            bad.append((r.name, "sample", r.sample))
    assert not bad, bad


def test_green_context_rows_track_their_contexts_and_only_order_nothing() -> None:
    """Green contexts are made and destroyed as a context is (LIFE calls that track the
    CUcontext for the drain helper); the conversion is recorded, not gated; their stream
    creation, like every stream creation, and their event record and wait (ordering only)
    have no row."""
    by_name = {r.name: r for r in ROWS}
    assert {n: by_name[n].cls for n in ("cuGreenCtxCreate", "cuGreenCtxDestroy", "cuCtxFromGreenCtx")} == {
        "cuGreenCtxCreate": "GREENNEW",
        "cuGreenCtxDestroy": "GREENDEL",
        "cuCtxFromGreenCtx": "GREENCTX",
    }
    assert not {"cuGreenCtxStreamCreate", "cuGreenCtxRecordEvent", "cuGreenCtxWaitEvent"} & set(by_name)
    assert [r.name for r in ROWS if r.cls.startswith("GREEN") and r.api != "driver"] == []


def test_per_thread_variants_are_named_so() -> None:
    """PT rows carry a per-thread suffix; a suffixed row is PT, or V1 (legacy ABI
    of a per-thread variant, never returned by a modern lookup)."""
    suffixed = ("_ptsz", "_ptds", "_spt")
    bad = [r.name for r in ROWS if r.variant == "PT" and not r.name.endswith(suffixed)]
    bad += [r.name for r in ROWS if r.name.endswith(suffixed) and r.variant not in ("PT", "V1")]
    assert not bad, bad


def test_lookup_and_ctx_rows_have_the_names_the_shim_uses() -> None:
    need = {
        "LOOKUP": {"symbol", "pfn", "flags"},
        "CTXNEW": {"pctx"},
        "CTXDEL": {"ctx"},
        "GREENNEW": {"phCtx"},
        "GREENDEL": {"hCtx"},
        "GREENCTX": {"pContext", "hCtx"},
    }
    bad = [r.name for r in ROWS if r.cls in need and not need[r.cls] <= set(param_names(r.params))]
    assert not bad, bad


def test_chunk_specs_name_the_rows_parameters() -> None:
    """A chunk spec (COPY(bytes, dst, src) / SET(elements, size, dst, value)) sits on a
    COPY or MEMSET row, names its parameters, counts in an unsigned size type, and a
    memset's element size matches the value's type."""
    sizes = {"unsigned char": 1, "unsigned short": 2, "unsigned int": 4, "int": 4}
    bad = []
    for r in ROWS:
        m = re.fullmatch(r"(NONE)|COPY\((\w+), (\w+), (\w+)\)|SET\((\w+), ([124]), (\w+), (\w+)\)", r.chunk)
        if not m:
            bad.append((r.name, r.chunk))
            continue
        if m[1]:
            continue
        types = {param_names(f"({p})")[0]: p.rsplit(" ", 1)[0].strip() for p in split_top(r.params)}
        names = [n for n in m.groups()[1:] if n and not n.isdigit()]
        if r.cls != ("COPY" if m[2] else "MEMSET") or not set(names) <= set(types):
            bad.append((r.name, r.chunk))
        elif types[m[2] or m[5]] not in ("size_t", "unsigned int"):
            bad.append((r.name, "count type " + types[m[2] or m[5]]))
        elif (
            m[5]
            and (m[6] != "1" or r.name.startswith(("cuMemsetD", "hipMemsetD")))
            and sizes.get(types[m[8]]) != int(m[6])
        ):
            bad.append((r.name, f"element size {m[6]} for a {types[m[8]]} value"))
    assert not bad, bad
    assert sum(r.chunk != "NONE" for r in ROWS) >= 60


def test_every_lookup_target_is_a_row_of_its_api() -> None:
    """A row's lookup name must lead back to a DEF row of the same API (what a
    GetProcAddress would be asked for)."""
    defs = {(r.api, r.lookup) for r in ROWS if r.variant == "DEF"}
    bad = [r.name for r in ROWS if (r.api, r.lookup) not in defs and r.variant != "V1"]
    assert not bad, bad


DESIGN_ENTRIES = [
    "__cudaLaunchKernel",
    "__cudaLaunchKernel_ptsz",
    "cudaLaunchKernel",
    "cudaLaunchKernel_ptsz",
    "cudaLaunchKernelExC",
    "cudaLaunchKernelExC_ptsz",
    "cudaLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernel_ptsz",
    "cudaGraphLaunch",
    "cudaGraphLaunch_ptsz",
    "cudaMemcpyAsync",
    "cudaMemPrefetchAsync",
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernelMultiDevice",
    "cuGraphLaunch",
    "cuGraphLaunch_ptsz",
    "cuGraphUpload",
    "hipLaunchKernel",
    "hipModuleLaunchKernel",
    "hipExtModuleLaunchKernel",
    "hipExtLaunchKernel",
    "hipGraphLaunch",
    "hipMemcpyAsync",
    "hipMemsetAsync",
    "hipMemPrefetchAsync",
    "hipLaunchKernel_spt",
]
DESIGN_LOOKUPS = ["cuGetProcAddress", "cuGetProcAddress_v2", "cudaGetDriverEntryPoint", "hipGetProcAddress"]


def test_design_entry_points_present() -> None:
    by_name = {r.name: r for r in ROWS}
    missing = [n for n in DESIGN_ENTRIES if n not in by_name or not by_name[n].gated]
    missing += [n for n in DESIGN_LOOKUPS if n not in by_name or by_name[n].cls != "LOOKUP"]
    assert not missing, f"DESIGN.md lists these but the tables miss (or do not gate) them: {missing}"


def test_driver_covers_every_gated_row() -> None:
    """table_driver (generated from the same tables) reaches every gated row
    directly and through dlsym, and every driver/HIP row a lookup returns."""
    listed = {(d["name"], d["path"]) for d in driver_list()}
    gated = [r for r in ROWS if r.gated]
    missing = [(r.name, p) for r in gated for p in ("direct", "dlsym") if (r.name, p) not in listed]
    assert not missing, missing
    for api, paths in (
        ("driver", ("gpa", "gpa_pt", "gpa1", "cudart_ep", "cudart_ep_pt")),
        ("hip", ("hip_gpa", "hip_gpa_pt")),
    ):
        via_lookup = {n for n, p in listed if p in paths}
        lookups = {r.lookup for r in gated if r.api == api and r.variant != "V1"}
        reached = {r.lookup for r in gated if r.name in via_lookup}
        assert lookups == reached, f"{api}: lookup names no path reaches: {sorted(lookups - reached)}"


# ----------------------------------------------------------- (c) by-value layouts

LAYOUT_EXPRS = [
    "sizeof(dim3)",
    "sizeof(struct cudaPitchedPtr)",
    "sizeof(struct cudaExtent)",
    "sizeof(struct cudaMemLocation)",
    "sizeof(CUmemLocation)",
    "offsetof(CUlaunchConfig, hStream)",
    "offsetof(cudaLaunchConfig_t, stream)",
    "offsetof(struct cudaPitchedPtr, pitch)",
    "offsetof(struct cudaPitchedPtr, ysize)",
    "offsetof(struct cudaExtent, depth)",
    "offsetof(struct cudaMemLocation, id)",
    "offsetof(CUmemLocation, id)",
    "sizeof(CUlaunchConfig)",
    "offsetof(CUlaunchConfig, gridDimX)",
    "offsetof(CUlaunchConfig, sharedMemBytes)",
    "offsetof(CUlaunchConfig, attrs)",
    "offsetof(CUlaunchConfig, numAttrs)",
    "sizeof(cudaLaunchConfig_t)",
    "offsetof(cudaLaunchConfig_t, gridDim)",
    "offsetof(cudaLaunchConfig_t, blockDim)",
    "offsetof(cudaLaunchConfig_t, dynamicSmemBytes)",
    "offsetof(cudaLaunchConfig_t, attrs)",
    "offsetof(cudaLaunchConfig_t, numAttrs)",
    "sizeof(CUDA_LAUNCH_PARAMS)",
    "offsetof(CUDA_LAUNCH_PARAMS, gridDimX)",
    "offsetof(CUDA_LAUNCH_PARAMS, hStream)",
    "offsetof(CUDA_LAUNCH_PARAMS, kernelParams)",
    "sizeof(CUresult)",
    "sizeof(cudaError_t)",
    "sizeof(CUdevice)",
    "sizeof(CUdeviceptr)",
    "sizeof(CUdeviceptr_v1)",
    "sizeof(cuuint64_t)",
    "sizeof(enum cudaMemcpyKind)",
    "sizeof(CUstreamCaptureMode)",
    "sizeof(CUdriverProcAddressQueryResult)",
    "sizeof(enum cudaDriverEntryPointQueryResult)",
    "CUDA_SUCCESS",
    "CUDA_ERROR_NOT_FOUND",
    "cudaSuccess",
    "cudaErrorInitializationError",
    "CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM",
    "cudaEnablePerThreadDefaultStream",
    "CU_STREAM_CAPTURE_MODE_RELAXED",
    "cudaMemcpyHostToDevice",
    "cudaMemcpyDefault",
    # (ours, vendor) where the names differ
    ("KREX_ERR_CAPTURE_INVALIDATED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    ("KREX_ERR_CAPTURE_INVALIDATED", "cudaErrorStreamCaptureInvalidated"),
]


def _expr_id(e: str | tuple[str, str]) -> str:
    return e if isinstance(e, str) else f"{e[0]}=={e[1]}"


def _print_exprs(tmp: Path, tag: str, includes: list[str], flags: list[str]) -> dict[str, int]:
    side = 0 if tag == "ours" else 1
    exprs = [e if isinstance(e, str) else e[side] for e in LAYOUT_EXPRS]
    body = "\n".join(f'printf("%lld\\n", (long long)({e}));' for e in exprs)
    src = tmp / f"{tag}.c"
    src.write_text(
        "\n".join(
            ["#include <stdio.h>", "#include <stddef.h>", *includes, "int main(void) {", body, "return 0; }"]
        )
        + "\n"
    )
    exe = tmp / tag
    p = subprocess.run([CC, "-O0", *flags, "-o", str(exe), str(src)], capture_output=True, text=True)
    assert p.returncode == 0, f"{tag}: {p.stderr[-3000:]}"
    vals = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    return dict(zip(map(_expr_id, LAYOUT_EXPRS), map(int, vals), strict=True))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], dict[str, int]]:
    assert ROOT is not None
    tmp = tmp_path_factory.mktemp("layouts")
    ours = _print_exprs(tmp, "ours", ['#include "krex_cuda_types.h"'], [f"-I{INTERPOSE}"])
    vendor = _print_exprs(
        tmp,
        "vendor",
        ["#include <cuda.h>", "#include <cuda_runtime_api.h>"],
        ["-D__CUDA_API_VERSION_INTERNAL", f"-I{ROOT / 'include'}"],
    )
    return ours, vendor


@needs_cuda
@pytest.mark.parametrize("expr", [_expr_id(e) for e in LAYOUT_EXPRS])
def test_krex_types_match_vendor(expr: str, layouts: tuple[dict[str, int], dict[str, int]]) -> None:
    ours, vendor = layouts
    assert ours[expr] == vendor[expr], f"{expr}: krex_cuda_types.h {ours[expr]}, CUDA headers {vendor[expr]}"


def test_gcc_available() -> None:
    assert shutil.which(CC), f"{CC} is needed to build the tests' C victims"
