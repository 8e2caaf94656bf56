"""`eval "$(krex env --export)"`: nothing but the environment reaches stdout, whatever a
vendor binding prints when it is imported (amdsmi prints two lines on machines without a
usable AMD driver), and AMD bindings are imported only where the AMD driver's node
(/dev/kfd) exists. The driver nodes are files of our own (KREX_GPU_DEVICE_NODES)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.fakes import FAKE_AMDSMI, write_fake_amd_node  # noqa: E402

_KREX = Path(sys.executable).with_name("krex")
KREX = [str(_KREX)] if _KREX.exists() else [sys.executable, "-m", "krex.cli.main"]
# What amdsmi prints on import where its library finds no driver, through Python and through C.
NOISE = (
    "import os, sys\n"
    "open(os.environ['AMDSMI_IMPORTED'], 'w').close()\n"
    "print('Unable to load the amdsmi library: no driver')\n"
    "sys.stdout.flush()\n"
    "os.write(1, b'Unable to find /opt/rocm/lib/libamd_smi.so\\n')\n"
)
EXPORT = re.compile(r"^export [A-Z_][A-Z0-9_]*=")


def _noisy_amdsmi(d: Path, works: bool) -> Path:
    """A stand-in amdsmi first on PYTHONPATH that prints on import; with `works`, it then
    lists two AMD GPUs (the fake of tests/helpers/fakes.py), else it has no driver."""
    write_fake_amd_node(d)
    dead = "def amdsmi_init():\n    raise RuntimeError('AMDSMI_STATUS_DRIVER_NOT_LOADED')\n"
    body = FAKE_AMDSMI if works else dead
    (d / "amdsmi.py").write_text(NOISE + body)
    return d


def _env(krex_env: dict[str, str], tmp: Path, fake: Path, nodes: list[Path]) -> dict[str, str]:
    env = dict(krex_env, PYTHONPATH=str(fake), AMDSMI_IMPORTED=str(tmp / "amdsmi-imported"))
    env["KREX_GPU_DEVICE_NODES"] = ":".join(str(n) for n in nodes) or str(tmp / "absent")
    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "KREX_NVML_FAKE"):
        env.pop(k, None)
    return env


def _export(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, "env", "--export"], env=env, capture_output=True, text=True, timeout=90)


def _only_exports(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines and all(EXPORT.match(ln) for ln in lines), f"stdout is not only export lines:\n{p.stdout}"
    # and bash evaluates it without a complaint
    q = subprocess.run(["bash", "-c", 'eval "$1" && echo "$KREX_SHM"', "-", p.stdout], capture_output=True,
                       text=True, timeout=30)
    assert q.returncode == 0 and q.stderr == "" and q.stdout.startswith("/krex-"), (q.stdout, q.stderr)


def test_no_amd_driver_node_no_amd_import(krex_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(krex_env, tmp_path, _noisy_amdsmi(tmp_path / "site", works=False), [])
    p = _export(env)
    _only_exports(p)
    assert not (tmp_path / "amdsmi-imported").exists(), "amdsmi was imported on a machine without /dev/kfd"
    assert "KREX_DEVICE=sim" in p.stdout  # no GPU: --device auto uses the simulated one


def test_amd_node_whose_binding_prints_on_import(krex_env: dict[str, str], tmp_path: Path) -> None:
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    env = _env(krex_env, tmp_path, _noisy_amdsmi(tmp_path / "site", works=True), [kfd])
    p = _export(env)
    assert (tmp_path / "amdsmi-imported").exists()  # probed: the AMD driver's node is there
    _only_exports(p)
    assert "Unable to" in p.stderr  # the binding's lines are not lost, only kept off stdout
    assert "KREX_DEVICE" not in p.stdout  # two AMD GPUs found


def test_gpu_driver_without_a_working_binding_fails_with_nothing_on_stdout(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    env = _env(krex_env, tmp_path, _noisy_amdsmi(tmp_path / "site", works=False), [kfd])
    p = _export(env)
    assert p.returncode != 0 and p.stdout == "", p.stdout
    assert "could not list its GPUs" in p.stderr


def test_auto_fallback_note_names_the_reason(krex_env: dict[str, str], tmp_path: Path) -> None:
    """`krex run` under --device auto on a machine without a GPU: the notice says why it is
    simulated (no GPU found), not `--device sim`, which was never given."""
    env = dict(krex_env, KREX_GPU_DEVICE_NODES=str(tmp_path / "absent"))
    env["KREX_NVML_FAKE"] = str(tmp_path / "nv.json")
    (tmp_path / "nv.json").write_text('{"error": "no NVML here"}')
    auto = subprocess.run([*KREX, "run", "--", "true"], env=env, capture_output=True, text=True, timeout=90)
    assert auto.returncode == 0, auto.stderr
    note = next(ln for ln in auto.stderr.splitlines() if "SIMULATED GPU" in ln)
    assert "--device sim" not in note and "no GPU" in note, note
    sim = subprocess.run([*KREX, "run", "--device", "sim", "--", "true"], env=env, capture_output=True,
                         text=True, timeout=90)
    assert "SIMULATED GPU (--device sim)" in sim.stderr, sim.stderr
