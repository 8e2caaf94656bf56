"""The api_*.def tables as data, parsed by the C preprocessor itself (so the
tests read exactly what the shim compiles), and helpers to find vendor headers."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from helpers import CC, INTERPOSE

TABLES = (("cudart", "api_cudart.def"), ("driver", "api_driver.def"), ("hip", "api_hip.def"))
GATED_CLASSES = ("KERNEL", "COPY", "MEMSET", "GRAPH", "PREFETCH")
OTHER_CLASSES = ("LOOKUP", "CTXNEW", "CTXDEL", "CAPBEGIN", "CAPEND", "GREENNEW", "GREENDEL", "GREENCTX")
VARIANTS = ("DEF", "PT", "V1")
RET = {"cudart": "cudaError_t", "driver": "CUresult", "hip": "hipError_t"}


@dataclass(frozen=True)
class Row:
    api: str
    name: str
    lookup: str
    variant: str
    cls: str
    params: str
    args: str
    stream: str
    cost: str
    sample: str
    chunk: str

    @property
    def gated(self) -> bool:
        return self.cls in GATED_CLASSES


_DUMP = r"""
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    KREXROW {"api": KREX_API_NAME, "name": #name, "lookup": #lookup, "variant": #variant, "cls": #cls, \
             "params": #params, "args": #args, "stream": #stream, "cost": #cost, "sample": #sample, \
             "chunk": #chunk}
"""


@functools.lru_cache(maxsize=1)
def rows() -> tuple[Row, ...]:
    src = _DUMP
    for api, f in TABLES:
        src += f'#define KREX_API_NAME "{api}"\n#include "{f}"\n#undef KREX_API_NAME\n'
    out = subprocess.run(
        [CC, "-E", "-P", f"-I{INTERPOSE}", "-x", "c", "-"],
        input=src,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(Row(**json.loads(chunk)) for chunk in out.replace("\n", " ").split("KREXROW")[1:])


def split_top(s: str) -> list[str]:
    """Split "(a, f(b, c), d)" into ["a", "f(b, c)", "d"]."""
    s = s.strip()
    assert s.startswith("(") and s.endswith(")"), s
    s = s[1:-1]
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def param_names(params: str) -> list[str]:
    return [re.findall(r"\w+", p)[-1] for p in split_top(params) if p != "void"]


# ---------------------------------------------------------------- vendor headers


def cuda_root() -> Path | None:
    """A CUDA toolkit with CUDA 13 (or newer) headers, or None."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cands += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    for c in cands:
        if not c:
            continue
        inc = Path(c) / "include"
        if (inc / "cuda.h").exists() and (inc / "cuda_runtime_api.h").exists():
            m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (inc / "cuda.h").read_text(errors="replace"))
            if m and int(m[1]) >= 13000:
                return Path(c)
    return None
