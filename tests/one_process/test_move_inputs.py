"""The inputs a DDP with ``device_ids`` moves to its device keep their containers' types, as PyTorch's DDP's
(``torch.distributed.utils._recursive_to``): namedtuples, ``PackedSequence``, dict subclasses."""

from __future__ import annotations

import collections

import torch
from torch.distributed.utils import _recursive_to
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from graphddp.ddp import _move_to

Batch = collections.namedtuple("Batch", "x y")


def test_containers_keep_their_types_as_pytorchs_ddp_keeps_them() -> None:
    cpu = torch.device("cpu")
    inputs = (
        Batch(torch.ones(2), [torch.zeros(1), 3]),
        pack_sequence([torch.ones(3, 2), torch.ones(2, 2)]),
        collections.OrderedDict(b=torch.ones(1), a=(torch.zeros(2),)),
        {"plain": torch.ones(1)},
        "text",
    )
    ours = _move_to(inputs, cpu)
    (theirs,) = _recursive_to(inputs, cpu, False)  # what PyTorch's DDP hands its module
    assert [type(v) for v in ours] == [type(v) for v in theirs] == [Batch, PackedSequence, collections.OrderedDict, dict, str]
    assert type(ours) is tuple and list(ours[2]) == ["b", "a"] and ours[0].y[1] == 3
    torch.testing.assert_close(ours[1].data, theirs[1].data)
