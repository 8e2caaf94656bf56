"""Minimal setup.py: cffi's cffi_modules hook, and a build_ext step that also
compiles the shim and the simulated GPU into krex/_lib (see krex_build.py)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent))


class BuildExt(build_ext):
    def run(self) -> None:
        super().run()
        import krex_build

        inplace = self.inplace or getattr(self, "editable_mode", False)
        target = Path("krex/_lib") if inplace else Path(self.build_lib) / "krex" / "_lib"
        krex_build.build_native(target)


setup(
    cffi_modules=["krex_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt},
)
