"""The ``kvtool`` command line: thin click wrappers over library calls."""
