"""The `krex bench` corpus: the manifest (examples/workloads/manifest.py, shipped in the
wheel as krex/workloads/) loaded into `Workload`s."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from krex.errors import NotFound, UsageError

__all__ = ["Workload", "corpus_digest", "default_corpus_path", "load_corpus"]


@dataclass(frozen=True)
class Workload:
    name: str
    device: str  # "gpu" or "sim"
    script: Path  # absolute
    args: tuple[str, ...]
    family: str | None = None
    param: float = 0.0
    truth: str | None = None  # "param", "measured" or None
    work: float | None = None
    quick: bool = False
    expect_ms: float = 0.0
    est_wall_s: float = 5.0
    env: tuple[tuple[str, str], ...] = ()  # variables the command runs with, e.g. KREX_AUTO_REGION

    def argv(self, python: str) -> list[str]:
        return [python, str(self.script), *self.args]


def default_corpus_path() -> Path:
    """The corpus that ships with krex: ``krex/workloads/manifest.py`` of an installed
    wheel (package data), else ``examples/workloads/manifest.py`` of the source tree
    this krex runs from (an editable install)."""
    here = Path(__file__).resolve().parent.parent  # krex/
    tried = [here / "workloads" / "manifest.py", here.parent / "examples" / "workloads" / "manifest.py"]
    for p in tried:
        if p.is_file():
            return p
    raise NotFound(
        f"no workload corpus at {tried[0]} or {tried[1]}",
        "reinstall krex (the corpus ships in the wheel), or pass --corpus PATH/TO/manifest.py",
    )


def _load_manifest(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise NotFound(f"no corpus manifest at {path}", "pass --corpus PATH/TO/manifest.py")
    spec = importlib.util.spec_from_file_location(f"krex_bench_manifest_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path} is not a Python file", "pass the corpus's manifest.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the manifest is user code: report any failure as a usage error
        raise UsageError(f"{path} failed to load: {type(e).__name__}: {e}", "fix the manifest") from e
    items = getattr(mod, "WORKLOADS", None)
    if not isinstance(items, list):
        raise UsageError(f"{path} defines no WORKLOADS list", "define WORKLOADS = [dict(...), ...]")
    return items


def load_corpus(
    path: Path | None, device: str, quick: bool = False, only: Sequence[str] = ()
) -> list[Workload]:
    """The corpus's workloads for ``device`` ("gpu" or "sim"); the ``quick`` subset if
    asked; only names containing one of ``only`` (substrings) if given."""
    path = (path or default_corpus_path()).resolve()
    base = path.parent
    out: list[Workload] = []
    seen: set[str] = set()
    for i, item in enumerate(_load_manifest(path)):
        where = f"{path}: WORKLOADS[{i}]"
        if not isinstance(item, dict) or not {"name", "device", "script", "args"} <= set(item):
            raise UsageError(
                f"{where} needs at least name, device, script and args", "see the manifest's docstring"
            )
        if item["device"] != device:
            continue
        name = str(item["name"])
        if name in seen:
            raise UsageError(f"{where}: duplicate name {name!r}", "give every command a unique name")
        seen.add(name)
        truth = item.get("truth")
        if truth not in (None, "param", "measured"):
            raise UsageError(
                f"{where}: truth must be 'param', 'measured' or None, not {truth!r}", "fix the manifest"
            )
        if truth == "param" and item.get("work") is None:
            raise UsageError(f"{where}: truth 'param' needs 'work'", "give the candidate's relative work")
        script = (base / str(item["script"])).resolve()
        if not script.is_file():
            raise NotFound(f"{where}: script {script} does not exist", "fix the manifest's script path")
        w = Workload(
            name=name,
            device=device,
            script=script,
            args=tuple(str(a) for a in item["args"]),
            family=item.get("family"),
            param=float(item.get("param") or 0.0),
            truth=truth,
            work=None if item.get("work") is None else float(item["work"]),
            quick=bool(item.get("quick", False)),
            expect_ms=float(item.get("expect_ms") or 0.0),
            est_wall_s=float(item.get("est_wall_s") or 5.0),
            env=tuple(sorted((str(k), str(v)) for k, v in (item.get("env") or {}).items())),
        )
        if quick and not w.quick:
            continue
        if only and not any(s in name for s in only):
            continue
        out.append(w)
    if not out:
        what = (
            f"{device} workloads"
            + (" in the --quick subset" if quick else "")
            + (f" matching {','.join(only)}" if only else "")
        )
        raise UsageError(f"{path} has no {what}", "check --device, --quick and --only")
    return out


def corpus_digest(workloads: Sequence[Workload]) -> str:
    h = hashlib.sha256()
    for w in workloads:
        h.update(json.dumps([w.name, list(w.args), w.family, w.truth, w.work]).encode())
    return h.hexdigest()[:16]
