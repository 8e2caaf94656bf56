"""Python sources of sibling commands (run as `python -c SOURCE ARGS`) that tests of
several modules start beside a region owner."""

from __future__ import annotations

import textwrap

# A sibling that launches one simulated kernel (so it has a drain helper and is a GPU sibling),
# makes argv[3], waits for argv[2], then writes its helper thread's nice value to argv[1].
HELPER_NICE_SIBLING = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    class Dim3(ctypes.Structure):
        _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
    rt = ctypes.CDLL("libcudart.so.13")
    vp = ctypes.c_void_p
    rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
    fn = ctypes.cast(rt.cudaDeviceSynchronize, vp)
    assert rt.cudaLaunchKernel(fn, Dim3(10, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
    rt.cudaDeviceSynchronize()
    open(sys.argv[3], "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    tasks = {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
    nice = {c: os.getpriority(os.PRIO_PROCESS, int(t)) for t, c in tasks.items() if c == "krex-drain"}
    nice["main"] = os.getpriority(os.PRIO_PROCESS, os.getpid())
    json.dump(nice, open(sys.argv[1], "w"))
    """
)
