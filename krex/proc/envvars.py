"""The environment that opts a process into KREX, and validation of KREX_* input."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from krex.native import shim_path, sim_dir


def hook_dir() -> Path:
    """The directory to put on PYTHONPATH: its sitecustomize.py installs automatic
    regions when KREX_AUTO_REGION is set, and costs one `import os` otherwise."""
    return Path(__file__).resolve().parent / "_hook"


def _prepend(var: str, value: str, base: dict[str, str]) -> str:
    old = base.get(var, "")
    parts = [p for p in old.replace(" ", ":").split(":") if p and p != value]
    return ":".join([value, *parts])


def opt_in_env(device: str, shm_name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Variables (only the ones KREX sets) that put a process under KREX."""
    base = dict(os.environ if base is None else base)
    from krex import paths
    from krex.node.config import daemon_argv

    sock = paths.socket_path()
    log = paths.log_path()
    env = {
        "LD_PRELOAD": _prepend("LD_PRELOAD", str(shim_path()), base),
        "KREX_SHM": shm_name,
        "KREX_SOCKET": str(sock),
        # How a self-registering shim starts krexd when none answers (on-demand, exits when idle).
        # krexd opens its log itself (checked directory, no symlink followed).
        "KREX_DAEMON_CMD": "exec env -u LD_PRELOAD " + shlex.join(daemon_argv(device, log, on_demand=True)),
    }
    hook = str(hook_dir())
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([hook, *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p)])
    )
    if device == "sim":
        env["LD_LIBRARY_PATH"] = _prepend("LD_LIBRARY_PATH", str(sim_dir()), base)
        env["KREX_DEVICE"] = "sim"
    return env


def format_env(env: dict[str, str], export: bool) -> str:
    prefix = "export " if export else ""
    return "\n".join(f"{prefix}{k}={shlex.quote(v)}" for k, v in env.items())
