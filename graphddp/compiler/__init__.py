"""The compile layer: what ``torch.compile`` meets — the backend, the Dynamo hook that routes any backend to it,
the graph pipeline that cuts a captured graph by the plan, gradient taps, graph capture and the debug dump.
Imports ``graphddp.runtime`` and ``graphddp.passes``, never the DDP module above it (docs/architecture.md).
"""
