"""`krex doctor`: is this node ready for KREX? The checks (checks.py), the CUPTI
interposition coverage run on a real GPU (coverage.py). The ELF check for static
CUDA runtimes is krex.device.elfcheck: the launcher and the freeze policy use it too.

The package's names are checks.py's public ones: the one list is checks.__all__."""

from krex.doctor import checks
from krex.doctor.checks import *  # noqa: F403 -- checks.__all__ is the list

__all__ = checks.__all__
