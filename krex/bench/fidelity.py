"""What a krex cell's region records say, against the native passes (pure; no I/O).

* **entry**: quantiles (p50/p95/p99) per cell of each region's protocol entry (krexd's
  ``entry_s``: gate, stragglers, drain, freeze, pin, settle), its queue wait, request to
  grant (the two together), drain and settle, from the journal's region records that
  `krex run --report` hands the bench.
* **flags against native**: a krex run is *inflated* when its ``ms`` exceeds the same
  command's native-serial median by more than the native noise: the p95 of
  ``|inflation|`` of the native noise runs (native-repeat against native-serial, else the
  native-serial passes against their median) in the command's duration band, or a stated
  threshold. A run is *flagged* with every reason (journal ``flags``) of its regions. Per
  reason: precision = flagged and inflated / flagged, recall = flagged and inflated /
  inflated; ``n/a`` where the denominator is 0.
* **NVML** per region, where the bench sampled it (a real GPU): SM clock, power and
  temperature at the grant and inside the region, and krexd's own SM clock at the grant
  (its attestation), for inflated and for other runs apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from krex.bench import metrics as bm

__all__ = [
    "ANY",
    "FlagScore",
    "Judged",
    "Pcts",
    "entry_stats",
    "flag_scores",
    "judge_runs",
    "noise_thresholds",
    "nvml_stats",
    "pcts",
    "render_md",
]

ANY = "any flag"  # the row for "flagged with any reason"
NA = "n/a"


@dataclass(frozen=True)
class Pcts:
    n: int
    p50: float
    p95: float
    p99: float
    max: float

    def to_json(self) -> dict[str, float | int | None]:
        def f(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"n": self.n, "p50": f(self.p50), "p95": f(self.p95), "p99": f(self.p99), "max": f(self.max)}


def pcts(xs: Iterable[float]) -> Pcts:
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not v:
        return Pcts(0, math.nan, math.nan, math.nan, math.nan)
    return Pcts(len(v), bm.percentile(v, 50), bm.percentile(v, 95), bm.percentile(v, 99), max(v))


def _regions(r: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [g for g in (r.get("krex") or {}).get("regions") or [] if isinstance(g, dict)]


def _num(g: Mapping[str, Any], k: str) -> float | None:
    v = g.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


ENTRY_PARTS = ("entry_s", "queue_wait_s", "request_to_grant_s", "drain_s", "settle_s", "freeze_s")


def entry_stats(recs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Quantiles of each region's entry parts over a cell's runs (seconds)."""
    parts: dict[str, list[float]] = {k: [] for k in ENTRY_PARTS}
    n = 0
    for r in recs:
        for g in _regions(r):
            n += 1
            e, q = _num(g, "entry_s"), _num(g, "queue_wait_s")
            for k in ENTRY_PARTS:
                v = (
                    (e + q if e is not None and q is not None else None)
                    if k == "request_to_grant_s"
                    else _num(g, k)
                )
                if v is not None:
                    parts[k].append(v)
    return {"regions": n, **{k: pcts(v).to_json() for k, v in parts.items()}}


def noise_thresholds(
    noise_pairs: Iterable[tuple[float, float]], stated: float | None = None
) -> dict[str, float]:
    """Per disjoint band (metrics.SPLIT_BANDS): the inflation above which a run is inflated.
    ``stated`` (a fraction) for every band when given; else the p95 of ``|inflation|`` of
    the native noise runs, (reference ms, measured ms) pairs, in that band (NaN: no data)."""
    if stated is not None:
        return {label: float(stated) for label, _lo, _hi in bm.SPLIT_BANDS}
    by_band = bm.inflation_by_split_band(noise_pairs)
    return {b: bm.percentile([abs(x) for x in v], 95) if v else math.nan for b, v in by_band.items()}


def _band(ref_ms: float) -> str | None:
    for label, lo, hi in bm.SPLIT_BANDS:
        if lo < ref_ms <= hi:
            return label
    return None


@dataclass
class Judged:
    """One krex run against its native reference."""

    name: str
    inflation: float
    threshold: float  # NaN: no native noise for its band (the run is not judged)
    reasons: set[str] = field(default_factory=set)
    regions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def inflated(self) -> bool | None:
        if math.isnan(self.threshold):
            return None
        return self.inflation > self.threshold


