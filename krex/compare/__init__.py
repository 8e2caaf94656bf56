"""`krex compare`: is B faster than A, with a stated confidence (docs/compare.md).

* ``stats``: Hodges-Lehmann ratios with Mann-Whitney intervals, P(order wrong), the
  sequential plan (pure functions);
* ``design``: the run order (randomized palindromic blocks);
* ``extract``: reading a run's figure (JSON key path, regular expression, presets);
* ``run``: the comparison loop over a krex.Executor;
* ``pyperf_export``: the runs as pyperf JSON."""

from krex.compare.extract import FigureNotFound, FigureSource, parse_figure
from krex.compare.run import Comparison, Ratio, RunFigure, compare

__all__ = ["Comparison", "FigureNotFound", "FigureSource", "Ratio", "RunFigure", "compare", "parse_figure"]
