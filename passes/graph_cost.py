"""Estimate the compute time of a captured graph's nodes from their shapes, before anything has run.

The step cost model (Note [Step cost model] in ``passes/cost.py``) needs each backward segment's time. Once a
run has iterated, the segments' times are measured; before that (choosing bucket caps while Dynamo compiles,
``graphddp inspect``) they are estimated here: a node costs its floating-point work at the device's matmul rate
plus the bytes it reads and writes at the device's memory rate (a roofline without the max: on CPUs, where the
small kernels of a training step are rarely at either roof, the sum tracks measured times better). A node's
backward costs about twice its forward (a matmul's backward is two matmuls of the same size; an elementwise
op's reads the saved input and the incoming gradient and writes one gradient). The estimate only has to rank
bucket layouts correctly, which depends on where in backward the time goes more than on its total.

Shapes come from Dynamo's ``example_value`` (or AOT's ``val``) metadata; symbolic sizes count at their hint.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import fx

BACKWARD_PER_FORWARD = 2.0
"""A node's backward time as a multiple of its forward time (see the module docstring)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeRates:
    """How fast one rank computes: the two rates of the estimate."""

    flops_per_s: float
    """Floating-point operations per second of a large matmul."""
    bytes_per_s: float
    """Bytes per second an elementwise op reads and writes."""
    python_call_s: float = 0.0
    """Seconds of one Python function call: graphddp's per-bucket work is counted in calls
    (``graphddp.passes.cost.REDUCER_CALLS_PER_BUCKET``); 0: not measured."""
    launch_s: float = 0.0
    """Seconds the thread that issues one collective spends in the call while its process group is idle (gloo
    wakes a worker; NCCL enqueues a kernel), as ``graphddp.runtime.calibration.launch_seconds`` measures it on the
    ranks; 0: not measured (one rank; ``graphddp inspect``, which has no group, takes it as ``--launch-us``)."""

    def __post_init__(self) -> None:
        if not (self.flops_per_s > 0 and self.bytes_per_s > 0) or self.python_call_s < 0 or self.launch_s < 0:
            raise ValueError(f"compute rates must be > 0 (a call's and a launch's seconds >= 0), got {self}")

    @property
    def reducer_seconds_per_bucket(self) -> float:
        """What one bucket costs the thread that runs the backward at these rates: the Reducer's Python and the
        collective's launch (Note [Step cost model])."""
        from .cost import REDUCER_CALLS_PER_BUCKET

        return REDUCER_CALLS_PER_BUCKET * self.python_call_s + self.launch_s


_MATMULS = {torch.matmul, torch.mm, torch.bmm, operator.matmul, F.linear, torch._C._nn.linear, torch.addmm, torch.baddbmm}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
_CONVS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}


def forward_seconds(gm: fx.GraphModule, rates: ComputeRates) -> dict[str, float]:
    """Estimated forward seconds of every computing node of ``gm``, by node name."""
    seconds = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            seconds[node.name] = flops(node) / rates.flops_per_s + moved_bytes(node) / rates.bytes_per_s
    return seconds


def flops(node: fx.Node) -> float:
    """Floating-point operations of a matmul, linear, convolution or attention node; 0 for anything else."""
    out = _value(node)
    if not isinstance(out, torch.Tensor):
        return 0.0
    args = [_value(a) if isinstance(a, fx.Node) else a for a in node.args]
    if node.op == "call_module":  # a module left whole (symbolic_trace): its weight says what it computes
        module = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
        if isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            return 2.0 * _numel(out) * math.prod(_int(s) for s in module.weight.shape[1:])
        return 0.0
    if node.target in _MATMULS or (node.op == "call_method" and node.target in _MATMUL_METHODS):
        # (..., M, K) @ (K, N) -> (..., M, N): 2 M N K per batch entry; linear's weight is (N, K).
        operands = [a for a in args if isinstance(a, torch.Tensor)]
        if node.target in (torch.addmm, torch.baddbmm):
            operands = operands[1:]
        if not operands or operands[0].dim() == 0:
            return 0.0
        return 2.0 * _numel(out) * _int(operands[0].shape[-1])
    if node.target in _CONVS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        weight = args[1]  # (out_channels, in_channels / groups, *kernel)
        return 2.0 * _numel(out) * math.prod(_int(s) for s in weight.shape[1:])
    if node.target is F.scaled_dot_product_attention and len(args) >= 2:
        q, k = args[0], args[1]  # (..., L, E) and (..., S, E): two matmuls of 2 L S E each
        return 4.0 * _numel(q) * _int(k.shape[-2])
    return 0.0


def moved_bytes(node: fx.Node) -> float:
    """Bytes of the node's tensor inputs and outputs: what it reads and writes, at least once."""
    total = 0.0
    for value in [_value(a) for a in node.all_input_nodes] + [_value(node)]:
        for tensor in _tensors(value):
            total += _numel(tensor) * tensor.element_size()
    return total


def segment_backward_seconds(partition: Mapping[str, int], node_seconds: Mapping[str, float], segments: int) -> list[float]:
    """Estimated backward seconds of each segment (by segment index), from its nodes' forward estimates."""
    totals = [0.0] * segments
    for name, segment in partition.items():
        totals[segment] += BACKWARD_PER_FORWARD * node_seconds.get(name, 0.0)
    return totals


def _value(node: object) -> object:
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _numel(t: torch.Tensor) -> float:
    return float(math.prod(_int(s) for s in t.shape))


def _int(size: object) -> int:
    """A size, symbolic ones at their hint (1 when there is none)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1