def _reasons(regions: Sequence[Mapping[str, Any]]) -> set[str]:
    out: set[str] = set()
    for g in regions:
        flags = [str(f) for f in g.get("flags") or []]
        out.update(flags)
        if g.get("contaminated") and not flags:
            out.add("contaminated")
        if g.get("cut"):
            out.add("cut")
    return out


def judge_runs(
    recs: Iterable[Mapping[str, Any]], ref_ms: Mapping[str, float], thresholds: Mapping[str, float]
) -> list[Judged]:
    """Every successful krex run with at least one region and a native reference."""
    out: list[Judged] = []
    for r in recs:
        res = r.get("result")
        regions = _regions(r)
        if not r.get("ok") or not isinstance(res, dict) or not regions:
            continue
        ms, ref = res.get("ms"), ref_ms.get(str(r.get("name")))
        if not isinstance(ms, (int, float)) or not ref or not math.isfinite(float(ms)):
            continue
        band = _band(ref)
        thr = thresholds.get(band, math.nan) if band else math.nan
        out.append(Judged(str(r.get("name")), bm.inflation(float(ms), ref), thr, _reasons(regions), regions))
    return out


@dataclass(frozen=True)
class FlagScore:
    flagged: int
    inflated: int
    both: int

    @property
    def precision(self) -> float:
        return self.both / self.flagged if self.flagged else math.nan

    @property
    def recall(self) -> float:
        return self.both / self.inflated if self.inflated else math.nan

    def to_json(self) -> dict[str, float | int | None]:
        p, r = self.precision, self.recall
        return {
            "flagged": self.flagged,
            "inflated": self.inflated,
            "flagged_and_inflated": self.both,
            "precision": None if math.isnan(p) else p,
            "recall": None if math.isnan(r) else r,
        }


def flag_scores(judged: Sequence[Judged]) -> dict[str, Any]:
    """Precision and recall of each flag reason (and of any flag) against inflation, over
    the runs that could be judged (their band has a native noise figure)."""
    runs = [j for j in judged if j.inflated is not None]
    inflated = sum(1 for j in runs if j.inflated)
    reasons = sorted({x for j in runs for x in j.reasons})
    scores: dict[str, FlagScore] = {}
    for reason in [ANY, *reasons]:
        hit = [j for j in runs if (j.reasons if reason == ANY else reason in j.reasons)]
        scores[reason] = FlagScore(len(hit), inflated, sum(1 for j in hit if j.inflated))
    return {
        "runs": len(judged),
        "judged": len(runs),
        "inflated": inflated,
        "by_reason": {k: v.to_json() for k, v in scores.items()},
    }


def _nv(g: Mapping[str, Any], where: str, k: str) -> float | None:
    v = ((g.get("nvml") or {}).get(where) or {}).get(k)
    return float(v) if isinstance(v, (int, float)) else None


def _attest_clock(g: Mapping[str, Any]) -> float | None:
    v = ((g.get("attest") or {}).get("sm_clock_mhz") or [None])[0]
    return float(v) if isinstance(v, (int, float)) else None


NVML_FIGURES: tuple[tuple[str, str, str], ...] = (
    # (key in the summary, where, figure of the bench's sample)
    ("sm_mhz_at_grant", "entry", "sm_mhz"),
    ("sm_mhz_min_inside", "inside", "sm_min"),
    ("power_w_at_grant", "entry", "power_w"),
    ("power_w_max_inside", "inside", "power_max_w"),
    ("temp_c_at_grant", "entry", "temp_c"),
    ("temp_c_max_inside", "inside", "temp_max_c"),
)


def nvml_stats(judged: Sequence[Judged]) -> dict[str, Any]:
    """NVML figures of the regions of inflated runs and of the others (p50 and the
    extreme: the lowest clock, the highest power and temperature)."""
    out: dict[str, Any] = {}
    for group, keep in (("inflated", True), ("not inflated", False)):
        regions = [g for j in judged if j.inflated is keep for g in j.regions]
        row: dict[str, Any] = {"regions": len(regions)}
        for key, where, fig in NVML_FIGURES:
            row[key] = pcts(v for g in regions if (v := _nv(g, where, fig)) is not None).to_json()
        row["krexd_sm_mhz_at_grant"] = pcts(
            v for g in regions if (v := _attest_clock(g)) is not None
        ).to_json()
        out[group] = row
    return out


# ----------------------------------------------------------------------------------- markdown

