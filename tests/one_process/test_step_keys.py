"""The keys of in-graph optimizer step nodes (Note [Steps in the compiled backward]): a node steps through its
DDP while that DDP lives, and a freed DDP's keys are dropped, its nodes stepping nothing."""

from __future__ import annotations

import gc

import torch

from graphddp.runtime import in_graph_steps


class Target:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], int]] = []

    def step_bucket(self, names, grads) -> None:
        self.calls.append((tuple(names), len(grads)))


def test_a_node_steps_through_its_target_until_the_target_is_freed() -> None:
    target, other = Target(), Target()
    key = in_graph_steps.bucket_key(target, ["a.weight", "a.bias"])
    zero = torch.ops.graphddp.step_bucket(key, [torch.ones(3), torch.ones(2)])
    assert target.calls == [(("a.weight", "a.bias"), 2)]
    assert zero.shape == (1,) and zero.dtype == torch.float32 and zero.item() == 0.0
    del target
    gc.collect()
    in_graph_steps.bucket_key(other, ["b.weight"])  # making a key drops the freed target's
    assert key not in in_graph_steps._buckets
    assert torch.ops.graphddp.step_bucket(key, [torch.ones(3)]).item() == 0.0 and other.calls == []
