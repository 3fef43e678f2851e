"""Bad input and misuse, counted (docs/reliability.md is this catalogue as a table).

Each entry is a scenario run on two gloo ranks, first with graphddp and (slow marker) with PyTorch's DDP. For
graphddp it must either work with PyTorch's semantics or raise a clear error on *every* rank within the process
group's timeout; ``graphddp`` says which (``works``, or the error's type and words). ``torch`` records what
PyTorch's DDP does on the same scenario, checked by the slow test: ``works``, ``raises <Type>`` (every rank),
``fails`` (some rank raises, crashes or times out; the others do not finish cleanly), or ``silent: the replicas
differ`` (a scenario that returns its wrapper has its parameters compared across ranks afterwards).

Scenarios in which every rank does the same run one after the other in one set of pooled ranks (a barrier after
each keeps the group in step). Scenarios in which one rank does something else (``asymmetric``) leave collectives
unmatched, so each runs on fresh ranks whose process group has a short timeout (``ranks.run_with_faults``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, Branchy, WithBatchNorm
from ranks import run_on_ranks, run_with_faults
from torch import nn

import graphddp

TIMEOUT_S = 3.0
"""The process group timeout of the asymmetric scenarios (what a user passes to ``init_process_group``)."""


def DDP(impl: str, module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    cls = graphddp.DDP if impl == "graphddp" else nn.parallel.DistributedDataParallel
    return cls(module, *args, **kwargs)


def data(rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(rows, 12, generator=g), torch.randn(rows, 6, generator=g)  # [B, IN], [B, OUT]


def step(ddp: nn.Module, rank: int, rows: int = 8) -> None:
    x, y = data(rank, rows)
    F.mse_loss(ddp(x), y).backward()


# -- models that differ across ranks ---------------------------------------------------------------------------
def model_variant(rank: int, variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = MLP()
    if rank != 1:
        return model
    if variant == "shape":
        model.fc2, model.fc3 = nn.Linear(32, 33), nn.Linear(33, 6)
    elif variant == "extra_parameter":
        model.extra = nn.Linear(4, 4)
    elif variant == "dtype":
        model.fc2.double()
    elif variant == "names":
        model.renamed = model.fc2
        del model.fc2
    elif variant == "order":
        fc1 = model.fc1
        del model.fc1
        model.fc1 = fc1  # registered last on rank 1
    elif variant == "requires_grad":
        model.fc1.weight.requires_grad_(False)
    elif variant == "extra_buffer":
        model.register_buffer("steps", torch.zeros(1))
    elif variant == "buffer_shape":
        model.register_buffer("stats", torch.zeros(3 if rank == 1 else 2))
    return model


def models_differ(rank: int, world: int, impl: str, variant: str) -> None:
    model = model_variant(rank, variant)
    if variant == "buffer_shape" and rank != 1:
        model.register_buffer("stats", torch.zeros(2))
    ddp = DDP(impl, model)
    step(ddp, rank)


def options_differ(rank: int, world: int, impl: str, option: str) -> None:
    torch.manual_seed(0)
    value = {"bucket_cap_mb": (25, 0.001), "find_unused_parameters": (False, True), "static_graph": (False, True)}[option]
    ddp = DDP(impl, MLP(), **{option: value[rank % 2]})
    for _ in range(2):
        step(ddp, rank)


def sparse_differs(rank: int, world: int, impl: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 4, sparse=rank == 1), nn.Flatten(), nn.Linear(8, 1))
    ddp = DDP(impl, model)
    ddp(torch.tensor([[1, 2]])).sum().backward()


# -- constructor arguments -------------------------------------------------------------------------------------
def construct(rank: int, world: int, impl: str, what: str) -> None:
    torch.manual_seed(0)
    arguments: dict[str, Callable[[], Any]] = {
        "not_a_module": lambda: DDP(impl, lambda x: x),
        "no_trainable_parameters": lambda: DDP(impl, nn.ReLU()),
        "frozen_model": lambda: DDP(impl, MLP().requires_grad_(False)),
        "wrapped_twice": lambda: DDP(impl, DDP(impl, MLP())),
        "device_ids_for_a_cpu_module": lambda: DDP(impl, MLP(), device_ids=[0]),
        "negative_bucket_cap": lambda: DDP(impl, MLP(), bucket_cap_mb=-1),
        "bucket_cap_not_a_number": lambda: DDP(impl, MLP(), bucket_cap_mb="big"),
        "find_unused_not_a_bool": lambda: DDP(impl, MLP(), find_unused_parameters="yes"),
        "static_graph_not_a_bool": lambda: DDP(impl, MLP(), static_graph="yes"),
        "process_group_and_device_mesh": lambda: DDP(impl, MLP(), process_group=dist.group.WORLD, device_mesh=object()),
        "sync_batchnorm_on_cpu": lambda: DDP(impl, nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))),
        "mixed_precision_not_a_config": lambda: DDP(impl, MLP(), mixed_precision=object()),
        "unknown_keyword": lambda: DDP(impl, MLP(), bucket_size=4),
        "check_reduction": lambda: DDP(impl, MLP(), check_reduction=True),
        "broadcast_buffers_false": lambda: DDP(impl, MLP(), broadcast_buffers=False),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = arguments[what]()
    step(ddp, rank)


# -- communication hooks -----------------------------------------------------------------------------------------
def allreduce(state, bucket):  # noqa: ANN001, ANN201 (unannotated: PyTorch rejects a bucket annotated Any too)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def bad_bucket_annotation(state: Any, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return allreduce(state, bucket)


def bad_return_annotation(state: Any, bucket: dist.GradBucket) -> int:
    return allreduce(state, bucket)


def three_arguments(state: Any, bucket: Any, extra: Any) -> Any:
    return allreduce(state, bucket)


# PyTorch finds the hook's bucket argument by its name: `bucket`.
HOOKS: dict[str, Callable[[int], Any]] = {
    "hook_returns_a_tensor": lambda rank: lambda state, bucket: bucket.buffer(),
    "hook_returns_the_wrong_shape": lambda rank: lambda state, bucket: allreduce(state, bucket).then(lambda f: f.value()[:-1]),
    "hook_resolves_to_a_string": lambda rank: lambda state, bucket: allreduce(state, bucket).then(lambda f: "done"),
    "hook_raises_on_every_rank": lambda rank: lambda state, bucket: 1 / 0,
    "hook_returns_another_dtype": lambda rank: lambda state, bucket: allreduce(state, bucket).then(lambda f: f.value().double()),
}


def hook_misuse(rank: int, world: int, impl: str, what: str) -> None:
    torch.manual_seed(0)
    ddp = DDP(impl, MLP(), bucket_cap_mb=0.002)
    if what == "hook_not_callable":
        ddp.register_comm_hook(None, 42)
    elif what == "hook_with_three_arguments":
        ddp.register_comm_hook(None, three_arguments)
    elif what == "hook_bucket_annotated_int":
        ddp.register_comm_hook(None, bad_bucket_annotation)
    elif what == "hook_return_annotated_int":
        ddp.register_comm_hook(None, bad_return_annotation)
    elif what == "hook_registered_twice":
        ddp.register_comm_hook(None, allreduce)
        ddp.register_comm_hook(None, allreduce)
    elif what == "builtin_hook_after_a_hook":
        ddp.register_comm_hook(None, allreduce)
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE) if impl == "torch" else ddp.register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif what == "hook_registered_after_training_started":
        step(ddp, rank)
        ddp.register_comm_hook(None, allreduce)
    else:
        ddp.register_comm_hook(None, HOOKS[what](rank))
    step(ddp, rank)


# -- training-time misuse, the same on every rank --------------------------------------------------------------------
class Outputs(nn.Module):
    """MLP whose forward returns its output in a container of the given kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp, self.kind = MLP(), kind

    def forward(self, x: torch.Tensor) -> Any:
        y = self.mlp(x)
        return {
            "tuple": lambda: (y, 1),
            "list": lambda: [y, None],
            "dict": lambda: {"out": y, "aux": "text"},
            "nested": lambda: {"a": [(y,)]},
            "namedtuple": lambda: Pair(y, y.detach()),
            "dataclass": lambda: Holder(y),
        }[self.kind]()


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