NVML_COLUMNS = (  # (figure, quantile) of summary.md's NVML table, in column order
    ("sm_mhz_at_grant", "p50"),
    ("sm_mhz_min_inside", "p50"),
    ("krexd_sm_mhz_at_grant", "p50"),
    ("power_w_at_grant", "p50"),
    ("power_w_max_inside", "p95"),
    ("temp_c_at_grant", "p50"),
    ("temp_c_max_inside", "max"),
)


def _ms(d: Mapping[str, Any] | None, k: str) -> str:
    v = (d or {}).get(k)
    return NA if v is None else f"{1e3 * float(v):.1f}"


def _pct(x: Any) -> str:
    return NA if not isinstance(x, (int, float)) or math.isnan(x) else f"{100 * x:.2f}%"


def _frac(x: Any) -> str:
    return NA if x is None else f"{100 * float(x):.0f}%"


def _val(d: Mapping[str, Any] | None, k: str, fmt: str = "{:.0f}") -> str:
    v = (d or {}).get(k)
    return NA if v is None else fmt.format(float(v))


def render_md(s: Mapping[str, Any]) -> list[str]:
    """The summary.md sections of the entry quantiles, the flags against native and NVML."""
    L: list[str] = []  # noqa: N806
    entry = s.get("entry") or {}
    if entry:
        L += [
            "## Region entry quantiles (krex cells, from the journal)",
            "",
            "Milliseconds over every region of the cell: krexd's protocol entry (`entry_s`: gate, "
            "stragglers, drain, freeze, pin, settle), queue wait before it, the two together (request to "
            "grant), and the drain and settle steps alone.",
            "",
            "| cell | regions | entry p50 | p95 | p99 | queue wait p95 | request to grant p50 | p95 | p99 | "
            "drain p95 | settle p95 |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k, e in entry.items():
            en, rq = e.get("entry_s"), e.get("request_to_grant_s")
            cols = [_ms(en, "p50"), _ms(en, "p95"), _ms(en, "p99"), _ms(e.get("queue_wait_s"), "p95")]
            cols += [_ms(rq, "p50"), _ms(rq, "p95"), _ms(rq, "p99")]
            cols += [_ms(e.get("drain_s"), "p95"), _ms(e.get("settle_s"), "p95")]
            L.append(f"| {k} | {e.get('regions', 0)} | " + " | ".join(cols) + " |")
        L.append("")
    flags = s.get("flags") or {}
    if flags:
        thr = s.get("flag_thresholds") or {}
        src = s.get("flag_threshold_source") or NA
        L += [
            "## Flags against native: precision and recall",
            "",
            "A krex run is *inflated* when its ms exceeds the same command's native-serial median by more "
            f"than the native noise ({src}): "
            + ", ".join(f"{b} {_pct(v)}" for b, v in thr.items())
            + ". Precision = flagged and inflated / flagged; recall = flagged and inflated / inflated. "
            "Runs of a band without a noise figure are not judged.",
            "",
            "| cell | runs judged | inflated | reason | flagged | flagged and inflated | precision | "
            "recall |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k, f in flags.items():
            for reason, sc in (f.get("by_reason") or {}).items():
                L.append(
                    f"| {k} | {f.get('judged', 0)} | {f.get('inflated', 0)} | {reason} | {sc['flagged']} | "
                    f"{sc['flagged_and_inflated']} | {_frac(sc['precision'])} | {_frac(sc['recall'])} |"
                )
        L.append("")
    nv = s.get("nvml") or {}
    if nv:
        L += [
            "## GPU clock, power and temperature of the regions (NVML)",
            "",
            "The bench's own NVML samples at the grant and inside each region (p50; min clock, max power and "
            "temperature), and krexd's SM clock at the grant (its attestation). n/a: not sampled (the "
            "simulated GPU has no NVML).",
            "",
            "| cell | runs that were | regions | SM MHz at grant p50 | min inside p50 | "
            "krexd SM MHz at grant p50 | power W at grant p50 | max inside p95 | temp C at grant p50 | "
            "max inside max |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for k, groups in nv.items():
            for group, row in groups.items():
                cols = [_val(row.get(key), q) for key, q in NVML_COLUMNS]
                L.append(f"| {k} | {group} | {row.get('regions', 0)} | " + " | ".join(cols) + " |")
        L.append("")
    return L
