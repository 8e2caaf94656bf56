"""PNG plots of a `krex bench` summary (matplotlib, Agg backend: no display needed).

  throughput.png         commands/min against C, per mode (native passes as lines)
  inflation_cdf.png      CDF of timing inflation against native-serial, per band and cell
  flip_rates.png         pairwise flip rate per true-gap class, per cell
  critical_fraction.png  histogram of the critical-region fraction (native-serial)

A simulated run carries the SIMULATED label in every figure's title."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from krex.bench import metrics as bm
from krex.bench.records import CellRanking, Summary
from krex.errors import NotFound

__all__ = ["write_plots"]

COLORS = {"native-serial": "#444444", "native-repeat": "#888888", "unprotected": "#d62728", "krex": "#1f77b4",
          "unprotected-mps": "#ff7f0e", "krex-mps": "#17becf"}
SHARED = ("unprotected", "unprotected-mps", "krex", "krex-mps")  # the modes with a C


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise NotFound(
            "matplotlib is not installed: krex bench cannot draw its plots",
            "pip install 'krex-gpu[bench]', or pass --no-plots",
        ) from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def _figure(path: Path, title: str, figsize: tuple[float, float], ncols: int = 0) -> Iterator[Any]:
    """One figure for the body to draw on: its Axes (with ``ncols``: one row of that many,
    as an array, the title then over them all); titled, laid out and written to ``path``
    after the body."""
    plt = _plt()
    if ncols:
        fig, ax = plt.subplots(1, ncols, figsize=figsize, squeeze=False)
    else:
        fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        (fig.suptitle if ncols else ax.set_title)(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def _axes(ax: Any, xlabel: str | None, ylabel: str, grid: str = "both") -> None:
    """An Axes' labels and its light grid."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis=grid, alpha=0.3)


def _title(s: Summary, text: str) -> str:
    dev = s.get("device") or "?"
    names = (s.get("versions") or {}).get("gpu_names") or []
    where = f"{dev}: {names[0]}" if names and dev != "sim" else dev
    t = f"{text} ({where})"
    if s.get("simulated"):
        t = f"{s.get('label')}\n{t}"
    return t


def _finite(xs: list[Any]) -> list[float]:
    out = []
    for x in xs:
        try:
            v = float(x)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append(v)
    return out


def _mode_of(key: str) -> str:
    for m in sorted(SHARED, key=len, reverse=True):  # unprotected-mps-8 before unprotected-*
        if key.startswith(m + "-") and key[len(m) + 1 : len(m) + 2].isdigit():
            return m
    return key


def _shade(key: str, keys: list[str]) -> str:
    """A colour per cell: the mode's hue, darker for larger C."""
    import matplotlib.colors as mcolors

    mode = _mode_of(key)
    base = COLORS.get(mode, "#444444")
    same = [k for k in keys if _mode_of(k) == mode]
    if mode not in SHARED or len(same) < 2:
        return base
    i = same.index(key)
    r, g, b = mcolors.to_rgb(base)
    f = 0.45 + 0.55 * i / (len(same) - 1)  # 0.45 (light) .. 1.0 (the mode's colour)
    return mcolors.to_hex((1 - f * (1 - r), 1 - f * (1 - g), 1 - f * (1 - b)))


def plot_throughput(s: Summary, path: Path) -> Path:
    with _figure(path, _title(s, "Throughput against concurrency"), (7, 4.5)) as ax:
        _draw_throughput(s, ax)
    return path


def _draw_throughput(s: Summary, ax: Any) -> None:
    thr = s.get("throughput") or []
    cs_all: list[int] = sorted({int(t["c"]) for t in thr if t["mode"] in SHARED}) or [1]
    for mode in SHARED:
        pts = sorted(
            (int(t["c"]), float(t["cmds_per_min"]))
            for t in thr
            if t["mode"] == mode and t["cmds_per_min"] is not None and math.isfinite(t["cmds_per_min"])
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[mode], label=f"{mode}-C")
    for mode, style in (("native-serial", "--"), ("native-repeat", ":")):
        t = next((t for t in thr if t["mode"] == mode), None)
        if t and t["cmds_per_min"] is not None and math.isfinite(t["cmds_per_min"]):
            ax.axhline(t["cmds_per_min"], linestyle=style, color=COLORS[mode], label=f"{mode} (C=1)")
    ns = s.get("native_cpm")
    amd = (s.get("critical") or {}).get("amdahl_bound")
    top = max([float(t["cmds_per_min"]) for t in thr if _finite([t["cmds_per_min"]])] or [1.0])
    if ns is not None and amd is not None and math.isfinite(ns) and math.isfinite(amd):
        bound = ns * amd
        if bound <= 2.5 * top:
            ax.axhline(bound, linestyle="-.", color="#2ca02c", label=f"Amdahl bound ({amd:.1f}x native)")
        else:  # a line far above the data would flatten it: say where the bound is instead
            ax.set_ylim(0, 1.3 * top)
            ax.text(
                0.02,
                0.97,
                f"Amdahl bound {bound:.0f} cmds/min ({amd:.1f}x native), off the scale",
                transform=ax.transAxes,
                va="top",
                fontsize=8,
                color="#2ca02c",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs_all)
    ax.set_xticklabels([str(c) for c in cs_all])
    _axes(ax, "concurrent commands C", "commands / minute")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def plot_inflation_cdf(s: Summary, path: Path) -> Path:
    title = _title(s, "Timing inflation CDF per band")
    with _figure(path, title, (5 * len(bm.BANDS), 4.2), ncols=len(bm.BANDS)) as axes:
        _draw_inflation_cdf(s, axes)
    return path


