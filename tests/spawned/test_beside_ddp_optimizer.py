"""graphddp's compile path beside PyTorch's DDPOptimizer on the same scenarios: 2 gloo ranks, the user's backend a
counting function around aot_eager, ``torch.compile`` as users write it. For each implementation the test
records whether training runs (and then matches PyTorch's eager DDP after 3 steps) and how many pieces the inner
compiler was handed. The table in docs/compile.md ("Scenarios beside DDPOptimizer") is ``EXPECTED`` below.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

import graphddp

WIDTH = 512  # a [512, 512] float32 weight is 1 MiB: with 1 MiB buckets, one bucket per layer


class Wide(nn.Module):
    """Four square layers and a head; ``kind`` picks what the forward does around them."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        if self.kind == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self._layers(x)
            return self.head(h.float())
        if self.kind == "item":
            return self.head(self._layers(x)) * codes[0].item()
        if self.kind == "nonzero":
            rows = torch.nonzero(codes > 0).squeeze(1)
            return self.head(self._layers(x.index_select(0, rows))).sum(0) / (rows.shape[0] + 1)
        if self.kind == "checkpoint":
            from torch.utils.checkpoint import checkpoint

            h = F.relu(self.layers[0](x))
            h = checkpoint(lambda t: F.relu(self.layers[2](F.relu(self.layers[1](t)))), h, use_reentrant=False)
            return self.head(F.relu(self.layers[3](h)))
        return self.head(self._layers(x))

    def _layers(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = F.relu(layer(h))
        return h


@dataclasses.dataclass(frozen=True)
class Scenario:
    kind: str = "plain"
    bucket_cap_mb: float = 1.0
    compile_kwargs: tuple[tuple[str, Any], ...] = ()
    dynamo_config: tuple[tuple[str, Any], ...] = ()
    compiled_autograd: bool = False


SCENARIOS = {
    "plain torch.compile, 1 MiB buckets": Scenario(),
    "0.25 MiB buckets": Scenario(bucket_cap_mb=0.25),
    "fullgraph=True": Scenario(compile_kwargs=(("fullgraph", True),)),
    "autocast inside forward": Scenario(kind="autocast"),
    "activation checkpointing": Scenario(kind="checkpoint"),
    ".item() (capture_scalar_outputs)": Scenario(kind="item", dynamo_config=(("capture_scalar_outputs", True),)),
    "nonzero() (dynamic output shapes)": Scenario(
        kind="nonzero", dynamo_config=(("capture_dynamic_output_shape_ops", True),)
    ),
    "compiled autograd": Scenario(compiled_autograd=True),
    "compiled autograd, optimize_ddp='python_reducer'": Scenario(
        compiled_autograd=True, dynamo_config=(("optimize_ddp", "python_reducer"),)
    ),
}

# (graphddp, DDPOptimizer): "trains, N pieces" or the start of the error. Measured on torch 2.13.0 (CPU, gloo).
EXPECTED = {
    "plain torch.compile, 1 MiB buckets": ("trains, 5 pieces", "trains, 4 pieces"),
    "0.25 MiB buckets": (
        "trains, 5 pieces",
        "AssertionError: First bucket should be smaller/equal to other buckets to get comms warmed up ASAP",
    ),
    "fullgraph=True": ("trains, 5 pieces", "Unsupported: Unsupported method call"),
    "autocast inside forward": ("trains, 5 pieces", "trains, 4 pieces"),
    "activation checkpointing": ("trains, 4 pieces", "trains, 3 pieces"),
    ".item() (capture_scalar_outputs)": ("trains, 5 pieces", "trains, 4 pieces"),
    "nonzero() (dynamic output shapes)": ("trains, 5 pieces", "trains, 4 pieces"),
    "compiled autograd": (
        "trains, 5 pieces",
        "RuntimeError: Compiled autograd is not compatible with C++ DDP Reducer, please use "
        'torch._dynamo.config.optimize_ddp="python_reducer".',
    ),
    "compiled autograd, optimize_ddp='python_reducer'": ("trains, 1 piece", "trains, 1 piece"),
}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank + 1)
    return torch.randn(8, WIDTH, generator=g), torch.randint(-3, 4, (8,), generator=g)


def train(impl: str, scenario: Scenario, rank: int, compile: bool) -> tuple[nn.Module, list[int]]:
    torch.manual_seed(0)
    module = Wide(scenario.kind)
    if impl == "graphddp":
        ddp = graphddp.DDP(module, bucket_cap_mb=scenario.bucket_cap_mb)
    else:
        ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=scenario.bucket_cap_mb)
    pieces: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        pieces.append(len(example_inputs))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    model = torch.compile(ddp, backend=counting_backend, **dict(scenario.compile_kwargs)) if compile else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(3):
        loss = model(*batch(step, rank)).square().mean()
        with _compiled_backward() if compile and scenario.compiled_autograd else contextlib.nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ddp, pieces


def _compiled_backward() -> Any:
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(torch.compile(backend="aot_eager"))


def measure(rank: int, world: int, name: str) -> dict[str, str]:
    scenario = SCENARIOS[name]
    reference, _ = train("torch", scenario, rank, compile=False)
    outcome = {}
    for impl in ("graphddp", "torch"):
        torch._dynamo.reset()
        try:
            with torch._dynamo.config.patch(**dict(scenario.dynamo_config)):
                ddp, pieces = train(impl, scenario, rank, compile=True)
            torch.testing.assert_close(ddp.module.state_dict(), reference.module.state_dict(), rtol=1e-4, atol=1e-5)
            outcome[impl] = f"trains, {len(pieces)} piece{'' if len(pieces) == 1 else 's'}"
        except Exception as e:  # the outcome is what is measured: keep the first line of the error
            outcome[impl] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return outcome


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_graphddp_beside_ddp_optimizer(name: str) -> None:
    results = run_on_ranks(measure, 2, name, timeout=600)
    got = (results[0]["graphddp"], results[0]["torch"])
    assert got == EXPECTED[name], got
