"""Reading one run's figure from its output: a JSON key path or a regular expression, and
presets for common harnesses.

    kernelbench        KernelBench's scripts (``[Timing] Custom Kernel exec time: X ms``,
                       else the ``runtime=X`` of a printed KernelExecResult); ms
    do_bench           a printed ``triton.testing.do_bench`` result: the last ``X ms`` in the
                       output, else the last line that is a bare number; ms
    pytest-benchmark   pytest-benchmark's JSON (``--benchmark-json={out}``): the first
                       benchmark's median; s
    json:PATH          a key path into the output's JSON: the whole output, else its last line
                       that is a JSON document holding PATH (``a.b``, ``a.0.b``, ``a[0].b``,
                       ``benchmarks[name=test_mm].stats.min``)
    re:REGEX           the last match of REGEX; its first group if it has one

A figure that is not found, or is not a finite positive number, raises FigureNotFound
(a UsageError) naming the source and what the output ended with."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from krex.errors import UsageError

__all__ = ["FigureNotFound", "FigureSource", "PRESETS", "UNITS", "parse_figure", "parse_key_path"]

UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}  # to seconds
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
SPEC_HELP = (
    "give --figure kernelbench, do_bench, pytest-benchmark, json:KEY.PATH or re:REGEX "
    "(e.g. json:mean_us, 're:time: ([0-9.]+) ms')"
)


class FigureNotFound(UsageError):
    """A run's output does not hold the figure the comparison reads."""


@dataclass(frozen=True)
class FigureSource:
    """Where a run's figure is: ``kind`` "json" (``key`` a key path) or "regex" (``key`` one
    or more patterns, tried in order). ``unit``: s, ms, us, ns, or "" when unknown."""

    name: str
    kind: str
    key: tuple[str, ...]
    unit: str = ""
    lower_is_better: bool = True

    def read(self, text: str) -> float:
        v = _read_json(self, text) if self.kind == "json" else _read_regex(self, text)
        if not (math.isfinite(v) and v > 0):
            raise FigureNotFound(
                f"figure {self.name}: {v!r} is not a positive number",
                "a comparison is made of ratios of positive figures (times, throughputs)",
            )
        return v

    def with_unit(self, unit: str) -> FigureSource:
        if unit not in UNITS:
            units = ", ".join(UNITS)
            raise UsageError(f"unit {unit!r} is not one of {units}", f"give one of {units}")
        return FigureSource(self.name, self.kind, self.key, unit, self.lower_is_better)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "key": list(self.key), "unit": self.unit,
                "lower_is_better": self.lower_is_better}


def _tail(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-300:] or "(no output)"


# ----------------------------------------------------------------------------------- key paths

_PART = re.compile(r"\[(\d+)\]|\[([^=\]]+)=([^\]]*)\]|([^.\[\]]+)")


def parse_key_path(path: str) -> list[Any]:
    """``a.b[0].c`` / ``a.0.c`` / ``a[name=x].c`` as steps: str (a key), int (an index) or
    (field, value) (the first list item whose field is value, compared as text)."""
    steps: list[Any] = []
    pos = 0
    path = path.strip()
    if not path:
        raise UsageError("an empty JSON key path", SPEC_HELP)
    while pos < len(path):
        if path[pos] == ".":
            pos += 1
            continue
        m = _PART.match(path, pos)
        if m is None:
            raise UsageError(f"JSON key path {path!r}: cannot read it from {path[pos:]!r}", SPEC_HELP)
        if m.group(1) is not None:
            steps.append(int(m.group(1)))
        elif m.group(2) is not None:
            steps.append((m.group(2), m.group(3)))
        else:
            word = m.group(4)
            steps.append(int(word) if word.isdigit() else word)
        pos = m.end()
    return steps


def _walk(doc: Any, steps: list[Any]) -> Any:
    cur = doc
    for s in steps:
        if isinstance(s, tuple):
            if not isinstance(cur, list):
                raise KeyError(s)
            cur = next(x for x in cur if isinstance(x, dict) and str(x.get(s[0])) == s[1])
        elif isinstance(s, int) and isinstance(cur, list):
            cur = cur[s]
        elif isinstance(cur, dict):
            cur = cur[str(s)] if str(s) in cur else cur[s]
        else:
            raise KeyError(s)
    return cur


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _read_json(src: FigureSource, text: str) -> float:
    steps = parse_key_path(src.key[0])
    docs: list[Any] = []
    try:
        docs.append(json.loads(text))
    except ValueError:
        for line in reversed(text.splitlines()):
            s = line.strip()
            if s[:1] in ("{", "["):
                try:
                    docs.append(json.loads(s))
                except ValueError:
                    continue
    for doc in docs:
        try:
            v = _number(_walk(doc, steps))
        except (KeyError, IndexError, StopIteration, TypeError):
            continue
        if v is not None:
            return v
    raise FigureNotFound(
        f"figure {src.name}: no JSON document in the output holds a number at {src.key[0]!r} "
        f"(output ends: {_tail(text)})",
        "check the key path against the command's JSON output, or use re:REGEX",
    )


def _read_regex(src: FigureSource, text: str) -> float:
    for pat in src.key:
        rx = re.compile(pat, re.MULTILINE)
        last = None
        for last in rx.finditer(text):  # noqa: B007 - the last match is the one wanted
            pass
        if last is None:
            continue
        got = last.group(1) if rx.groups else last.group(0)
        v = _number(got)
        if v is not None:
            return v
        raise FigureNotFound(f"figure {src.name}: the match {got!r} is not a number",
                             "make the first group of the regular expression capture only the number")
    raise FigureNotFound(
        f"figure {src.name}: no match in the output (output ends: {_tail(text)})",
        "check that the command prints its figure, and the pattern",
    )


# ------------------------------------------------------------------------------------- presets

PRESETS: dict[str, Callable[[], FigureSource]] = {
    "kernelbench": lambda: FigureSource(
        "kernelbench", "regex",
        (rf"\[Timing\] Custom Kernel exec time:\s*({_NUM})\s*ms", rf"\bruntime=({_NUM})"), "ms"),
    "do_bench": lambda: FigureSource(
        "do_bench", "regex", (rf"({_NUM})\s*ms\b", rf"^\s*({_NUM})\s*$"), "ms"),
    "pytest-benchmark": lambda: FigureSource("pytest-benchmark", "json", ("benchmarks.0.stats.median",), "s"),
}


def parse_figure(spec: str | FigureSource, unit: str | None = None,
                 lower_is_better: bool | None = None) -> FigureSource:
    """A FigureSource from ``kernelbench``, ``do_bench``, ``pytest-benchmark``,
    ``json:PATH`` or ``re:REGEX`` (or a FigureSource as it is); ``unit`` and
    ``lower_is_better`` override the preset's."""
    if isinstance(spec, FigureSource):
        src = spec
    elif spec in PRESETS:
        src = PRESETS[spec]()
    elif spec.startswith("json:"):
        parse_key_path(spec[5:])  # a bad path fails now, not after the first run
        src = FigureSource(spec, "json", (spec[5:],))
    elif spec.startswith("re:"):
        try:
            re.compile(spec[3:])
        except re.error as e:
            raise UsageError(f"--figure {spec}: not a regular expression ({e})", SPEC_HELP) from None
        src = FigureSource(spec, "regex", (spec[3:],))
    else:
        raise UsageError(f"--figure {spec!r}: unknown figure source", SPEC_HELP)
    if unit:
        src = src.with_unit(unit)
    if lower_is_better is not None:
        src = FigureSource(src.name, src.kind, src.key, src.unit, lower_is_better)
    return src
