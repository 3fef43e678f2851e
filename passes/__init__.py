"""Pure FX graph passes and the bucket plan, shipped as ``graphddp.passes``.

Nothing here imports ``torch.distributed`` or a graphddp runtime module: the dependency points one way, from
``graphddp`` to ``graphddp.passes``. Everything is testable on a graph, without processes.
"""

from .caps_choice import (
    CapsChoice,
    CapsSearch,
    choose_caps,
    choose_graph_caps,
    estimated_step_inputs,
    step_inputs_from_completions,
    step_inputs_from_ready_times,
    step_inputs_from_split,
)
from .cost import (
    ALGORITHMS,
    LinkModel,
    Prediction,
    StepInputs,
    allreduce_seconds,
    fit_link,
    predict_step,
    project_scaling,
    rate_bits_per_second,
)
from .graph_cost import ComputeRates, forward_seconds, segment_backward_seconds
from .graph_params import GraphParam, GraphUse, find_graph_params, ready_groups
from .plan import (
    Bucket,
    BucketCaps,
    BucketPlan,
    MiB,
    ParamSpec,
    bucket_channel,
    compose_plans,
    first_difference_across,
    plan_bucket_groups,
    plan_buckets,
)
from .plan_graph import plan_graph
from .reduction import (
    REDUCTIONS,
    ReductionChoice,
    check_reduction,
    choose_reduction,
    launch_collectives_early,
    plan_blockers,
    schedule_reductions,
    sink_waits,
)
from .row_sparse import (
    ROW_SPARSE_MAX_DENSITY,
    RowSparseParam,
    embedding_tables,
    misplaced_parts,
    row_sparse_params,
    rows_apply,
    sparse_gradient_params,
)
from .split import GraphSplit, Segment, Tap, assign_segments, split_at_buckets, tensor_bytes
from .taps import place_taps, tap_parts

__all__ = [
    "ALGORITHMS",
    "REDUCTIONS",
    "ROW_SPARSE_MAX_DENSITY",
    "ReductionChoice",
    "Bucket",
    "CapsChoice",
    "CapsSearch",
    "ComputeRates",
    "BucketCaps",
    "BucketPlan",
    "bucket_channel",
    "GraphParam",
    "GraphSplit",
    "GraphUse",
    "LinkModel",
    "Prediction",
    "StepInputs",
    "MiB",
    "ParamSpec",
    "RowSparseParam",
    "Segment",
    "Tap",
    "allreduce_seconds",
    "assign_segments",
    "check_reduction",
    "choose_caps",
    "choose_graph_caps",
    "choose_reduction",
    "compose_plans",
    "embedding_tables",
    "estimated_step_inputs",
    "find_graph_params",
    "fit_link",
    "forward_seconds",
    "launch_collectives_early",
    "first_difference_across",
    "misplaced_parts",
    "place_taps",
    "plan_blockers",
    "plan_bucket_groups",
    "plan_buckets",
    "plan_graph",
    "predict_step",
    "project_scaling",
    "rate_bits_per_second",
    "ready_groups",
    "row_sparse_params",
    "rows_apply",
    "segment_backward_seconds",
    "schedule_reductions",
    "sink_waits",
    "sparse_gradient_params",
    "split_at_buckets",
    "step_inputs_from_completions",
    "step_inputs_from_ready_times",
    "step_inputs_from_split",
    "tap_parts",
    "tensor_bytes",
]
