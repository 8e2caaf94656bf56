"""The layout's rules, read from the source: who may import whom, and one home for each
helper and constant. Each test names the file and line that broke the rule."""

from __future__ import annotations

import argparse
import ast
import errno
import re
import sys
from pathlib import Path

import pytest

from krex.pystart import module_argv

ROOT = Path(__file__).resolve().parents[2]
KREX = ROOT / "krex"
PY = sorted(p for p in KREX.rglob("*.py") if "_lib" not in p.parts)


def _module(p: Path) -> str:
    rel = p.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(p: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (lazy imports too)."""
    out: list[tuple[int, str]] = []
    pkg = _module(p) if p.name == "__init__.py" else _module(p).rpartition(".")[0]
    for node in ast.walk(ast.parse(p.read_text(), str(p))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*up, base]) if base else ".".join(up)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _offenders(files: list[Path], forbidden: re.Pattern[str]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{line}: imports {mod}"
        for p in files
        for line, mod in _imports(p)
        if forbidden.fullmatch(mod)
    ]


def test_packages_exist_with_their_parts() -> None:
    # The parts a newcomer looks for, where the layout says they are.
    for rel in [
        "node/freezer.py",
        "node/procfs.py",
        "node/mounts.py",
        "node/cpus.py",
        "node/journal.py",
        "node/watchdog.py",
        "node/freezepolicy.py",
        "node/segguard.py",
        "node/attest.py",
        "node/config.py",
        "node/control.py",
        "node/daemon.py",
        "node/shm.py",
        "proc/client.py",
        "proc/launcher.py",
        "proc/region.py",
        "proc/envvars.py",
        "proc/pytest_plugin.py",
        "proc/_hook/sitecustomize.py",
        "proc/autoregion/hook.py",
        "proc/autoregion/core.py",
        "proc/autoregion/targets.py",
        "doctor/checks.py",
        "doctor/coverage.py",
        "device/gpus.py",
        "device/nvml.py",
        "device/elfcheck.py",
    ]:
        assert (KREX / rel).is_file(), rel
    for old in [
        "freezer.py",
        "cpus.py",
        "journal.py",
        "watchdog.py",
        "freezepolicy.py",
        "segguard.py",
        "attest.py",
        "config.py",
        "control.py",
        "region.py",
        "envvars.py",
        "pytest_plugin.py",
        "autoregion.py",
        "doctor.py",
        "coverage.py",
        "gpus.py",
        "nvml.py",
        "elfcheck.py",
        "_hook",
        "daemon.py",
        "shm.py",
        "client.py",
        "launcher.py",
        "bench.py",
        "bench_metrics.py",
        "bench_plots.py",
    ]:
        assert not (KREX / old).exists(), f"krex/{old} is left behind"


def test_one_module_per_harness() -> None:
    from krex.proc.autoregion import targets

    names = {h.__name__.rpartition(".")[2] for h in targets.HARNESSES}
    assert names == {
        "do_bench",
        "do_bench_cudagraph",
        "torch_timer",
        "kernelbench",
        "inductor",
        "pytest_benchmark",
    }
    for h in targets.HARNESSES:  # each built-in comes from exactly one harness module
        others = [o for o in targets.HARNESSES if o is not h]
        assert not set(h.TARGETS) & {k for o in others for k in o.TARGETS}
    assert set(targets.BUILTINS) == {k for h in targets.HARNESSES for k in h.TARGETS}


def test_node_never_imports_the_process_side_bench_or_cli() -> None:
    files = [p for p in PY if p.is_relative_to(KREX / "node")]
    assert files
    above = r"krex\.(proc|bench\w*|cli|batch|fleet|launcher|client|doctor)(\..*)?"
    bad = _offenders(files, re.compile(above))
    assert not bad, bad


def test_process_side_never_imports_bench_batch_fleet_or_cli() -> None:
    # krex.proc sits on krex.node (it reads the segment, joins slots) and below the runners.
    files = [p for p in PY if p.is_relative_to(KREX / "proc")]
    assert files
    bad = _offenders(files, re.compile(r"krex\.(bench\w*|cli|batch|fleet|runner|doctor)(\..*)?"))
    assert not bad, bad


def test_library_never_imports_the_cli() -> None:
    bad = _offenders(PY, re.compile(r"krex\.cli(\..*)?"))
    assert not bad, bad


def test_no_test_module_imports_another() -> None:
    # What several test files share lives in tests/helpers (the Krex world, users, fakes) and
    # their fixtures in a conftest.py: importing a test module runs its collection-time code
    # and ties two files' tests together.
    files = sorted(p for d in ("tests", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    assert any(p.name == "test_regions.py" for p in files)
    bad = _offenders(files, re.compile(r"test_\w*(\..*)?"))
    assert not bad, bad


def test_device_and_base_modules_stay_below_the_parts() -> None:
    # krex.device and the base modules (errors, paths, native, pystart) are used by every part.
    base = [KREX / f for f in ("errors.py", "paths.py", "native.py", "protocol.py", "pystart.py")]
    files = base + [p for p in PY if p.is_relative_to(KREX / "device")]
    above = r"krex\.(node|proc|doctor|bench\w*|cli|batch|fleet|launcher|daemon|runner|worlds)(\..*)?"
    bad = _offenders(files, re.compile(above))
    assert not bad, bad


# ---------------------------------------------------------------- one home per constant

ABI = (ROOT / "interpose" / "krex_abi.h").read_text()
CODE = [p for p in PY] + sorted((ROOT / "cli").glob("*.py"))

# Each timing constant: its #define, and the literal values that restated it before.
CONSTANTS = {
    "KREX_HEARTBEAT_TIMEOUT_NS": (
        "heartbeat",
        [r"HEARTBEAT\w*\s*=\s*[\d.]+\b", r"heartbeat\w*_s\s*=\s*[\d.]"],
    ),
    "KREX_MAX_REGION_MS": ("max region", [r"max_region_s:\s*float\s*=\s*[\d.]", r"default:\s*60\b"]),
    "KREX_ON_DEMAND_IDLE_EXIT_MS": ("idle exit", [r"IDLE_EXIT_S\s*=\s*[\d.]", r"idle_exit_s=[\d.]+\)?$"]),
    "KREX_PAUSE_LEASE_MS": ("pause lease", [r"PAUSE_LEASE_S\s*=\s*[\d.]", r"default=600\.0"]),
    "KREX_PAUSE_TIMEOUT_MS": ("pause timeout", [r"timeout:\s*float\s*=\s*10\.0", r"default=10\.0"]),
    "KREX_DRAIN_TIMEOUT_MS": ("drain timeout", [r"drain_timeout_s:\s*float\s*=\s*[\d.]"]),
    "KREX_FREEZE_TIMEOUT_MS": ("freeze timeout", [r"freeze_timeout_s:\s*float\s*=\s*[\d.]"]),
    "KREX_DAEMON_START_WAIT_MS": ("daemon start wait", [r"\bwait_s:\s*float\s*=\s*[\d.]"]),
}


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_each_timing_constant_is_defined_once(name: str) -> None:
    defs = re.findall(rf"^#define\s+{name}\s+(\d+)\s*$", ABI, flags=re.M)
    assert len(defs) == 1, f"{name} is #defined {len(defs)} times in interpose/krex_abi.h"
    what, restated = CONSTANTS[name]
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in CODE
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for pat in restated
        if re.search(pat, line) and f"lib.{name}" not in line
    ]
    assert not hits, f"the {what} is written again instead of read as lib.{name}: {hits}"
    from krex.native import lib

    assert getattr(lib, name) == int(defs[0])  # cffi reads the same value


def test_the_values_the_code_uses_are_the_headers() -> None:
    from krex.native import lib
    from krex.node import config, control
    from krex.node.daemon import HEARTBEAT_TIMEOUT_S as DAEMON_HEARTBEAT_TIMEOUT_S
    from krex.proc.client import HEARTBEAT_TIMEOUT_S

    assert HEARTBEAT_TIMEOUT_S == DAEMON_HEARTBEAT_TIMEOUT_S == lib.KREX_HEARTBEAT_TIMEOUT_NS / 1e9
    cfg = config.Config()
    assert cfg.max_region_s == lib.KREX_MAX_REGION_MS / 1e3
    assert cfg.drain_timeout_s == lib.KREX_DRAIN_TIMEOUT_MS / 1e3
    assert cfg.freeze_timeout_s == lib.KREX_FREEZE_TIMEOUT_MS / 1e3
    assert config.ON_DEMAND_IDLE_EXIT_S == lib.KREX_ON_DEMAND_IDLE_EXIT_MS / 1e3
    assert control.DEFAULT_PAUSE_LEASE_S == lib.KREX_PAUSE_LEASE_MS / 1e3
    assert control.MAX_PAUSE_LEASE_S == lib.KREX_PAUSE_LEASE_MAX_MS / 1e3
    assert control.DEFAULT_PAUSE_TIMEOUT_S == lib.KREX_PAUSE_TIMEOUT_MS / 1e3


# ---------------------------------------------------------------- one home per helper


def test_one_errno_mapper() -> None:
    from krex.errors import KrexError, NotFound, PermissionDenied, error_kind

    assert error_kind(errno.EACCES) is error_kind(PermissionError(errno.EPERM, "x")) is PermissionDenied
    assert error_kind(errno.EROFS) is PermissionDenied
    assert error_kind(errno.ESRCH) is error_kind(FileNotFoundError(errno.ENOENT, "x")) is NotFound
    assert error_kind(errno.EIO) is error_kind(None) is KrexError
    # The three mappers there were (freezer, CPU pinning, segment) now ask error_kind;
    # an errno may still pick the words (EPERM: "not ours"), never the kind on its own.
    mappers = [
        ("node/freezer.py", "_error"),
        ("node/cpus.py", "_affinity_error"),
        ("node/shm.py", "_oserror"),
    ]
    for rel, func in mappers:
        tree = ast.parse((KREX / rel).read_text())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func)
        assert "error_kind(" in ast.unparse(fn), f"krex/{rel}:{func} does not use krex.errors.error_kind"
        for stmt in fn.body:
            if isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                by_errno = re.search(r"errno\.(EPERM|EACCES|ENOENT|ESRCH)\b", test)
                assert not by_errno or "kind is" in test, f"krex/{rel}:{func} maps by itself: {test}"
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PY
        if p.name != "errors.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "errno.EACCES" in line
    ]
    assert not hits, hits


def test_errno_mapper_is_what_the_freezer_and_pinning_raise() -> None:
    from krex.errors import NotFound, PermissionDenied
    from krex.node import cpus, freezer

    e = freezer._error(OSError(errno.EROFS, "Read-only file system"), "cannot write x")
    assert type(e) is PermissionDenied and "read-only" in e.fix
    e = cpus._affinity_error(123, OSError(errno.EACCES, "Permission denied"), "pinning")
    assert type(e) is PermissionDenied  # was a plain KrexError before there was one mapper
    assert type(cpus._affinity_error(123, ProcessLookupError(errno.ESRCH, "x"), "pinning")) is NotFound


def test_signal_freezer_state_lives_in_the_state_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # One set of state-directory rules (krex.paths): the signal freezer's state goes
    # under KREX_STATE_DIR, not under a directory of its own making.
    from krex.node import freezer, sigfreezer

    state = tmp_path / "state"
    monkeypatch.setenv("KREX_STATE_DIR", str(state))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    fz = sigfreezer.SignalFreezer.probe("krex-layout-test")
    assert Path(fz.root).is_relative_to(state), fz.root
    assert not (tmp_path / "xdg").exists()
    assert "_state_base" not in vars(freezer)


def test_one_way_to_start_the_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from krex.node import config
    from krex.proc.envvars import opt_in_env

    monkeypatch.setenv("KREX_STATE_DIR", str(tmp_path))
    argv = config.daemon_argv(
        "sim", tmp_path / "krexd.log", {"max_region_s": 5.0, "idle_exit_s": None}, on_demand=True
    )
    start = module_argv("krex.node.daemon")  # the current directory off sys.path
    assert argv[: len(start)] == start and start[0] == sys.executable
    assert argv[len(start) :] == [
        "--device",
        "sim",
        "--log",
        str(tmp_path / "krexd.log"),
        "--max-region",
        "5.0",
        "--on-demand",
    ]
    # The shim's on-demand command is the same argv.
    cmd = opt_in_env("sim", "/krex-layout")["KREX_DAEMON_CMD"]
    import shlex

    assert shlex.split(cmd) == [
        "exec",
        "env",
        "-u",
        "LD_PRELOAD",
        *config.daemon_argv("sim", tmp_path / "krexd.log", on_demand=True),
    ]
    # Nobody else spells out `-m krex.node.daemon`.
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in CODE
        if p.name != "config.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"""["']-m["'],\s*["']krex\.daemon["']|-m krex\.daemon --""", line)
    ]
    assert not hits, hits


