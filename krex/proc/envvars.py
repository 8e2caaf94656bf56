"""The environment that opts a process into KREX, and validation of KREX_* input.

The variables themselves come from ONE function, krex.node.optin.opt_in_parts; krexd
sends its result in every `admit` reply (env_set, env_prepend), which the guardian
(interpose/guardian.c) applies; `krex env` and `--no-daemon` use it here."""

from __future__ import annotations

import os
import shlex

from krex.node.optin import hook_dir, opt_in_parts, prepend

__all__ = ["hook_dir", "mps_env", "opt_in_env", "format_env"]


def opt_in_env(device: str, shm_name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Variables (only the ones KREX sets) that put a process under KREX."""
    from krex import paths

    base = dict(os.environ if base is None else base)
    put, pre = opt_in_parts(device, shm_name, str(paths.socket_path()), str(paths.log_path()))
    out = {k: prepend(base.get(k, ""), v, seps) for k, (v, seps) in pre.items()}
    out.update(put)
    return out


def mps_env(gpu: int = 0) -> dict[str, str]:
    """The MPS variables `krex run` gives a command on GPU `gpu` while the running krexd
    manages MPS (its pipe and log directories, the GPU's UUID where known: krex/node/mps.py);
    none when no krexd answers or it runs without MPS."""
    from krex.errors import KrexError
    from krex.proc.client import Client, daemon_alive

    if not daemon_alive():
        return {}
    try:
        c = Client.connect()
        try:
            st = c.request({"op": "status"})
        finally:
            c.close()
    except (KrexError, OSError):
        return {}
    for m in (st.get("mps") or {}).get("gpus") or []:
        if m.get("gpu") == gpu:
            return {str(k): str(v) for k, v in (m.get("env") or {}).items()}
    return {}


def format_env(env: dict[str, str], export: bool) -> str:
    prefix = "export " if export else ""
    return "\n".join(f"{prefix}{k}={shlex.quote(v)}" for k, v in env.items())
