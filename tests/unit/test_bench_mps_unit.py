"""`krex bench`'s MPS cells without processes: parsing and planning unprotected-mps-C and
krex-mps-C, their place in the summary and headline, and the refusal where MPS cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from krex import bench
from krex.bench import mpscell
from krex.bench.plan import Cell
from krex.device import gpus
from krex.device.gpus import GpuInfo
from krex.errors import UsageError

ALL = ["native-serial", "unprotected", "unprotected-mps", "krex", "krex-mps"]


def test_the_mps_modes_parse_and_name_their_cells() -> None:
    assert bench.parse_modes("native-serial,unprotected-mps,krex-mps") == [
        "native-serial", "unprotected-mps", "krex-mps"
    ]
    assert set(bench.MPS_MODES) == {"unprotected-mps", "krex-mps"}
    assert not set(bench.MPS_MODES) & set(bench.DEFAULT_MODES)  # asked for by name only
    assert Cell.from_key("unprotected-mps-8") == Cell("unprotected-mps", 8)
    assert Cell.from_key("krex-mps-16") == Cell("krex-mps", 16)
    assert Cell.from_key("unprotected-16") == Cell("unprotected", 16)
    assert Cell.from_key("krex-mps-4@gpu") == Cell("krex-mps", 4, "gpu")
    for key in ("unprotected-mps-8", "krex-mps-16", "krex-mps-4@gpu"):
        assert Cell.from_key(key).key == key
    for bad in ("krex-mps-4+pw2", "krex-mps-4+lend-all", "unprotected-mps-4@gpu", "unprotected-mps-x"):
        with pytest.raises(UsageError):
            Cell.from_key(bad)


def test_mps_cells_run_beside_their_twins_of_the_same_c() -> None:
    cells = bench.plan_cells(ALL, [8, 16], seed=5, freezes=("", "gpu"))
    keys = [c.key for c in cells]
    assert keys[0] == "native-serial"
    per_c = [keys[1:7], keys[7:]]  # each C's cells back to back, the two C in seeded order
    for block in per_c:
        c = block[0].split("@")[0].rsplit("-", 1)[1]
        assert sorted(block) == sorted(
            [f"unprotected-{c}", f"unprotected-mps-{c}", f"krex-{c}", f"krex-{c}@gpu", f"krex-mps-{c}",
             f"krex-mps-{c}@gpu"]
        ), block
    # Without the MPS modes the plan is the one it always was (the same seeded order).
    plain = [c.key for c in bench.plan_cells(bench.DEFAULT_MODES, [2, 4, 8, 16], seed=3)]
    assert plain == [c.key for c in bench.plan_cells(
        ("reference", "native-serial", "native-repeat", "unprotected", "krex"), [2, 4, 8, 16], seed=3)]
    assert not any("mps" in k for k in plain)


def _cell(key: str, makespan: float) -> dict[str, Any]:
    c = Cell.from_key(key)
    return {"cell": key, "mode": c.mode, "c": c.c, "run": key, "n_runs": 2, "failures": 0,
            "started_at": 0.0, "ended_at": makespan, "makespan_s": makespan, "last_start_s": makespan / 2}


def _rec(cell: str, name: str, ms: float) -> dict[str, Any]:
    c = Cell.from_key(cell)
    return {"run": cell, "cell": cell, "mode": c.mode, "c": c.c, "rep": 0, "name": name, "family": None,
            "ok": True, "wall_s": 1.0, "started_at": 0.0, "ended_at": 1.0,
            "result": {"ms": ms, "correct": True, "t_total_s": 1.0},
            "krex": {"regions": [{"entry_s": 0.01}]} if c.mode in ("krex", "krex-mps") else None}


def _ws(tmp_path: Path) -> list[bench.Workload]:
    script = tmp_path / "x.py"
    script.write_text("")
    return [bench.Workload(n, "sim", script, (), expect_ms=ms) for n, ms in (("a", 2.0), ("b", 20.0))]


META = {"device": "sim", "quick": False, "seed": 0, "repeat": 1, "versions": {}}


def test_the_summary_holds_krex_mps_against_both_unprotected_baselines(tmp_path: Path) -> None:
    spans = {"native-serial": 60.0, "unprotected-8": 11.0, "unprotected-mps-8": 12.5, "krex-8": 10.0,
             "krex-mps-8": 10.0}
    recs = [_rec(k, n, ms) for k in spans for n, ms in (("a", 2.0), ("b", 20.0))]
    s = bench.compute_summary(META, [_cell(k, v) for k, v in spans.items()], recs, _ws(tmp_path))
    assert s["cells_done"] == ["native-serial", "unprotected-8", "unprotected-mps-8", "krex-8", "krex-mps-8"]
    h = s["headline"]
    assert h["krex_cells"] == ["krex-8", "krex-mps-8"]
    (row,) = h["mps_throughput"]
    assert row["cell"] == "krex-mps-8" and row["unprotected_cell"] == "unprotected-8"
    assert row["unprotected_mps_cell"] == "unprotected-mps-8"
    assert row["vs_unprotected"] == pytest.approx(1.1) and row["vs_unprotected_mps"] == pytest.approx(1.25)
    by = {(g["cell"], g["metric"]): g for g in h["goals"]}
    assert "1.25x" in by[("krex-mps-8", "throughput vs unprotected-mps (same C)")]["ours"]
    assert "1.10x" in by[("krex-mps-8", "throughput vs unprotected (same C)")]["ours"]
    assert ("krex-8", "throughput vs unprotected-mps (same C)") not in by
    assert any(g["metric"] == "unprotected sharing throughput under MPS" for g in h["goals"])
    # The fidelity tables hold the MPS cells beside the others.
    assert {"unprotected-mps-8", "krex-mps-8"} <= set(s["inflation"]) and "krex-mps-8" in s["flags"]
    assert "krex-mps-8" in s["entry"] and "unprotected-mps-8" in s["ranking"]
    md = bench.render_summary_md(s)
    mps = md.split("### Under NVIDIA MPS")[1].split("## ")[0]
    assert "| krex-mps-8 | 12.0 | unprotected-8 | 10.9 | 1.10x | unprotected-mps-8 | 9.6 | 1.25x |" in mps


def test_without_mps_cells_the_summary_is_unchanged(tmp_path: Path) -> None:
    spans = {"native-serial": 60.0, "unprotected-8": 11.0, "krex-8": 10.0}
    recs = [_rec(k, n, ms) for k in spans for n, ms in (("a", 2.0), ("b", 20.0))]
    s = bench.compute_summary(META, [_cell(k, v) for k, v in spans.items()], recs, _ws(tmp_path))
    assert "mps_throughput" not in s["headline"]
    assert not any("mps" in g["metric"].lower() for g in s["headline"]["goals"])
    assert "MPS" not in bench.render_summary_md(s)


def test_mps_modes_are_refused_where_mps_cannot_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KREX_MPS_CONTROL", raising=False)
    kind = {"v": "sim"}
    monkeypatch.setattr(gpus, "discover", lambda _d="auto": GpuInfo(kind["v"], 1, physical=[0]))
    with pytest.raises(UsageError, match="simulated GPU has none") as e:
        mpscell.require_mps("sim")
    assert "drop unprotected-mps and krex-mps from --modes" in e.value.fix
    monkeypatch.setenv("KREX_MPS_CONTROL", str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="cannot be found"):
        mpscell.require_mps("sim")
    kind["v"] = "nvidia"
    monkeypatch.delenv("KREX_MPS_CONTROL")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control on it
    with pytest.raises(UsageError, match="nvidia-cuda-mps-control is not on PATH") as e:
        mpscell.require_mps("gpu")
    assert "install the NVIDIA driver's MPS tools" in e.value.fix
    kind["v"] = "amd"
    with pytest.raises(UsageError, match="AMD"):
        mpscell.require_mps("gpu")
    kind["v"] = "sim"
    ok = tmp_path / "control"
    ok.write_text("#!/bin/sh\n")
    ok.chmod(0o755)
    monkeypatch.setenv("KREX_MPS_CONTROL", str(ok))
    mpscell.require_mps("sim")  # a stand-in control program: allowed
