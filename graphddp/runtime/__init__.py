"""The runtime layer: what runs every iteration, eager or compiled — the Reducer, its buckets and their
launch order, the reductions, the plans in force, gradient usage, communication, mixed precision, optimizer
overlap, calibration and automatic caps. Imports ``graphddp.passes`` and nothing above it (docs/architecture.md).
"""
