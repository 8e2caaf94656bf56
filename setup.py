"""Minimal setup.py: cffi's cffi_modules hook, a build_ext step that compiles the
extension with krex_build's toolchain (zig cc for glibc 2.17 where available) and
also builds the shim and the simulated GPU into krex/_lib, and a bdist_wheel that
tags the wheel cp310-abi3 with the platform tag its ELF files actually honour."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:  # setuptools provides distutils (its own copy) once imported
    from distutils.command.build_scripts import build_scripts
except ImportError:  # pragma: no cover
    from setuptools._distutils.command.build_scripts import build_scripts  # type: ignore[no-redef]

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parent))
import krex_build  # noqa: E402


class BuildExt(build_ext):
    def build_extensions(self) -> None:
        tc = krex_build.toolchain()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        if tc.kind == "zig" or tc.arch != krex_build.host_arch():
            # Python's own CFLAGS belong to the compiler Python was built with; the
            # extension needs none of them (abi3, one C file).
            cc = [*tc.cc, "-fPIC", "-O2", "-Wall"]
            self.compiler.set_executables(
                compiler=cc, compiler_so=cc, linker_so=[*tc.cc, "-shared"], linker_exe=list(tc.cc)
            )
        for ext in self.extensions:  # no build path inside; a wheel's extension is stripped
            ext.extra_compile_args = [*ext.extra_compile_args, *krex_build.PREFIX_MAP]
            if not inplace:
                ext.extra_link_args = [*ext.extra_link_args, "-s"]
        # Build outputs of another target or toolchain must never be reused.
        self.force = True
        super().build_extensions()

    def run(self) -> None:
        super().run()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        target = Path("krex/_lib") if inplace else Path(self.build_lib) / "krex" / "_lib"
        krex_build.build_native(target, strip=not inplace)  # a wheel ships them stripped


# The `krex` command when the native one cannot be built: the Python front door.
PY_KREX = """#!{python}
import sys
from krex.cli.lean import main
sys.exit(main())
"""


class BuildScripts(build_scripts):
    """bin/krex is the native guardian (interpose/guardian.c, issue 11: `krex run` without
    a Python start), built here; where it cannot be built, the Python front door. (Not a
    console_scripts entry: that would overwrite it.)"""

    editable_mode = False  # set by setuptools' editable_wheel (pip install -e)

    def run(self) -> None:
        self.mkpath(self.build_dir)
        out = Path(self.build_dir) / "krex"
        # An editable install's bin/krex serves the checkout's krex/_lib (no site-packages copy).
        lib_dir = Path("krex/_lib").resolve() if self.editable_mode else None
        try:
            krex_build.build_guardian(out, strip=True, lib_dir=lib_dir)
        except Exception as e:  # noqa: BLE001 - any failure: the Python one
            print(f"setup.py: native krex not built ({e}); installing the Python krex", file=sys.stderr)
            out.write_text(PY_KREX.format(python=self.executable))
        out.chmod(0o755)


class BdistWheel(bdist_wheel):
    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False
        self.py_limited_api = "cp310"  # krex._native is built against the stable ABI

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        build_lib = Path(self.get_finalized_command("build").build_lib) / "krex"
        files = [p for p in build_lib.rglob("*") if p.is_file() and not p.is_symlink()]
        tag = krex_build.platform_tag(files)
        return "cp310", "abi3", tag or plat


setup(
    cffi_modules=["krex_build.py:ffibuilder"],
    # Only so that setuptools runs build_scripts/install_scripts: BuildScripts makes bin/krex.
    scripts=["interpose/guardian.c"],
    cmdclass={"build_ext": BuildExt, "build_scripts": BuildScripts, "bdist_wheel": BdistWheel},
)
