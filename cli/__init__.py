"""The `krex` command line: a thin click layer over the krex library."""
