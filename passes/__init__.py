"""Pure FX graph passes and the bucket plan, shipped as ``graphddp.passes``.

Nothing here imports ``torch.distributed`` or a graphddp runtime module: the dependency points one way, from
``graphddp`` to ``graphddp.passes``. Everything is testable on a graph, without processes.
"""

from .graph_params import GraphParam, find_graph_params, ready_groups
from .plan import (
    Bucket,
    BucketCaps,
    BucketPlan,
    MiB,
    ParamSpec,
    compose_plans,
    first_difference_across,
    plan_bucket_groups,
    plan_buckets,
)
from .split import GraphSplit, Segment, assign_segments, split_at_buckets, tensor_bytes

__all__ = [
    "Bucket",
    "BucketCaps",
    "BucketPlan",
    "GraphParam",
    "GraphSplit",
    "MiB",
    "ParamSpec",
    "Segment",
    "assign_segments",
    "compose_plans",
    "find_graph_params",
    "first_difference_across",
    "plan_bucket_groups",
    "plan_buckets",
    "ready_groups",
    "split_at_buckets",
    "tensor_bytes",
]
