"""Capture the graphs Dynamo would hand a backend, in one process, without running any rank.

Used by ``graphddp inspect`` and by the pass tests: the passes see exactly what the compile backend sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx, nn


@dataclasses.dataclass
class Captured:
    """One graph Dynamo captured, with the example inputs it was captured for (real tensors)."""

    gm: fx.GraphModule
    example_inputs: list[Any]


def capture_graphs(model: nn.Module, *inputs: Any, dynamic: bool | None = None, **compile_kwargs: Any) -> list[Captured]:
    """Run ``model(*inputs)`` once under ``torch.compile`` and return every captured graph, uncompiled.

    The model runs for real (eagerly, graph by graph), so buffers such as BatchNorm statistics are updated once.
    """
    graphs: list[Captured] = []

    def record(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(Captured(gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()  # a fresh cache, so earlier compiles of the same code do not hide graphs
    torch.compile(model, backend=record, dynamic=dynamic, **compile_kwargs)(*inputs)
    return graphs


def as_fake(value: Any, fake_mode: Any, *, static_shapes: bool = True) -> Any:
    """``value`` as a fake tensor of ``fake_mode`` (real tensors only; fakes and non-tensors pass through)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
        return fake_mode.from_tensor(value, static_shapes=static_shapes)
    return value


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(param)`` to name, for the trainable parameters of ``model``."""
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad}
