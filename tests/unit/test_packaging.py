"""The build's ELF reader and wheel tagging (krex_build.py), checked against binutils
and against libraries that must not get a manylinux tag. The full wheel (build,
auditwheel, fresh venv, smoke test) is scripts/wheel_check.sh, run by CI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import krex_build  # noqa: E402

LIB = ROOT / "krex" / "_lib"
BUILT = sorted(p for p in [*LIB.iterdir(), *(ROOT / "krex").glob("_native*.so")] if not p.is_symlink())


def _readelf_glibc(path: Path) -> set[str]:
    out = subprocess.run(
        ["readelf", "-V", "-W", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return set(re.findall(r"Name: (GLIBC_[\d.]+)", out))


def _readelf_needed(path: Path) -> list[str]:
    out = subprocess.run(
        ["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
@pytest.mark.parametrize("path", [p for p in BUILT if p.suffix != ".h"], ids=lambda p: p.name)
def test_elf_reader_agrees_with_readelf(path: Path) -> None:
    e = krex_build.elf_requirements(path)
    assert e is not None and e.arch == krex_build.host_arch()
    assert e.needed == _readelf_needed(path)
    ours = {v for vs in e.versions.values() for v in vs if v.startswith("GLIBC_2")}
    assert ours == _readelf_glibc(path)


def test_installed_build_is_manylinux2014_when_built_with_zig() -> None:
    tc = krex_build.toolchain()
    tag = krex_build.platform_tag(BUILT)
    if tc.kind != "zig":
        pytest.skip(f"built with {tc.cc[0]}, not zig: the tag follows the host's glibc ({tag})")
    assert tag == f"manylinux_2_17_{tc.arch}.manylinux2014_{tc.arch}"


def _so(tmp: Path, name: str, src: str, *libs: str) -> Path:
    c = tmp / f"{name}.c"
    c.write_text(src)
    out = tmp / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c), *libs], check=True)
    return out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_tag_follows_the_newest_glibc_symbol(tmp_path: Path) -> None:
    """A library built by the host's gcc against its own glibc: the tag must claim no
    older glibc than its newest versioned symbol."""
    so = _so(
        tmp_path, "newer", "#include <pthread.h>\nvoid *f(void){return (void*)pthread_create;}\n", "-lpthread"
    )
    newest = max((tuple(int(x) for x in v[6:].split(".")) for v in _readelf_glibc(so)), default=(2, 17))
    tag = krex_build.platform_tag([so])
    want = max(newest, (2, 17))
    assert tag is not None and tag.startswith(f"manylinux_{want[0]}_{want[1]}_")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_foreign_library_is_never_manylinux(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dep = _so(elsewhere, "libdep", "int dep(void){return 1;}\n", "-Wl,-soname,libdep.so")
    user = _so(
        tmp_path, "user", "int dep(void);\nint f(void){return dep();}\n", f"-L{elsewhere}", "-l:libdep.so"
    )
    assert "libdep.so" in krex_build.elf_requirements(user).needed  # type: ignore[union-attr]
    arch = krex_build.host_arch()
    assert krex_build.platform_tag([user]) == f"linux_{arch}"  # needs a library the wheel lacks
    # Shipped together (and named by its soname), it is part of the wheel.
    assert krex_build.platform_tag([user, dep]).startswith("manylinux_")  # type: ignore[union-attr]


def test_not_elf_is_ignored(tmp_path: Path) -> None:
    f = tmp_path / "krex.h"
    f.write_text("/* header */\n")
    assert krex_build.elf_requirements(f) is None
    assert krex_build.platform_tag([f]) is None


# ------------------------------------------------------------------ the distribution's name

DIST_NAME = "krex-gpu"  # `krex` on the package index is an unrelated trading library
DIST_FILE = "krex_gpu"  # the name in wheel and sdist file names (PEP 491/625 normalisation)


def _pyproject() -> dict:  # type: ignore[type-arg]
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_distribution_name_is_not_the_taken_one() -> None:
    project = _pyproject()["project"]
    assert project["name"] == DIST_NAME
    # The import name and the command stay `krex`.
    assert "krex" in _pyproject()["tool"]["setuptools"]["package-dir"]


def test_no_gpu_extra_and_the_required_nvml() -> None:
    """nvidia-ml-py is a dependency: a `gpu` extra would add nothing."""
    project = _pyproject()["project"]
    assert "gpu" not in project["optional-dependencies"]
    assert any(d.startswith("nvidia-ml-py") for d in project["dependencies"])


def test_project_urls() -> None:
    urls = _pyproject()["project"]["urls"]
    for key in ("Source", "Documentation", "Issues"):
        assert urls.get(key, "").startswith("https://"), key


# Every place a user reads how to install KREX, and every script that picks up a built wheel.
_INSTALL_TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "docs" / "deploy").iterdir()),
    *sorted((ROOT / "scripts").glob("*.sh")),
    *sorted((ROOT / "benchmarks").glob("*.sh")),
    *sorted((ROOT / "krex").rglob("*.py")),
    *sorted((ROOT / "cli").glob("*.py")),
    ROOT / "krex_build.py",
]
# `pip install krex`, `krex[bench]`, `krex-*.whl`/`krex-0.1.0-...` as a distribution: the taken name.
_OLD_NAME = re.compile(
    r"pip install\s+(-\S+\s+)*'?krex\b(?![-_])|\bkrex\[|\bkrex-(\*|\d)[^/\s]*\.(whl|tar\.gz)"
)


@pytest.mark.parametrize("path", _INSTALL_TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_line_names_the_taken_distribution(path: Path) -> None:
    bad = [
        f"{i}: {line.strip()}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _OLD_NAME.search(line)
    ]
    assert not bad, f"{path.name} still installs the unrelated `krex` distribution:\n" + "\n".join(bad)


def test_the_gpu_extra_is_mentioned_nowhere() -> None:
    # krex-gpu[gpu], krex[gpu,bench], `# [gpu]: NVML`
    pat = re.compile(r"krex(-gpu)?\[[\w,]*\bgpu\b|\s\[gpu\]:")
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _INSTALL_TEXTS
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pat.search(line)
    ]
    assert not bad, bad


# ------------------------------------------------------------------ reproducible, stripped builds

_BUILD = """import sys
sys.path.insert(0, sys.argv[1])
import krex_build
out = sys.argv[2]
strip = sys.argv[3] == "strip"
krex_build.build_guardian(out + "/krex", strip=strip)
"""


def _build_copy(tmp: Path, name: str, strip: bool) -> Path:
    """krex_build, interpose/ and runopts.py copied to tmp/NAME (another build path), the native
    `krex` (its C files, built as the shim is: same flags, same toolchain) built from there."""
    src = tmp / name
    src.mkdir(parents=True)
    shutil.copytree(ROOT / "interpose", src / "interpose")
    shutil.copy2(ROOT / "krex_build.py", src / "krex_build.py")
    (src / "krex" / "proc").mkdir(parents=True)
    shutil.copy2(ROOT / "krex" / "proc" / "runopts.py", src / "krex" / "proc" / "runopts.py")
    out = tmp / f"out-{name}"
    out.mkdir()
    subprocess.run([sys.executable, "-c", _BUILD, str(src), str(out), "strip" if strip else "debug"],
                   check=True, cwd=tmp, timeout=280)
    return out / "krex"


@pytest.mark.timeout(600)
def test_builds_from_two_directories_are_identical_and_hold_no_build_path(tmp_path: Path) -> None:
    a = _build_copy(tmp_path, "a", strip=True)
    b = _build_copy(tmp_path, "a-much-longer-directory-name-b", strip=True)
    assert a.read_bytes() == b.read_bytes(), "the same sources built in two directories differ"
    assert str(tmp_path).encode() not in a.read_bytes()
    # What a wheel ships (setup.py: strip=True; scripts/wheel_contents.py checks the wheel):
    # no symbol table, no debug info.
    if shutil.which("readelf"):
        sections = subprocess.run(["readelf", "-S", "-W", str(a)], capture_output=True, text=True).stdout
        assert ".symtab" not in sections and ".debug_info" not in sections, sections


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
@pytest.mark.timeout(600)
def test_a_debug_build_names_no_build_directory_in_its_own_units(tmp_path: Path) -> None:
    """`make native` keeps debug info: our compile units say `.` and `./interpose/...`. (zig's
    libc start files carry the directory its cache first built them in: not ours, and gone
    with the debug info in what a wheel ships.)"""
    g = _build_copy(tmp_path, "c-debug", strip=False)
    info = subprocess.run(["readelf", "--debug-dump=info", str(g)], capture_output=True, text=True).stdout
    units = re.findall(r"DW_AT_name\s*:.*?(\S+)\n(?:.*\n){0,3}?.*DW_AT_comp_dir\s*:.*?(\S+)\n", info)
    ours = [(name, cdir) for name, cdir in units if "interpose" in name]
    assert ours, info[:2000]
    for name, cdir in ours:
        assert str(tmp_path) not in name and str(tmp_path) not in cdir, (name, cdir)
