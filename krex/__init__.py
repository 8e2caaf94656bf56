"""KREX: region-granular GPU exclusivity for concurrent kernel benchmarking.

    import krex
    with krex.region():
        ...timed loop...
"""

from krex.region import region, under_krex

__version__ = "0.1.0"
__all__ = ["region", "under_krex", "__version__"]
