"""pytest-benchmark plugin (placeholder replaced below in this branch)."""
