"""The lean `krex run` front door (cli/lean.py): it must read every command line it takes
exactly as the click CLI does, and leave every other one to click."""

from __future__ import annotations

import pytest
from krex.cli.lean import parse_run

from krex.node.admission import Admission, run_kind

TAKEN = [
    ["run", "--", "true"],
    ["run", "true"],
    ["run", "python", "-c", "pass"],
    ["-q", "run", "--device", "sim", "--", "python", "-c", "pass"],
    ["-v", "run", "--device=gpu", "--gpu", "1", "sh", "-c", "exit 3"],
    ["-vv", "run", "--gpu=0", "--freeze", "gpu", "--keep-leftovers", "--", "x", "--device", "sim"],
    ["--verbose", "run", "--no-daemon", "--device", "sim", "true"],
    ["--quiet", "run", "--report", "out.json", "--freeze=adaptive", "--", "--weird-name"],
    ["-qq", "run", "--device", "auto", "-", "arg"],
    ["run", "--device", "sim", "--device", "gpu", "true"],  # the last one wins, as in click
]

LEFT_TO_CLICK = [
    ["run"],  # no command: click's path reports it
    ["run", "--"],
    ["run", "--help"],
    ["run", "-h", "true"],
    ["--help"],
    ["--version"],
    ["status"],
    ["run", "--device", "cuda", "true"],  # click's choice error
    ["run", "--freeze", "none", "true"],
    ["run", "--gpu", "x", "true"],
    ["run", "--gpu", "-1", "true"],
    ["run", "--gpu"],
    ["run", "--bogus", "true"],
    ["-vq", "run", "true"],  # contradiction: click's usage error
    ["-x", "run", "true"],
    ["run", "--report", "", "true"],
]


def _click_parse(argv: list[str]) -> dict[str, object]:
    import warnings

    from krex.cli.main import cli

    ctx = cli.make_context("krex", list(argv), resilient_parsing=False)
    with warnings.catch_warnings():  # click 8.2 deprecates protected_args; 8.1 needs it
        warnings.simplefilter("ignore", DeprecationWarning)
        rest = [*ctx.protected_args, *ctx.args]
    assert rest[0] == "run"
    cmd = cli.get_command(ctx, "run")
    assert cmd is not None
    sub = cmd.make_context("run", rest[1:], parent=ctx)
    return {**ctx.params, **sub.params}


@pytest.mark.parametrize("argv", TAKEN, ids=" ".join)
def test_lean_reads_a_command_line_as_click_does(argv: list[str]) -> None:
    o = parse_run(argv)
    assert o is not None
    c = _click_parse(argv)
    assert o["cmd"] == list(c["cmd"])  # type: ignore[call-overload]
    for k in ("verbose", "quiet", "device", "gpu", "report", "freeze", "no_daemon", "keep_leftovers"):
        assert o[k] == c[k], k


@pytest.mark.parametrize("argv", LEFT_TO_CLICK, ids=" ".join)
def test_lean_leaves_the_rest_to_click(argv: list[str]) -> None:
    assert parse_run(argv) is None


def test_lean_leaves_a_report_path_click_refuses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert parse_run(["run", "--report", str(tmp_path), "true"]) is None  # a directory
    ro = tmp_path / "ro.json"
    ro.write_text("{}")
    ro.chmod(0o444)
    import os

    if os.geteuid() != 0:  # root may write anyway, and click agrees
        assert parse_run(["run", "--report", str(ro), "true"]) is None


@pytest.mark.parametrize(
    ("device", "daemon", "kind"),
    [
        ("sim", "nvidia", "sim"),
        ("sim", "sim", "sim"),
        ("auto", "sim", "sim"),
        ("auto", "nvidia", "gpu"),
        ("auto", "amd", "gpu"),
        ("gpu", "nvidia", "gpu"),
        ("gpu", "amd", "gpu"),
    ],
)
def test_the_daemons_device_decides_without_discovery(device: str, daemon: str, kind: str) -> None:
    assert run_kind(device, daemon) == kind


def test_gpu_asked_of_a_simulated_daemon_still_needs_a_real_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """krexd checks it (on the same node) before any slot is taken: the guardian does no
    GPU discovery."""
    from types import SimpleNamespace

    from krex.device import gpus
    from krex.errors import NotFound

    def no_gpu(device: str) -> None:
        raise NotFound("no GPU found", "use --device sim")

    monkeypatch.setattr(gpus, "discover", no_gpu)
    daemon = SimpleNamespace(info=SimpleNamespace(kind="sim"))
    with pytest.raises(NotFound):
        Admission._check_native(daemon, "gpu", {})  # type: ignore[arg-type]
    Admission._check_native(daemon, "sim", {})  # type: ignore[arg-type]
    Admission._check_native(SimpleNamespace(info=SimpleNamespace(kind="nvidia")), "gpu", {})  # type: ignore[arg-type]
