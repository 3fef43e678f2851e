"""``backward(create_graph=True)`` on spawned gloo ranks: the gradients are reduced as data."""

from __future__ import annotations

import torch
from ranks import run_on_ranks
from training import Case, state_of, train


def create_graph_against_one_process(rank: int, world: int) -> None:
    from training import assert_same_on_all_ranks, train_single_process

    case = Case(create_graph=True, ddp=(("bucket_cap_mb", 0.002),), graphddp=(("first_bucket_cap_mb", 0.001),))
    ours = train("graphddp", case, rank).ddp
    torch.testing.assert_close(state_of(ours.module), state_of(train_single_process(case, world)), rtol=1e-5, atol=1e-6)
    assert_same_on_all_ranks({n: p.detach() for n, p in ours.module.named_parameters()})


def test_backward_with_create_graph_reduces_the_gradients_as_data() -> None:
    # PyTorch's own DDP raises here on 2 gloo ranks ("a leaf Variable that requires grad is being used in an
    # in-place operation"), so the reference is single-process training on the concatenated batch.
    run_on_ranks(create_graph_against_one_process, 2, timeout=120)  # parity is asserted on every rank
