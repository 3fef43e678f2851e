"""graphddp.DDP against the real thing: PyTorch's DDP and single-process training on the concatenated batch.

Every case trains 6+ optimizer steps on spawned gloo ranks (world sizes 2 and 3) with SGD+momentum and Adam
and compares the final parameters (and buffers) with ``torch.testing.assert_close``.
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_on_ranks
from training import (
    RAMPED,
    SPARSE_AS_DENSE_BUCKETS,
    TINY_CAPS,
    Case,
    assert_same_on_all_ranks,
    refusing_sparse_all_reduce,
    state_of,
    train,
    train_single_process,
)


def tiny(**fields) -> Case:
    """A case with ~0.5-2 KiB buckets so the small models get several, graphddp's ramps included."""
    extra = fields.pop("ddp", ())
    return Case(ddp=TINY_CAPS + extra, graphddp=fields.pop("graphddp", RAMPED), **fields)


CASES = {
    "default": tiny(),
    "gradient_as_bucket_view": tiny(ddp=(("gradient_as_bucket_view", True),)),
    "find_unused": tiny(model="branchy", ddp=(("find_unused_parameters", True),)),
    # Bucket views where a rank leaves some gradients None: their buckets take the per-parameter path.
    "find_unused_bucket_view": tiny(model="branchy", ddp=(("find_unused_parameters", True), ("gradient_as_bucket_view", True))),
    "static_graph": tiny(ddp=(("static_graph", True),)),
    "static_graph_unused": tiny(model="branchy", ddp=(("static_graph", True),)),
    "no_sync": tiny(accumulate=3),
    "batchnorm": tiny(model="bn"),
    "mixed_dtypes": tiny(model="mixed"),
    "ready_order_differs": tiny(model="unordered"),
    "pytorch_layout": tiny(graphddp=(("first_bucket_cap_mb", 0.001), ("bucket_ramps", False))),
    # PyTorch's per-bucket caps, given to both (each closes a bucket once it holds its cap or more).
    "bucket_cap_mb_list": tiny(ddp=(("bucket_cap_mb_list", (0.001, 0.002, 0.004)),)),
    # Hooks (bf16_compress_hook refuses to run without NCCL, so it is checked on CUDA: tests/cuda_check.py).
    # PowerSGD compresses per bucket, so both implementations must cut the same buckets. PyTorch's DDP hangs
    # with PowerSGD and several buckets on gloo (tests/spawned/test_comm_hooks.py shows graphddp does not), so: one bucket.
    "hook_allreduce": tiny(hook="allreduce"),
    # On 3 ranks, fp16 sums of the same values in a different association (PyTorch cuts its buckets
    # differently, so gloo's ring visits them in another order) differ by fp16 rounding.
    "hook_fp16": tiny(hook="fp16", tolerance=(("rtol", 1e-3), ("atol", 1e-4))),
    "hook_powersgd": Case(hook="powersgd", steps=8),
    "join": tiny(extra_steps_per_rank=1),
    "join_divide_by_active": tiny(
        extra_steps_per_rank=2, join_kwargs=(("divide_by_initial_world_size", False),)
    ),
    "join_batchnorm": tiny(model="bn", extra_steps_per_rank=1),
    # Rank 1 never uses ``shared``; after rank 0 joins nobody does, yet PyTorch's joined rank reports its last
    # usage map, so ``shared`` gets zero gradients (not None) and momentum still moves it.
    "join_find_unused": tiny(model="branchy", ddp=(("find_unused_parameters", True),), extra_steps_per_rank=2),
    # The backward under compiled autograd: the hooks run eagerly and the Reducer finishes at the last launch.
    "compiled_autograd": tiny(compiled_autograd=True),
    # A DDP module copied right after construction trains like the original (no process group pickled).
    "deepcopy": tiny(copy="deepcopy"),
    "torch_save_load": tiny(copy="torch.save"),
}

# Cases whose result single-process training on the concatenated batch reproduces exactly.
SINGLE_PROCESS_EQUIVALENT = {"default", "bucket_cap_mb_list", "compiled_autograd", "deepcopy", "torch_save_load", "pytorch_layout", "gradient_as_bucket_view", "static_graph", "no_sync", "mixed_dtypes", "ready_order_differs"}


def check_parity(rank: int, world: int, case_name: str, optim: str) -> int:
    import contextlib
    import dataclasses

    # Nothing recorded, as a user runs it: the steady per-gradient hook from the second step, buckets counted in C
    # from the fourth (Note [Counting without a frame]); a recorder would keep every step on the per-gradient path.
    case = dataclasses.replace(CASES[case_name], optim=optim, record_events=False)
    sparse = case_name in SPARSE_CASES
    with refusing_sparse_all_reduce() if sparse else contextlib.nullcontext():  # graphddp's and the hooks' calls
        ours = train("graphddp", case, rank).ddp
        through_the_hook = SPARSE_AS_DENSE_BUCKETS[0]
        theirs = train("torch", case, rank).ddp
    # PyTorch's Reducer calls the backend from C++, which the refusal cannot see: its sparse buckets went through
    # the hook instead (one sparse table a step, at least).
    assert not sparse or SPARSE_AS_DENSE_BUCKETS[0] - through_the_hook >= case.steps, (rank, SPARSE_AS_DENSE_BUCKETS)
    torch.testing.assert_close(state_of(ours.module), state_of(theirs.module), **dict(case.tolerance))
    # Parameters agree across ranks; buffers need not (each rank's last forward updated its own BN stats).
    assert_same_on_all_ranks({n: p.detach() for n, p in ours.module.named_parameters()})
    if case_name in SINGLE_PROCESS_EQUIVALENT:
        local = train_single_process(case, world)
        torch.testing.assert_close(state_of(ours.module), state_of(local), rtol=1e-5, atol=1e-6)
    return len(ours.bucket_plan.buckets)


