"""KREX: region-granular GPU exclusivity for concurrent kernel benchmarking.

import krex
with krex.region():
    ...timed loop...
"""

import logging

from krex.proc.region import RegionWarning, region, under_krex

# The library logs to the `krex` logger and never prints; applications (the CLI,
# krexd) attach handlers. Without one, nothing is shown.
logging.getLogger("krex").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["RegionWarning", "region", "under_krex", "__version__"]
