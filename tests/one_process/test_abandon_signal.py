"""``AbandonSignal`` (Note [Abandoned backward]) in one process: the flag a rank sets, carried by the next in-graph
backward, counted, and raised on; the ranks' sum is simulated as the signal's gradient."""

from __future__ import annotations

import pytest
import torch

from graphddp.runtime.in_graph import AbandonSignal


def backward_of(signal: torch.Tensor, others: float = 0.0) -> None:
    """An in-graph backward that ran the graph carrying ``signal``: its gradient, the flags summed over the ranks
    (``others``: the other ranks' flags)."""
    signal.grad = signal.detach() + others


def test_a_second_abandoned_backward_in_a_row_is_carried_too() -> None:
    signal = AbandonSignal(torch.device("cpu"), rank=0, world_size=2)
    signal.tell()  # backward k-2 was abandoned here
    signal.begin_training_forward()  # forward k-1
    carried = signal.for_run()
    assert carried.item() == 1.0
    backward_of(carried)  # backward k-1 ran the graph carrying the flag, then was abandoned later, in eager code
    signal.tell()  # forward k: the watch saw it (the gate tells before the forward begins)
    signal.begin_training_forward()
    assert signal.for_run().item() == 1.0, "the second abandon must be carried by backward k"
    with pytest.raises(RuntimeError, match=r"1 of 2 ranks \(this rank among them\) abandoned a backward"):
        signal.begin_training_forward()  # forward k+1: the count of backward k-1 comes in


def test_a_flag_counted_once_is_not_carried_again() -> None:
    signal = AbandonSignal(torch.device("cpu"), rank=0, world_size=2)
    signal.tell()
    signal.begin_training_forward()
    backward_of(signal.for_run(), others=1.0)  # every rank abandoned the same backward: a skip they agreed on
    signal.begin_training_forward()
    assert signal.for_run().item() == 0.0  # carried once, counted: cleared
    backward_of(signal.tensor)
    signal.begin_training_forward()  # the count of 2 of 2: no error
