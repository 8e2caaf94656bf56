"""KREX: region-granular GPU exclusivity for concurrent kernel benchmarking."""

__version__ = "0.1.0"
