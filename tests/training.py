"""Rank-side training loops for parity tests: the same model, data and optimizer under graphddp.DDP, PyTorch's
DDP, and single-process training on the concatenated batch.

Everything here runs inside spawned ranks (``tests/ranks.py``); data is generated from seeds so every rank
can build every other rank's batch without communication (needed for the single-process reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import graphddp

IN, OUT = 12, 6


# -- models ---------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Branchy(nn.Module):
    """``shared`` is used on some ranks only (``use_shared`` False on rank 1); ``dead`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, 32)
        self.shared = nn.Linear(32, 32)
        self.dead = nn.Linear(32, 32)
        self.head = nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor, use_shared: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        if use_shared:
            h = F.relu(self.shared(h))
        return self.head(h)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient is zero up to rounding, and Adam would amplify the rounding.
        self.fc1, self.bn, self.fc2 = nn.Linear(IN, 32, bias=False), nn.BatchNorm1d(32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class MixedDtypes(nn.Module):
    """A float64 layer followed by float32 layers: buckets must be split by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 32).double()
        self.fc2, self.fc3 = nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x.double())).float()
        return self.fc3(F.relu(self.fc2(h)))


class Unordered(nn.Module):
    """Registered a, b, c but run c, a, b: the reverse registration order is not the ready order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, OUT), nn.Linear(IN, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(F.relu(self.c(x)))))


MODELS = {"mlp": MLP, "branchy": Branchy, "bn": WithBatchNorm, "mixed": MixedDtypes, "unordered": Unordered}


def build_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


# -- cases ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "mlp"
    optim: str = "sgd"
    steps: int = 6
    batch: int = 8
    ddp: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments given to both graphddp.DDP and PyTorch's DDP."""
    hook: str | None = None
    """``allreduce``, ``fp16``, ``bf16`` or ``powersgd``."""
    accumulate: int = 1
    """Micro-batches per step; all but the last run under ``no_sync()``."""
    extra_batches_per_rank: int = 0
    """Rank r gets ``r * extra_batches_per_rank`` more steps, inside ``join()``."""
    join_kwargs: tuple[tuple[str, Any], ...] = ()
    graphddp: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments given to graphddp.DDP only (caps PyTorch's DDP has no argument for)."""
    tolerance: tuple[tuple[str, float], ...] = ()
    """``assert_close`` tolerances when the defaults are too tight for the case (fp16 sums, ...)."""

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        return dict(self.ddp)


def batch_for(case: Case, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank + 1)
    return torch.randn(case.batch, IN, generator=g), torch.randn(case.batch, OUT, generator=g)


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


def make_hook(name: str) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return None, default_hooks.allreduce_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
        )
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(name)


def forward_loss(model: nn.Module, case: Case, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
    out = model(x, use_shared=rank != 1) if case.model == "branchy" else model(x)
    return F.mse_loss(out, y)


# -- the three ways to train ------------------------------------------------------------------------------------
def wrap(impl: str, model: nn.Module, case: Case) -> nn.Module:
    kwargs = case.ddp_kwargs
    if impl == "graphddp":
        ddp = graphddp.DDP(model, **kwargs, **dict(case.graphddp))
    elif impl == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    else:
        raise ValueError(impl)
    if case.hook is not None:
        ddp.register_comm_hook(*make_hook(case.hook))
    return ddp


def train_ddp(impl: str, case: Case, rank: int, world: int) -> nn.Module:
    """Train ``case`` with a DDP implementation; return the wrapper (its module holds the result)."""
    ddp = wrap(impl, build_model(case.model), case)
    opt = make_optimizer(ddp.parameters(), case.optim)
    steps = case.steps + rank * case.extra_batches_per_rank
    join = ddp.join(**dict(case.join_kwargs)) if case.extra_batches_per_rank else contextlib.nullcontext()
    with join:
        for step in range(steps):
            for micro in range(case.accumulate):
                last = micro == case.accumulate - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    x, y = batch_for(case, step, micro, rank)
                    forward_loss(ddp, case, x, y, rank).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return ddp


def train_single_process(case: Case, world: int) -> nn.Module:
    """The reference: one process, each step on the concatenation of every rank's batch."""
    model = build_model(case.model)
    opt = make_optimizer(model.parameters(), case.optim)
    for step in range(case.steps):
        for micro in range(case.accumulate):
            batches = [batch_for(case, step, micro, r) for r in range(world)]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            forward_loss(model, case, x, y, rank=0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_on_all_ranks(state: dict[str, torch.Tensor]) -> None:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)


# -- models for the compile tests ---------------------------------------------------------------------------------
class InPlace(nn.Module):
    """In-place ops inside the captured graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x), inplace=True)
        h = self.fc2(h)
        h.mul_(0.5).add_(1.0)
        return self.fc3(F.relu_(h))


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` inside the model: a higher-order op in the captured graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = F.relu(self.fc1(x))
        h = checkpoint(lambda t: F.relu(self.fc2(t)), h, use_reentrant=False)
        return self.fc3(h)


class GraphBreaks(nn.Module):
    """Three captured graphs: one without parameters, two with."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0
        torch._dynamo.graph_break()
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        torch._dynamo.graph_break()
        return self.fc3(h)


MODELS.update({"inplace": InPlace, "checkpointed": Checkpointed, "graph_breaks": GraphBreaks})


class NoGradMiddle(nn.Module):
    """``fc2`` is first used inside ``torch.no_grad()``: a cut there would leave a compiled segment without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            scale = torch.sigmoid(self.fc2(h)) * 2
        return self.fc3(torch.relu(self.fc2(h)) * scale)


MODELS["no_grad_middle"] = NoGradMiddle


class Swapped(nn.Module):
    """Square layers whose order depends on the rank: same parameters, different graphs, different plans."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor, a_first: bool = True) -> torch.Tensor:
        return self.b(F.relu(self.a(x))) if a_first else self.a(F.relu(self.b(x)))


MODELS["swapped"] = Swapped