# torch.sparse gradients (nn.Embedding and nn.EmbeddingBag with sparse=True): each table alone in its bucket, reduced
# as a sparse tensor. SGD only: Adam refuses sparse gradients (PyTorch's SparseAdam is for them). Nothing calls
# gloo's sparse all-reduce, which corrupts a rank's heap now and then (docs/reliability.md): graphddp gathers
# (Note [Sparse gradients, gathered]), PyTorch's DDP and the hook case average the table dense
# (``sparse_as_dense_allreduce_hook``), and ``check_parity`` checks both.
SPARSE_CASES = {
    "sparse": tiny(model="sparse_bags"),
    "sparse_bucket_view": tiny(model="sparse_bags", ddp=(("gradient_as_bucket_view", True),)),
    "sparse_hook": tiny(model="sparse_bags", hook="sparse_as_dense"),  # a user's hook gets the sparse tensor
    "sparse_no_sync": tiny(model="sparse_bags", accumulate=2),
    "sparse_join": tiny(model="sparse_bags", extra_steps_per_rank=1),
}
CASES.update(SPARSE_CASES)
SINGLE_PROCESS_EQUIVALENT |= {"sparse", "sparse_bucket_view", "sparse_no_sync"}


@pytest.mark.parametrize(("case_name", "world"), [("sparse", 3)] + [(name, 2) for name in sorted(SPARSE_CASES)])
def test_sparse_gradients_parity_with_torch_ddp(case_name: str, world: int) -> None:
    buckets = run_on_ranks(check_parity, world, case_name, "sgd")
    assert len(set(buckets)) == 1, f"ranks built different numbers of buckets: {buckets}"


THREE_RANKS_QUICK = ("default", "find_unused", "static_graph", "no_sync", "batchnorm", "join", "hook_fp16")
"""Cases the default suite also runs on 3 ranks (with SGD); every case runs on 3 ranks with both optimizers in the
slow suite. The default suite keeps every case on 2 ranks with both and stays under 10 minutes on 2 cores."""


def _parity_params() -> list:
    params = []
    for name in sorted(set(CASES) - set(SPARSE_CASES)):
        for optim, world in (("sgd", 2), ("adam", 2), ("sgd", 3), ("adam", 3)):
            slow = world == 3 and (optim == "adam" or name not in THREE_RANKS_QUICK)
            params.append(pytest.param(name, optim, world, marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize(("case_name", "optim", "world"), _parity_params())
def test_parity_with_torch_ddp(case_name: str, optim: str, world: int) -> None:
    buckets = run_on_ranks(check_parity, world, case_name, optim)
    assert len(set(buckets)) == 1, f"ranks built different numbers of buckets: {buckets}"
    if CASES[case_name].ddp:
        assert buckets[0] > 1, "the tiny caps must give several buckets, or the case tests nothing about bucketing"


# -- compiled, with graphs that reduce in-graph where they can (Note [In-graph reduction]) ------------------------
IN_GRAPH_CASES = ("default", "static_graph", "no_sync", "batchnorm", "hook_allreduce", "hook_fp16", "join", "find_unused")
"""Features on the compiled path with nothing recorded: in-graph where the graph allows (default, static_graph,
batchnorm, the built-in hooks), the split where it must (no_sync's synchronising steps, join, find_unused)."""


def check_compiled_parity(rank: int, world: int, case_name: str) -> tuple[int, list[str]]:
    import dataclasses

    case = dataclasses.replace(CASES[case_name], compile="torch.compile", record_events=False)
    ours = train("graphddp", case, rank).ddp
    theirs = train("torch", case.eager(), rank).ddp
    torch.testing.assert_close(state_of(ours.module), state_of(theirs.module), **dict(case.tolerance))
    assert_same_on_all_ranks({n: p.detach() for n, p in ours.module.named_parameters()})
    target = ours.reducer.compile_target
    return target.gate.in_graph_forwards, sorted({r.strategy for r in target.reductions})


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case_name", IN_GRAPH_CASES)
def test_compiled_parity_with_torch_ddp_in_graph_where_it_can(case_name: str, world: int) -> None:
    for in_graph_runs, strategies in run_on_ranks(check_compiled_parity, world, case_name):
        if case_name in ("no_sync", "join", "find_unused"):
            assert in_graph_runs == 0, (case_name, in_graph_runs, strategies)  # every sync step needs the Reducer
        else:
            assert strategies == ["in_graph"] and in_graph_runs >= CASES[case_name].steps - 2, (in_graph_runs, strategies)