def test_one_options_table_for_argparse_click_and_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import click
    from krex.cli.main import daemon_start

    from krex.node import config

    ap = argparse.ArgumentParser(add_help=False)
    config.add_arguments(ap)
    argparse_flags = {a.option_strings[0]: a.dest for a in ap._actions if a.option_strings}
    click_flags = {
        p.opts[0]: p.name
        for p in daemon_start.params
        if isinstance(p, click.Option) and p.opts[0] not in ("--device", "--foreground")
    }
    table = {k.flag: k.name for k in config.KEYS if k.flag}
    assert argparse_flags == click_flags == table
    fields = {f.name for f in dataclasses.fields(config.Config)}
    assert all(k.name in fields for k in config.KEYS)
    # The same value means the same in every front: text from a flag or a typed value.
    monkeypatch.setenv("KREX_CONFIG", "/dev/null")
    for k in config.KEYS:
        monkeypatch.delenv(k.env, raising=False)
    a = ap.parse_args(["--max-region", "7", "--idle-exit", "never", "--freeze-policy", "gpu"])
    cfg = config.config_from("sim", config.overrides_from(a))
    assert (cfg.max_region_s, cfg.idle_exit_s, cfg.freeze_policy) == (7.0, None, "gpu")
    assert cfg.sources["idle_exit_s"] == "command line"
    with pytest.raises(SystemExit):
        ap.parse_args(["--max-region", "nan"])
