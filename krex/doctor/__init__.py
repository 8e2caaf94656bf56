"""`krex doctor`: is this node ready for KREX? The checks (checks.py), the CUPTI
interposition coverage run on a real GPU (coverage.py). The ELF check for static
CUDA runtimes is krex.device.elfcheck: the launcher and the freeze policy use it too."""

from krex.doctor.checks import (
    FAIL,
    OK,
    WARN,
    Check,
    DoctorReport,
    check_binary,
    check_daemon,
    check_freezer,
    check_gpu_coverage,
    check_gpus,
    check_mps,
    check_partition,
    check_privileges,
    check_shim,
    run_doctor,
)

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Check",
    "DoctorReport",
    "check_binary",
    "check_daemon",
    "check_freezer",
    "check_gpu_coverage",
    "check_gpus",
    "check_mps",
    "check_partition",
    "check_privileges",
    "check_shim",
    "run_doctor",
]
