"""Case 6 of the trust issue: `--device auto` never picks the simulated GPU on a machine
that has a GPU driver, CUDA_VISIBLE_DEVICES given as UUIDs or MIG ids is understood,
and a run on the simulator says so.

NVML is replaced by the fake layer of krex.device.nvml (KREX_NVML_FAKE); the driver's device
nodes by files of our own (KREX_GPU_DEVICE_NODES)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from krex.device import gpus
from krex.errors import NotFound

UUID0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
UUID1 = "GPU-1f0b4a6d-1b2e-4a5c-9d7e-0c1d2e3f4a5b"
MIG1 = "MIG-5a2d2a7f-36b0-5bb3-8c34-2f1f3bd5f37e"


def _fake(tmp_path: Path, data: dict) -> str:  # type: ignore[type-arg]
    p = tmp_path / "nvml.json"
    p.write_text(json.dumps(data))
    return str(p)


TWO = {"gpus": [{"name": "H200", "uuid": UUID0}, {"name": "H200", "uuid": UUID1, "migs": [MIG1]}]}


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 'driver device node' that exists."""
    n = tmp_path / "nvidiactl"
    n.write_text("")
    monkeypatch.setenv("KREX_GPU_DEVICE_NODES", str(n))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return n


def test_auto_refuses_the_simulator_where_a_gpu_driver_is(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KREX_NVML_FAKE", _fake(tmp_path, {"error": "No module named 'pynvml'"}))
    with pytest.raises(NotFound) as e:
        gpus.discover("auto")
    assert str(node) in str(e.value) and "--device sim" in e.value.fix


def test_auto_without_a_driver_still_uses_the_simulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KREX_GPU_DEVICE_NODES", str(tmp_path / "absent"))
    monkeypatch.setenv("KREX_NVML_FAKE", _fake(tmp_path, {"error": "no NVML"}))
    assert gpus.discover("auto").kind == "sim"


@pytest.mark.parametrize(
    ("spec", "physical", "tokens"),
    [
        (None, [0, 1], ["0", "1"]),
        ("1", [1], ["1"]),
        (UUID1, [1], [UUID1]),
        (UUID1[:12], [1], [UUID1[:12]]),  # a unique prefix, as CUDA accepts
        (f"{UUID1},{UUID0}", [1, 0], [UUID1, UUID0]),
        (MIG1, [1], [MIG1]),
        (f"MIG-{UUID0}/1/0", [0], [f"MIG-{UUID0}/1/0"]),  # the pre-R470 MIG form
        ("0,GPU-nope,1", [0], ["0"]),  # like CUDA: stop at the first invalid entry
    ],
)
def test_cuda_visible_devices_forms(
    tmp_path: Path,
    node: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec: str | None,
    physical: list[int],
    tokens: list[str],
) -> None:
    monkeypatch.setenv("KREX_NVML_FAKE", _fake(tmp_path, TWO))
    if spec is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    info = gpus.discover("auto")
    assert info.kind == "nvidia"
    assert info.physical == physical and info.visible == tokens


def test_a_visible_list_that_selects_nothing_is_an_error_not_the_simulator(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KREX_NVML_FAKE", _fake(tmp_path, TWO))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-doesnotexist")
    with pytest.raises(NotFound, match="CUDA_VISIBLE_DEVICES"):
        gpus.discover("auto")


def test_cuda_python_serves_when_nvml_cannot(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers.fakes import fake_cuda_driver

    monkeypatch.setenv("KREX_NVML_FAKE", _fake(tmp_path, {"error": "nvidia-ml-py is not installed"}))
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake_cuda_driver(["H200", "H200"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUID1},{UUID0}")
    info = gpus.discover("auto")
    assert info.kind == "nvidia" and info.count == 2 and info.api == "cuda-python"
    assert info.visible == [UUID1, UUID0]  # the command gets the entries as given


def test_nvidia_ml_py_is_a_dependency() -> None:
    import tomllib

    deps = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("nvidia-ml-py") for d in deps["dependencies"])


def test_a_run_on_the_simulator_says_so(tmp_path: Path) -> None:
    env = dict(os.environ, KREX_STATE_DIR=str(tmp_path / "s"))
    env.update(KREX_SHM=f"/krex-gd-{os.getpid()}", KREX_SIM_SHM=f"/krex-gds-{os.getpid()}")
    env.pop("LD_PRELOAD", None)
    rep = tmp_path / "r.json"
    try:
        argv = [sys.executable, "-m", "krex.cli.main", "run", "--device", "sim", "--report", str(rep)]
        argv += ["--", "true"]
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "SIMULATED GPU" in p.stderr
        r = json.loads(rep.read_text())
        assert r["device"] == "sim" and r["simulated"] is True
    finally:
        stop = [sys.executable, "-m", "krex.cli.main", "daemon", "stop"]
        subprocess.run(stop, env=env, capture_output=True, timeout=60)
        for n in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm" + n).unlink(missing_ok=True)
        for pin in Path("/dev/shm").glob(env["KREX_SHM"].strip("/") + ".krex*"):
            pin.unlink(missing_ok=True)
