"""Access to the cffi module and to the files installed next to it."""

from __future__ import annotations

from pathlib import Path

from krex.errors import NotFound

try:
    from krex._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only when the build step was skipped
    raise ImportError("krex._native is not built; run `make install` (or `pip install .`)") from exc

LIB_DIR = Path(__file__).resolve().parent / "_lib"

__all__ = ["ffi", "lib", "LIB_DIR", "shim_path", "sim_dir", "include_dir", "nvtx_path"]


def _need(p: Path) -> Path:
    if not p.exists():
        raise NotFound(f"{p} is missing from the installation", "reinstall: make install")
    return p


def shim_path() -> Path:
    return _need(LIB_DIR / "libkrex_interpose.so")


def sim_dir() -> Path:
    _need(LIB_DIR / "libcuda.so.1")
    return LIB_DIR


def include_dir() -> Path:
    _need(LIB_DIR / "krex.h")
    return LIB_DIR


def nvtx_path() -> Path:
    """The NVTX injection library (KREX_NVTX_REGION; the shim points NVTX at it)."""
    return _need(LIB_DIR / "libkrex_nvtx.so")
