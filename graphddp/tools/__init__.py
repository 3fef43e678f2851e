"""Tools: the ``graphddp`` command line (demo, inspect), rank launching helpers and the workloads they run. The top
layer: nothing in the library imports it (docs/architecture.md).
"""
