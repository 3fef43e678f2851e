"""The benchmark: compiled against eager DDP (graphddp's and PyTorch's), over loopback or an emulated link.

Run from the repository root: ``python -m bench --help``.
"""