@dataclasses.dataclass
class Holder:
    out: torch.Tensor


def first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return first_tensor(next(iter(output.values())))
    if isinstance(output, Holder):
        return output.out
    return first_tensor(output[0])


def output_container(rank: int, world: int, impl: str, kind: str) -> None:
    ddp = DDP(impl, Outputs(kind), find_unused_parameters=True)
    for _ in range(2):
        x, y = data(rank)
        F.mse_loss(first_tensor(ddp(x)), y).backward()


def training_misuse(rank: int, world: int, impl: str, what: str) -> None:
    torch.manual_seed(0)
    model = Branchy() if "unused" in what else MLP()
    ddp = DDP(impl, model, find_unused_parameters=what == "unused_with_the_flag")
    x, y = data(rank)
    if what == "backward_twice_retain_graph":
        loss = F.mse_loss(ddp(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    elif what == "backward_twice_freed_graph":
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        loss.backward()
    elif what == "autograd_grad_instead_of_backward":
        torch.autograd.grad(F.mse_loss(ddp(x), y), list(ddp.parameters()))
        step(ddp, rank)
    elif what == "two_forwards_one_backward":
        ddp(x)
        F.mse_loss(ddp(x), y).backward()
        step(ddp, rank)
    elif what == "forward_without_backward":
        ddp(x)
        step(ddp, rank)
    elif what in ("unused_without_the_flag", "unused_with_the_flag"):
        for _ in range(2):
            F.mse_loss(ddp(x, use_shared=True), y).backward()  # Branchy's `dead` never gets a gradient
    elif what == "dtype_changed_after_wrapping":
        step(ddp, rank)
        ddp.module.double()
        x, y = x.double(), y.double()
        F.mse_loss(ddp(x), y).backward()
    elif what == "no_sync_nested":
        with ddp.no_sync(), ddp.no_sync():
            step(ddp, rank)
        step(ddp, rank)
    elif what == "zero_grad_keeps_tensors":
        for _ in range(2):
            step(ddp, rank)
            ddp.zero_grad(set_to_none=False)
    elif what == "batch_sizes_differ":
        step(ddp, rank, rows=3 + 5 * rank)
    elif what == "empty_batch_on_a_rank":
        x, y = data(rank, rows=0 if rank == 1 else 4)
        (ddp(x) - y).square().sum().backward()
    elif what == "eval_forward_under_no_grad":
        ddp.eval()
        with torch.no_grad():
            ddp(x)
        ddp.train()
        step(ddp, rank)
    elif what == "no_parameters_in_the_loss":
        ddp(x)
        (y.sum() * 0 + torch.zeros((), requires_grad=True)).backward()
        step(ddp, rank)
    else:
        raise ValueError(what)


# -- the module changed under the wrapper (issue 26): an error, or the replicas compared ---------------------------
def changed_under_the_wrapper(rank: int, world: int, impl: str, what: str) -> nn.Module:
    """Three SGD steps with a change after the first; the wrapper, whose replicas ``_attempt`` compares."""
    torch.manual_seed(0)
    if what == "meta_device_model":  # deferred initialisation, wrapped before materialising
        with torch.device("meta"):
            return DDP(impl, MLP())
    model = MLP()
    model.fc1.bias.requires_grad_(False)
    ddp = DDP(impl, model, bucket_cap_mb=0.002)
    for i in range(3):
        step(ddp, rank)
        torch.optim.SGD([p for p in ddp.module.parameters() if p.requires_grad], lr=0.1).step()  # the new ones too
        ddp.zero_grad()
        if i == 0 and what == "state_loaded_with_assign":
            ddp.module.load_state_dict({k: v.clone() for k, v in ddp.module.state_dict().items()}, assign=True)
        elif i == 0 and what == "layer_unfrozen_after_wrapping":
            ddp.module.fc1.bias.requires_grad_(True)
    return ddp


def replicas_agree(module: nn.Module) -> bool:
    """Every rank holds the same parameters (a collective)."""
    mine = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(other, everyone[0]) for other in everyone)


# -- one rank does something else ------------------------------------------------------------------------------
def asymmetric(rank: int, world: int, impl: str, what: str) -> None:
    torch.manual_seed(0)
    ddp = DDP(impl, MLP(), bucket_cap_mb=0.002)
    if what == "rank_raises_in_forward":
        if rank == 1:
            raise ValueError("bad batch on rank 1")
        step(ddp, rank)
    elif what == "rank_skips_a_backward":
        x, y = data(rank)
        loss = F.mse_loss(ddp(x), y)
        if rank == 0:
            loss.backward()
        step(ddp, rank)
        step(ddp, rank)
    elif what == "no_sync_on_one_rank":
        with ddp.no_sync() if rank == 1 else contextlib.nullcontext():
            step(ddp, rank)
        step(ddp, rank)
        step(ddp, rank)
    elif what == "uneven_inputs_without_join":
        for _ in range(2 + rank):
            step(ddp, rank)
        dist.barrier()
    elif what == "hook_raises_on_one_rank":
        ddp.register_comm_hook(None, lambda state, bucket: 1 / 0 if rank == 1 else allreduce(state, bucket))
        step(ddp, rank)
    elif what == "hook_wrong_shape_on_one_rank":
        ddp.register_comm_hook(
            None, lambda state, bucket: allreduce(state, bucket).then(lambda f: f.value()[: -1 if rank == 1 else None])
        )
        step(ddp, rank)
    elif what in ("backward_abandoned_on_one_rank", "backward_abandoned_before_any_gradient_on_one_rank"):
        # "catch out of memory, skip the batch": after buckets went out, or in backward's first op (nothing sent)

        def out_of_memory(*_: Any) -> None:
            raise torch.OutOfMemoryError("simulated: out of memory")

        handle = None
        if rank == 1 and what == "backward_abandoned_on_one_rank":
            handle = ddp.module.fc2.weight.register_post_accumulate_grad_hook(out_of_memory)
        elif rank == 1:
            handle = ddp.module.register_full_backward_pre_hook(out_of_memory)
        try:
            step(ddp, rank)
        except torch.OutOfMemoryError:
            assert handle is not None
            handle.remove()
        for _ in range(3):
            step(ddp, rank)
    elif what == "eval_forward_through_the_wrapper_on_one_rank":  # a log on rank 0 via ddp(x): buffers broadcast
        torch.manual_seed(0)
        ddp = DDP(impl, WithBatchNorm(), bucket_cap_mb=0.002)
        step(ddp, rank)
        step(ddp, rank)  # past the first iteration's bucket rebuild, as a periodic log would be
        if rank == 0:
            with torch.no_grad():
                ddp(data(rank)[0])
        for _ in range(3):
            step(ddp, rank)
    elif what == "dtype_changed_on_one_rank":
        if rank == 1:
            ddp.module.double()
        x, y = data(rank)
        F.mse_loss(ddp(x.to(next(ddp.parameters()).dtype)), y.to(next(ddp.parameters()).dtype)).backward()
    else:
        raise ValueError(what)


# -- the catalogue -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Misuse:
    scenario: Callable[..., Any]
    args: tuple[Any, ...]
    graphddp: str
    """``works``, or ``<ExceptionType>: <regex>`` every rank must raise."""
    asymmetric: bool = False


MISMATCH = "ModelMismatchError: the ranks wrapped different models"
CATALOGUE: dict[str, Misuse] = {
    **{
        f"models_differ_{v}": Misuse(models_differ, (v,), MISMATCH)
        for v in ("shape", "extra_parameter", "dtype", "names", "order", "requires_grad", "extra_buffer", "buffer_shape")
    },
    **{
        f"options_differ_{o}": Misuse(options_differ, (o,), MISMATCH + ".*option")
        for o in ("bucket_cap_mb", "find_unused_parameters", "static_graph")
    },
    "sparse_on_one_rank_only": Misuse(sparse_differs, (), MISMATCH),
    "meta_device_model": Misuse(changed_under_the_wrapper, ("meta_device_model",), "RuntimeError: .*on the meta device"),
    "state_loaded_with_assign": Misuse(changed_under_the_wrapper, ("state_loaded_with_assign",), "RuntimeError: .*was replaced by another tensor"),
    "layer_unfrozen_after_wrapping": Misuse(changed_under_the_wrapper, ("layer_unfrozen_after_wrapping",), "RuntimeError: .*was frozen when wrapped"),
    "not_a_module": Misuse(construct, ("not_a_module",), "TypeError: wraps an nn.Module"),
    "no_trainable_parameters": Misuse(construct, ("no_trainable_parameters",), "RuntimeError: no parameter that requires a gradient"),
    "frozen_model": Misuse(construct, ("frozen_model",), "RuntimeError: no parameter that requires a gradient"),
    "wrapped_twice": Misuse(construct, ("wrapped_twice",), "ValueError: already wrapped"),
    "device_ids_for_a_cpu_module": Misuse(construct, ("device_ids_for_a_cpu_module",), "ValueError: device_ids and output_device must be None"),
    "negative_bucket_cap": Misuse(construct, ("negative_bucket_cap",), "ValueError: .*bucket"),
    "bucket_cap_not_a_number": Misuse(construct, ("bucket_cap_not_a_number",), "TypeError: .*bucket"),
    "find_unused_not_a_bool": Misuse(construct, ("find_unused_not_a_bool",), "TypeError: find_unused_parameters must be True or False"),
    "static_graph_not_a_bool": Misuse(construct, ("static_graph_not_a_bool",), "TypeError: static_graph must be True or False"),
    "process_group_and_device_mesh": Misuse(construct, ("process_group_and_device_mesh",), "RuntimeError: Cannot specify both"),
    "sync_batchnorm_on_cpu": Misuse(construct, ("sync_batchnorm_on_cpu",), "ValueError: SyncBatchNorm layers only work with GPU modules"),
    "mixed_precision_not_a_config": Misuse(construct, ("mixed_precision_not_a_config",), "TypeError: mixed_precision must be"),
    "unknown_keyword": Misuse(construct, ("unknown_keyword",), "TypeError: .*unexpected keyword argument 'bucket_size'"),
    "check_reduction": Misuse(construct, ("check_reduction",), "works"),
    "broadcast_buffers_false": Misuse(construct, ("broadcast_buffers_false",), "works"),
    "hook_not_callable": Misuse(hook_misuse, ("hook_not_callable",), "TypeError: Communication hook must be callable"),
    "hook_with_three_arguments": Misuse(hook_misuse, ("hook_with_three_arguments",), "TypeError: a hook takes exactly two arguments"),
    "hook_bucket_annotated_int": Misuse(hook_misuse, ("hook_bucket_annotated_int",), "ValueError: bucket annotation should be dist.GradBucket"),
    "hook_return_annotated_int": Misuse(hook_misuse, ("hook_return_annotated_int",), "ValueError: return annotation should be"),
    "hook_registered_twice": Misuse(hook_misuse, ("hook_registered_twice",), "RuntimeError: can only be called once"),
    "builtin_hook_after_a_hook": Misuse(hook_misuse, ("builtin_hook_after_a_hook",), "RuntimeError: can only be called once"),
    "hook_registered_after_training_started": Misuse(hook_misuse, ("hook_registered_after_training_started",), "works"),
    "hook_returns_a_tensor": Misuse(hook_misuse, ("hook_returns_a_tensor",), "RuntimeError: must return a torch.futures.Future"),
    "hook_returns_the_wrong_shape": Misuse(hook_misuse, ("hook_returns_the_wrong_shape",), "ValueError: the communication hook returned a tensor of shape"),
    "hook_resolves_to_a_string": Misuse(hook_misuse, ("hook_resolves_to_a_string",), "TypeError: resolved to str"),
    "hook_raises_on_every_rank": Misuse(hook_misuse, ("hook_raises_on_every_rank",), "ZeroDivisionError"),
    "hook_returns_another_dtype": Misuse(hook_misuse, ("hook_returns_another_dtype",), "works"),
    **{f"output_{kind}": Misuse(output_container, (kind,), "works") for kind in ("tuple", "list", "dict", "nested", "namedtuple", "dataclass")},
    # The second backward accumulates locally, unsynchronised, as with PyTorch's DDP (its hooks are disarmed too).
    "backward_twice_retain_graph": Misuse(training_misuse, ("backward_twice_retain_graph",), "works"),
    "backward_twice_freed_graph": Misuse(training_misuse, ("backward_twice_freed_graph",), "RuntimeError: Trying to backward through the graph a second time"),
    "autograd_grad_instead_of_backward": Misuse(training_misuse, ("autograd_grad_instead_of_backward",), "works"),
    "two_forwards_one_backward": Misuse(training_misuse, ("two_forwards_one_backward",), "works"),
    "forward_without_backward": Misuse(training_misuse, ("forward_without_backward",), "works"),
    "unused_without_the_flag": Misuse(training_misuse, ("unused_without_the_flag",), "RuntimeError: Expected to have finished reduction in the prior iteration.*find_unused_parameters=True"),
    "unused_with_the_flag": Misuse(training_misuse, ("unused_with_the_flag",), "works"),
    "dtype_changed_after_wrapping": Misuse(training_misuse, ("dtype_changed_after_wrapping",), "RuntimeError: is now torch.float64"),
    "no_sync_nested": Misuse(training_misuse, ("no_sync_nested",), "works"),
    "zero_grad_keeps_tensors": Misuse(training_misuse, ("zero_grad_keeps_tensors",), "works"),
    "batch_sizes_differ": Misuse(training_misuse, ("batch_sizes_differ",), "works"),
    "empty_batch_on_a_rank": Misuse(training_misuse, ("empty_batch_on_a_rank",), "works"),
    "eval_forward_under_no_grad": Misuse(training_misuse, ("eval_forward_under_no_grad",), "works"),
    "no_parameters_in_the_loss": Misuse(training_misuse, ("no_parameters_in_the_loss",), "works"),
    **{
        what: Misuse(asymmetric, (what,), pattern, asymmetric=True)
        for what, pattern in [
            ("rank_raises_in_forward", "ValueError: bad batch on rank 1|RuntimeError: .*(Timed out|timed out|Connection|closed)"),
            ("rank_skips_a_backward", "RuntimeError: .*the ranks are out of step.*run it through ddp.module under torch.no_grad"),
            ("no_sync_on_one_rank", "RuntimeError: .*the ranks are out of step"),
            ("uneven_inputs_without_join", "RuntimeError"),
            ("hook_raises_on_one_rank", "ZeroDivisionError|RuntimeError"),
            ("hook_wrong_shape_on_one_rank", "ValueError: the communication hook returned|RuntimeError"),
            ("dtype_changed_on_one_rank", "RuntimeError"),
            ("backward_abandoned_on_one_rank", "RuntimeError: .*1 of 2 ranks.*abandoned the backward"),
            ("backward_abandoned_before_any_gradient_on_one_rank", "RuntimeError: .*1 of 2 ranks.*abandoned the backward"),
            ("eval_forward_through_the_wrapper_on_one_rank", "works"),
        ]
    },
}


# What PyTorch's DDP does on each scenario (2 gloo ranks, a 3 s timeout), as the slow test observes it.
TORCH: dict[str, str] = {
    'autograd_grad_instead_of_backward': 'works',
    'backward_twice_freed_graph': 'raises RuntimeError',
    'backward_twice_retain_graph': 'works',
    'backward_abandoned_on_one_rank': 'fails: some rank only sees a timeout or a lost peer',
    'backward_abandoned_before_any_gradient_on_one_rank': 'fails: one rank goes on, another times out or loses its peer',
    'eval_forward_through_the_wrapper_on_one_rank': 'works',
    'batch_sizes_differ': 'works',
    'layer_unfrozen_after_wrapping': 'silent: the replicas differ',
    'meta_device_model': 'raises RuntimeError',
    'state_loaded_with_assign': 'silent: the replicas differ',
    'broadcast_buffers_false': 'works',
    'bucket_cap_not_a_number': 'raises ValueError',
    'builtin_hook_after_a_hook': 'raises RuntimeError',
    'check_reduction': 'works',
    'device_ids_for_a_cpu_module': 'raises ValueError',
    'dtype_changed_after_wrapping': 'works',
    'dtype_changed_on_one_rank': 'fails: one rank goes on, another times out or loses its peer',
    'empty_batch_on_a_rank': 'works',
    'eval_forward_under_no_grad': 'works',
    'find_unused_not_a_bool': 'raises TypeError',
    'forward_without_backward': 'works',
    'frozen_model': 'raises RuntimeError',
    'hook_bucket_annotated_int': 'raises ValueError',
    'hook_not_callable': 'raises TypeError',
    'hook_raises_on_every_rank': 'raises ZeroDivisionError',
    'hook_raises_on_one_rank': 'fails: some rank only sees a timeout or a lost peer',
    'hook_registered_after_training_started': 'works',
    'hook_registered_twice': 'raises RuntimeError',
    'hook_resolves_to_a_string': 'raises RuntimeError',
    'hook_return_annotated_int': 'raises ValueError',
    'hook_returns_a_tensor': 'raises RuntimeError',
    'hook_returns_another_dtype': 'works',
    'hook_returns_the_wrong_shape': 'works',
    'hook_with_three_arguments': 'raises ValueError',
    'hook_wrong_shape_on_one_rank': 'works',
    'mixed_precision_not_a_config': 'raises AttributeError',
    'models_differ_buffer_shape': 'works',
    'models_differ_dtype': 'fails: a rank crashes or hangs',
    'models_differ_extra_buffer': 'fails: some rank only sees a timeout or a lost peer',
    'models_differ_extra_parameter': 'raises RuntimeError',
    'models_differ_names': 'fails: some rank only sees a timeout or a lost peer',
    'models_differ_order': 'fails: some rank only sees a timeout or a lost peer',
    'models_differ_requires_grad': 'raises RuntimeError',
    'models_differ_shape': 'fails: some rank only sees a timeout or a lost peer',
    'negative_bucket_cap': 'works',
    'no_parameters_in_the_loss': 'works',
    'no_sync_nested': 'works',
    'no_sync_on_one_rank': 'fails: one rank goes on, another times out or loses its peer',
    'no_trainable_parameters': 'raises RuntimeError',
    'not_a_module': 'raises AttributeError',
    'options_differ_bucket_cap_mb': 'works',
    'options_differ_find_unused_parameters': 'fails: some rank only sees a timeout or a lost peer',
    'options_differ_static_graph': 'fails: a rank crashes or hangs',
    'output_dataclass': 'works',
    'output_dict': 'works',
    'output_list': 'works',
    'output_namedtuple': 'works',
    'output_nested': 'works',
    'output_tuple': 'works',
    'process_group_and_device_mesh': 'raises RuntimeError',
    'rank_raises_in_forward': 'fails: some rank only sees a timeout or a lost peer',
    'rank_skips_a_backward': 'fails: one rank goes on, another times out or loses its peer',
    'sparse_on_one_rank_only': 'fails: a rank crashes or hangs',
    'static_graph_not_a_bool': 'raises TypeError',
    'sync_batchnorm_on_cpu': 'raises ValueError',
    'two_forwards_one_backward': 'works',
    'uneven_inputs_without_join': 'fails: some rank only sees a timeout or a lost peer',
    'unknown_keyword': 'raises TypeError',
    'unused_with_the_flag': 'works',
    'unused_without_the_flag': 'raises RuntimeError',
    'wrapped_twice': 'works',
    'zero_grad_keeps_tensors': 'works',
}


SILENT = "silent: the replicas differ"


def _attempt(rank: int, world: int, impl: str, name: str) -> str:
    """One scenario on this rank: ``works`` or ``<Type>: <message>``."""
    entry = CATALOGUE[name]
    try:
        result = entry.scenario(rank, world, impl, *entry.args)
        if isinstance(result, nn.Module) and not replicas_agree(result):
            return SILENT  # trained on, and the ranks hold different weights now
        return "works"
    except Exception as error:  # noqa: BLE001 (the outcome is what the catalogue records)
        return f"{type(error).__name__}: {error}"


def run_catalogue(rank: int, world: int, impl: str, names: list[str]) -> dict[str, str]:
    """The symmetric scenarios, one after the other."""
    outcomes = {}
    for name in names:
        outcomes[name] = _attempt(rank, world, impl, name)
        dist.barrier()  # every rank is past the scenario before the next one starts
    return outcomes


SYMMETRIC = sorted(n for n, e in CATALOGUE.items() if not e.asymmetric)
ASYMMETRIC = sorted(n for n, e in CATALOGUE.items() if e.asymmetric)


@pytest.fixture(scope="module")
def graphddp_outcomes() -> list[dict[str, str]]:
    return run_on_ranks(run_catalogue, 2, "graphddp", SYMMETRIC, timeout=300)


def test_the_catalogue_counts_at_least_fifty_kinds() -> None:
    assert len(CATALOGUE) >= 50, len(CATALOGUE)


def check(name: str, outcomes: dict[int, str]) -> None:
    expected = CATALOGUE[name].graphddp
    for rank in (0, 1):
        assert rank in outcomes, f"{name}: rank {rank} did not finish (a hang past the process group's timeout)"
        got = outcomes[rank]
        if expected == "works":
            assert got == "works", f"{name}, rank {rank}: {got}"
        else:
            kind, _, words = expected.partition(": ")
            assert re.match(rf"({kind}): .*{words}" if words else rf"({kind})", got, re.S), f"{name}, rank {rank}: {got}"


@pytest.mark.parametrize("name", SYMMETRIC)
def test_graphddp_on_misuse_every_rank_alike(name: str, graphddp_outcomes: list[dict[str, str]]) -> None:
    check(name, {rank: outcomes[name] for rank, outcomes in enumerate(graphddp_outcomes)})


@pytest.mark.parametrize("name", ASYMMETRIC)
def test_graphddp_on_misuse_by_one_rank_every_rank_raises_within_the_timeout(name: str) -> None:
    outcomes = run_with_faults(_attempt, 2, "graphddp", name, pg_timeout_s=TIMEOUT_S, timeout=60)
    check(name, {rank: value for rank, (ok, value) in outcomes.items() if ok})


TRANSPORT = re.compile(r"gloo/transport|Timed out|Connection (reset|closed)|timed out")


def torch_category(outcomes: dict[int, tuple[bool, Any]]) -> str:
    """``works``; ``raises <Type>`` (every rank, none by a transport error); or ``fails: ...`` saying how."""
    values = [outcomes.get(r, (False, None)) for r in (0, 1)]
    if all(ok and v == "works" for ok, v in values):
        return "works"
    if all(ok and v == SILENT for ok, v in values):
        return SILENT
    kinds = {v.split(":", 1)[0] for ok, v in values if ok and v != "works"}
    clean = all(ok and v != "works" and not TRANSPORT.search(v) for ok, v in values)
    if clean and len(kinds) == 1:
        return f"raises {kinds.pop()}"
    if any(not ok for ok, _ in values):
        return "fails: a rank crashes or hangs"
    if any(v == "works" for _, v in values):
        return "fails: one rank goes on, another times out or loses its peer"
    return "fails: some rank only sees a timeout or a lost peer"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_what_pytorchs_ddp_does_is_what_the_catalogue_records(name: str) -> None:
    outcomes = run_with_faults(_attempt, 2, "torch", name, pg_timeout_s=TIMEOUT_S, timeout=60)
    # How a failure shows (a timeout, a crash) depends on timing: compare the kind of outcome only.
    assert torch_category(outcomes).split(":")[0] == TORCH[name].split(":")[0], (name, outcomes)


def test_docs_reliability_lists_the_catalogue() -> None:
    """docs/reliability.md's table is this catalogue (``PYTHONPATH=tests python tests/spawned/test_misuse.py`` prints it)."""
    text = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()
    assert table() in text, "docs/reliability.md is out of date: paste the output of PYTHONPATH=tests python tests/spawned/test_misuse.py"


def table() -> str:
    rows = ["| misuse | graphddp | PyTorch's DDP |", "| --- | --- | --- |"]
    for name in sorted(CATALOGUE):
        entry = CATALOGUE[name]
        ours = entry.graphddp.replace("|", " or ").replace(".*", " ... ").replace("\\", "")
        where = " (one rank)" if entry.asymmetric else ""
        rows.append(f"| `{name}`{where} | {ours} | {TORCH[name]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