def _draw_inflation_cdf(s: Summary, axes: Any) -> None:
    infl = s.get("inflation") or {}
    paper = (s.get("paper") or {}).get("p95_inflation") or {}
    for ax, (band, _) in zip(axes[0], bm.BANDS, strict=True):
        drawn = 0
        keys = list(infl)
        for key, bands in infl.items():
            xs = sorted(100.0 * v for v in _finite((bands.get(band) or {}).get("values") or []))
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            mode = _mode_of(key)
            ax.step(
                [xs[0], *xs],
                [0.0, *ys],
                where="post",
                label=f"{key} (n={len(xs)})",
                color=_shade(key, keys),
                linestyle="--" if mode == "native-repeat" else "-",
                marker="." if len(xs) < 4 else None,
            )
            drawn += 1
        if band in paper:
            ax.axvline(
                100 * paper[band], color="#2ca02c", linestyle=":", label=f"paper p95 {100 * paper[band]:.2f}%"
            )
        ax.axhline(0.95, color="#bbbbbb", linewidth=0.8)
        ax.set_ylim(0.0, 1.02)
        ax.set_xscale("symlog", linthresh=1.0)
        _axes(ax, "inflation vs native-serial (%)", "fraction of commands")
        ax.set_title(f"kernels {band}" + ("" if drawn else " (no data)"), fontsize=9)
        ax.legend(fontsize=6)


def plot_flip_rates(s: Summary, path: Path) -> Path:
    ranking = s.get("ranking") or {}
    classes = [g[0] for g in bm.GAP_CLASSES]
    keys = [k for k in ranking if any((ranking[k]["flip"].get(c) or {}).get("pairs") for c in classes)]
    size = (max(7, 1.2 * len(classes) * max(1, len(keys)) / 2), 4.5)
    with _figure(path, _title(s, "Pairwise ranking flips by true gap"), size) as ax:
        _draw_flip_rates(ranking, classes, keys, ax)
    return path


def _draw_flip_rates(ranking: dict[str, CellRanking], classes: list[str], keys: list[str], ax: Any) -> None:
    width = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        vals = []
        for c in classes:
            f = ranking[k]["flip"].get(c) or {}
            rate = f.get("rate")
            vals.append(100.0 * float(rate) if f.get("pairs") and rate is not None else 0.0)
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(classes))]
        mode = _mode_of(k)
        bars = ax.bar(
            xs,
            vals,
            width=width,
            label=k,
            color=_shade(k, keys),
            hatch="//" if mode == "native-repeat" else None,
            edgecolor="white",
        )
        for rect, c in zip(bars, classes, strict=True):
            f = ranking[k]["flip"].get(c) or {}
            if f.get("pairs"):
                ax.annotate(
                    f"{rect.get_height():.0f}",
                    (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    ax.set_xticks(range(len(classes)))
    ax.set_xticklabels([f"true gap {c}" for c in classes])
    _axes(ax, None, "pairwise flip rate (%)", grid="y")
    if keys:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no ranking data", ha="center", va="center", transform=ax.transAxes)


def plot_critical_fraction(s: Summary, path: Path) -> Path:
    c = s.get("critical") or {}
    fr = [100.0 * v for v in _finite(c.get("fractions") or [])]
    with _figure(path, _title(s, "Critical-region fraction (native-serial)"), (7, 4.2)) as ax:
        _draw_critical_fraction(fr, ax)
    return path


def _draw_critical_fraction(fr: list[float], ax: Any) -> None:
    if fr:
        ax.hist(fr, bins=min(30, max(5, len(fr) // 2)), color="#1f77b4", alpha=0.8)
        med = bm.median(fr)
        ax.axvline(med, color="black", linestyle="--", label=f"median {med:.1f}%")
        ax.axvline(12.0, color="#2ca02c", linestyle=":", label="paper median 12%")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no native-serial data", ha="center", va="center", transform=ax.transAxes)
    _axes(ax, "critical-region fraction of the command's time (%)", "commands")


def write_plots(summary: Summary, out_dir: Path) -> list[Path]:
    """Draw every plot into ``out_dir``; return the paths."""
    return [
        plot_throughput(summary, out_dir / "throughput.png"),
        plot_inflation_cdf(summary, out_dir / "inflation_cdf.png"),
        plot_flip_rates(summary, out_dir / "flip_rates.png"),
        plot_critical_fraction(summary, out_dir / "critical_fraction.png"),
    ]
