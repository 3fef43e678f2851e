"""Pure FX graph passes and the bucket plan, shipped as ``graphddp.passes``.

Nothing here imports ``torch.distributed`` or a graphddp runtime module: the dependency points one way, from
``graphddp`` to ``graphddp.passes``. Everything is testable on a graph, without processes.
"""

from .plan import Bucket, BucketPlan, MiB, ParamSpec, caps_from_mb, first_difference, plan_buckets

__all__ = ["Bucket", "BucketPlan", "MiB", "ParamSpec", "caps_from_mb", "first_difference", "plan_buckets"]
