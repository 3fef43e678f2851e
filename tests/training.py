"""One case type and one training loop for every test that trains: graphddp (eager or compiled), PyTorch's DDP,
and single-process training on the concatenated batch, on the same model, data and optimizer.

``train(impl, case, rank)`` runs inside a spawned rank (``tests/ranks.py``) or in one process (world size 1) and
returns a ``Run``: the DDP wrapper (``ddp.reducer.splits``: how compiled graphs were cut), and per step the events the Reducer recorded during the
synchronising backward, the module's state (``keep_states``) and extra gradients (``grad_first``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from models import VOCAB, build_model, compute_loss, default_batch, make_batch
from torch import nn

import graphddp
from graphddp.passes import sparse_gradient_params
from graphddp.runtime import countdown
from graphddp.runtime.trace import EventLog

IMPLS = ("graphddp", "torch")

TINY_CAPS = (("bucket_cap_mb", 0.002),)
"""``Case.ddp``: ~2 KiB buckets, so even the small test models get several."""
RAMPED = (("first_bucket_cap_mb", 0.001), ("last_bucket_cap_mb", 0.0005))
"""``Case.graphddp``: a 1 KiB first bucket and a 0.5 KiB last one, so with ``TINY_CAPS`` both of graphddp's ramps
(Note [Bucket ramps]) are cut."""
CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001}
"""``graphddp.DDP`` keyword arguments: ~2 KiB buckets after a 1 KiB first one, so the small test models get several
(the spawned feature tests that build a DDP themselves: bucket views, rebuild, static graph, join, no_sync)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """What to train and how; the same case trains under every implementation."""

    model: str = "mlp"
    """A model of ``tests/models.py``: a regression model, a token model, or ``w:<workload>[:<size>]``."""
    vocab: int = VOCAB
    """Token models: rows of the embedding table."""
    optim: str = "sgd"
    lr: float | None = None
    """None: 0.05 for SGD (momentum 0.9), 0.01 for Adam."""
    steps: int = 6
    batch: int | None = None
    """Per rank and step; None: the model's own (``models.default_batch``)."""
    batch_sizes: tuple[tuple[int, ...], ...] = ()
    """Rank r's batch size at each step (``batch_sizes[r][step]``), overriding ``batch``."""
    mark_dynamic: bool = False
    """Mark the batch dimension dynamic (``torch._dynamo.mark_dynamic``)."""
    ddp: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments given to both graphddp.DDP and PyTorch's DDP."""
    ignore: tuple[str, ...] = ()
    """Parameters and buffers kept local (``_set_params_and_buffers_to_ignore_for_model``); rank r's ignored
    parameters start at their initial value + 0.01 r, so they differ across ranks."""
    graphddp: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments given to graphddp.DDP only (caps PyTorch's DDP has no argument for, ...), later ones
    winning, over ``GRAPHDDP_DEFAULTS``."""
    hook: str | None = None
    """``allreduce``, ``fp16``, ``bf16``, ``powersgd`` or ``sparse_as_dense`` (``sparse_as_dense_allreduce_hook``),
    registered before step ``hook_at``."""
    hook_at: int = 0
    accumulate: int = 1
    """Micro-batches per step; all but the last run under ``no_sync()``."""
    extra_steps_per_rank: int = 0
    """Rank r trains ``r * extra_steps_per_rank`` more steps, inside ``join()``."""
    join_kwargs: tuple[tuple[str, Any], ...] = ()
    compile: str | None = None
    """graphddp only; None: eager. How the DDP module is compiled (``inner`` is the user's backend):
    ``torch.compile`` with ``graphddp.backend(inner)``; ``graphddp.compile``; ``plain``: ``torch.compile`` with the
    user's backend as it is (``inductor``: no backend argument at all); ``module.compile``: ``ddp.compile(...)``;
    ``named``: ``backend="graphddp", options={"inner": inner}``."""
    inner: str = "aot_eager"
    """A backend name, or ``callable`` for ``user_compiler`` (a function, as users write custom backends)."""
    compile_kwargs: tuple[tuple[str, Any], ...] = ()
    create_graph: bool = False
    """``loss.backward(create_graph=True)``."""
    copy: str | None = None
    """graphddp only: train a copy of the DDP module made right after construction: ``deepcopy`` or ``torch.save``
    (a ``torch.save``/``torch.load`` round trip)."""
    compiled_autograd: bool = False
    """graphddp only: every backward under compiled autograd (``torch._dynamo.compiled_autograd``, aot_eager);
    PyTorch's DDP, the reference, stays eager (its C++ Reducer refuses compiled autograd)."""
    dynamo_config: tuple[tuple[str, Any], ...] = ()
    """``torch._dynamo.config`` settings while training (``capture_scalar_outputs``, ...)."""
    eager_steps: int = 0
    """Compiled cases: the first steps call the DDP module eagerly (a warm-up), the rest the compiled one."""
    no_grad_forward: bool = False
    """After each step, one more forward under ``torch.no_grad()`` (an evaluation)."""
    grad_first: bool = False
    """Each step also asks ``torch.autograd.grad`` for the loss's gradient of ``wte.weight`` before backward."""
    tolerance: tuple[tuple[str, float], ...] = ()
    """``assert_close`` tolerances where the defaults are too tight for the case (fp16 sums, Inductor, ...)."""
    record_events: bool = True
    """graphddp: record the Reducer's events at each synchronising micro-batch (``Run.events``). Compiled graphs
    then keep the split path, where those events happen; False lets them reduce in-graph (Note [In-graph
    reduction])."""
    device: str = "cpu"
    """Where the model and batches live: ``cuda`` puts them on this rank's current GPU (``device_ids`` given to
    both DDPs), as the GPU tests (``tests/gpu``) train."""

    def eager(self) -> Case:
        return dataclasses.replace(self, compile=None, eager_steps=0)

    def with_graphddp(self, **kwargs: Any) -> Case:
        return dataclasses.replace(self, graphddp=self.graphddp + tuple(kwargs.items()))


GRAPHDDP_DEFAULTS = {"sparse_embedding_grads": True}
"""What every case gives graphddp.DDP unless it says otherwise: tables as rows wherever they apply, so every
feature is checked with them. ``"auto"``, the default, keeps these small tables dense over loopback
(Note [Row-sparse gradients], "When rows pay"); ``tests/spawned/test_rows_auto.py`` trains with it."""


@dataclasses.dataclass
class Run:
    ddp: nn.Module
    """The DDP wrapper (``.module`` holds the trained model); the model itself for single-process training."""
    events: list[list[tuple[str, int | None, str | None]]] = dataclasses.field(default_factory=list)
    """Per step: ``(kind, bucket, param)`` of the synchronising micro-batch, as graphddp's Reducer recorded them."""
    states: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)


def batch_for(case: Case, step: int, micro: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank + 1)
    size = case.batch_sizes[rank][step] if case.batch_sizes else case.batch or default_batch(case.model)
    batch = tuple(t.to(case.device) for t in make_batch(case.model, g, size, vocab=case.vocab))
    if case.mark_dynamic:
        torch._dynamo.mark_dynamic(batch[0], 0)
    return batch


def loss_for(model: nn.Module, case: Case, batch: tuple[torch.Tensor, ...], rank: int) -> torch.Tensor:
    return compute_loss(case.model, model, batch, rank)


def make_optimizer(params: Any, case: Case) -> torch.optim.Optimizer:
    if case.optim == "sgd":
        return torch.optim.SGD(params, lr=case.lr or 0.05, momentum=0.9)
    if case.optim == "adam":
        return torch.optim.Adam(params, lr=case.lr or 0.01)
    raise ValueError(case.optim)


def make_hook(name: str) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return None, default_hooks.allreduce_hook
    if name == "sparse_as_dense":
        return None, sparse_as_dense_allreduce_hook
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


SPARSE_AS_DENSE_BUCKETS = [0]
"""How many sparse buckets ``sparse_as_dense_allreduce_hook`` has averaged in this process (PyTorch's C++ Reducer
calls the backend without Python, so this count is how a test sees that its sparse buckets went through the hook)."""


def sparse_as_dense_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # PyTorch's DDP refuses string annotations
    """A comm hook that averages a ``torch.sparse`` gradient as a dense tensor and hands it back sparse (the
    dense buckets: PyTorch's ``allreduce_hook``). PyTorch's DDP, the parity tests' reference, runs it on models
    with sparse gradients, so that no test calls gloo's sparse all-reduce, which corrupts a rank's heap now and then
    (``docs/reliability.md``); graphddp never calls it (Note [Sparse gradients, gathered])."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    grad = bucket.buffer()
    if not grad.is_sparse:
        return default_hooks.allreduce_hook(state, bucket)
    SPARSE_AS_DENSE_BUCKETS[0] += 1
    dense = grad.to_dense().div_(dist.get_world_size())
    work = dist.all_reduce(dense, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to_sparse(grad.sparse_dim()))


@contextlib.contextmanager
def refusing_sparse_all_reduce() -> Iterator[None]:
    """Every ``ProcessGroup.allreduce`` of this process refuses a sparse tensor while inside; the binding is put
    back as it was after (the rank process is pooled)."""
    original = dist.ProcessGroup.__dict__["allreduce"]  # the binding itself, to restore
    call = dist.ProcessGroup.allreduce

    def allreduce(self, tensors, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(t.is_sparse for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors)):
            raise RuntimeError("test: the backend's sparse all-reduce was called")
        return call(self, tensors, *args, **kwargs)

    dist.ProcessGroup.allreduce = allreduce
    try:
        yield
    finally:
        dist.ProcessGroup.allreduce = original


def ddp_kwargs(case: Case) -> dict[str, Any]:
    """The keyword arguments both DDPs get: the case's own, and ``device_ids`` for a CUDA module."""
    kwargs = dict(case.ddp)
    if case.device.startswith("cuda"):
        kwargs.setdefault("device_ids", [torch.cuda.current_device()])
    return kwargs


def wrap(impl: str, case: Case, rank: int = 0) -> tuple[nn.Module, nn.Module]:
    """``(ddp, the model to call)`` for ``impl`` (``graphddp`` or ``torch``)."""
    module = build_model(case.model, vocab=case.vocab).to(case.device)
    if case.ignore:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(case.ignore))
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in case.ignore:
                    p.add_(0.01 * rank)
    if impl == "torch":
        ddp = nn.parallel.DistributedDataParallel(module, **ddp_kwargs(case))
        if sparse_gradient_params(module) and case.hook is None:  # the rule both DDPs apply
            ddp.register_comm_hook(*make_hook("sparse_as_dense"))  # not gloo's sparse all-reduce (see the hook)
        return ddp, ddp
    if impl != "graphddp":
        raise ValueError(impl)
    ddp = copied(graphddp.DDP(module, **ddp_kwargs(case), **{**GRAPHDDP_DEFAULTS, **dict(case.graphddp)}), case.copy)
    if case.compile is None:
        return ddp, ddp
    inner: Any = user_compiler if case.inner == "callable" else case.inner
    kwargs = dict(case.compile_kwargs)
    if case.compile == "graphddp.compile":
        return ddp, graphddp.compile(ddp, inner, **kwargs)
    if case.compile == "torch.compile":
        return ddp, torch.compile(ddp, backend=graphddp.backend(inner), **kwargs)
    if case.compile == "plain":
        return ddp, torch.compile(ddp, **kwargs) if inner == "inductor" else torch.compile(ddp, backend=inner, **kwargs)
    if case.compile == "module.compile":
        ddp.compile(backend=inner, **kwargs)
        return ddp, ddp
    if case.compile == "named":
        return ddp, torch.compile(ddp, backend="graphddp", options={"inner": inner}, **kwargs)
    raise ValueError(case.compile)


def copied(ddp: nn.Module, how: str | None) -> nn.Module:
    if how is None:
        return ddp
    if how == "deepcopy":
        return copy.deepcopy(ddp)
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(ddp, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    raise ValueError(how)


def user_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A custom backend as users write one: a function (here AOTAutograd with the eager compiler)."""
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def train(impl: str, case: Case, rank: int, *, keep_states: bool = False) -> Run:
    """Train ``case`` with ``impl`` (see ``wrap``) on this rank."""
    with torch._dynamo.config.patch(**dict(case.dynamo_config)):
        return _train(impl, case, rank, keep_states)


def _train(impl: str, case: Case, rank: int, keep_states: bool) -> Run:
    if case.compile is not None and impl == "graphddp":
        # Rank processes are pooled across tests: without a fresh cache, a code object earlier tests compiled up
        # to Dynamo's recompile limit runs eagerly here, and nothing is captured (seen: a compiled case planned
        # from ready order when it ran after test_parity and test_misuse). PyTorch's DDP, the reference, trains
        # eagerly and keeps the cache as it is (torch.cond compiles even in eager mode).
        torch._dynamo.reset()
    ddp, model = wrap(impl, case, rank)
    run = Run(ddp)
    opt = make_optimizer(model.parameters(), case)
    join = ddp.join(**dict(case.join_kwargs)) if case.extra_steps_per_rank else contextlib.nullcontext()
    with join:
        for step in range(case.steps + rank * case.extra_steps_per_rank):
            if case.hook is not None and step == case.hook_at:
                ddp.register_comm_hook(*make_hook(case.hook))
            call = ddp if step < case.eager_steps else model
            log = EventLog()
            for micro in range(case.accumulate):
                sync = micro == case.accumulate - 1
                if sync and impl == "graphddp" and case.record_events:
                    ddp.reducer.events = log
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = loss_for(call, case, batch_for(case, step, micro, rank), rank)
                    if case.grad_first:
                        table = dict(ddp.module.named_parameters())["wte.weight"]
                        run.grads.append(torch.autograd.grad(loss, [table], retain_graph=True)[0])  # this rank's own
                    with compiled_backward() if case.compiled_autograd and impl == "graphddp" else contextlib.nullcontext():
                        loss.backward(create_graph=case.create_graph)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if case.no_grad_forward:
                with torch.no_grad():
                    loss_for(model, case, batch_for(case, step, 9, rank), rank)
            run.events.append([(e.kind, e.bucket, e.param) for e in log.events])
            if keep_states:
                run.states.append(state_of(ddp.module))
    return run


def compiled_backward() -> Any:
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(torch.compile(backend="aot_eager"))


def train_single_process(case: Case, world: int, *, skip_steps: tuple[int, ...] = ()) -> nn.Module:
    """The reference: one process, each step on the concatenation of every rank's batch (none at ``skip_steps``)."""
    model = build_model(case.model, vocab=case.vocab).to(case.device)
    opt = make_optimizer(model.parameters(), case)
    for step in range(case.steps):
        if step in skip_steps:
            continue
        for micro in range(case.accumulate):
            batches = [batch_for(case, step, micro, r) for r in range(world)]
            batch = tuple(torch.cat(parts) for parts in zip(*batches))
            loss_for(model, case, batch, rank=0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def mixed_precision_reference(case: Case, world: int, dtypes: dict[str, torch.dtype]) -> nn.Module:
    """``mixed_precision``'s definition (Note [Mixed precision]), the reference where PyTorch's DDP cannot be one (on
    a CPU it needs an accelerator's events; on CUDA, torch 2.11's differs from its definition, docs/gpu.md): each
    rank's forward and backward on a ``param_dtype`` copy of the model and floating inputs, gradients summed in
    ``reduce_dtype``, averaged, and applied in full precision."""
    master = build_model(case.model, vocab=case.vocab).to(case.device)
    opt = make_optimizer(master.parameters(), case)
    param_dtype = dtypes.get("param_dtype") or torch.float32
    reduce_dtype = dtypes.get("reduce_dtype") or param_dtype
    for step in range(case.steps):
        grads = []
        for r in range(world):
            low = copy.deepcopy(master).to(param_dtype)
            x, *rest = batch_for(case, step, 0, r)
            x = x.to(param_dtype) if x.is_floating_point() else x  # DDP casts floating inputs: x, not the target
            loss_for(low, case, (x, *rest), r).backward()
            grads.append([p.grad.to(reduce_dtype) for p in low.parameters()])
        for p, *per_rank in zip(master.parameters(), *grads):
            p.grad = (torch.stack(per_rank).sum(0) / world).to(reduce_dtype).float()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return master


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_grads_then_zero(ours: nn.Module, theirs: nn.Module) -> None:
    """After a synchronising backward: every ``.grad`` of ``ours`` equals ``theirs``'s; then both are zeroed."""
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for module in (ours, theirs):
        module.zero_grad(set_to_none=True)


def assert_same_on_all_ranks(state: dict[str, torch.Tensor]) -> None:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v.cpu() for k, v in state.items()})
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)


class _Messages(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def graphddp_warnings() -> Iterator[list[str]]:
    """The messages graphddp logs at WARNING or above on this rank while the block runs."""
    messages: list[str] = []
    handler = _Messages(messages)
    logging.getLogger("graphddp").addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger("graphddp").removeHandler(handler)


@contextlib.contextmanager
def counted_hooks():
    """Count every call of graphddp's Python hooks: the per-gradient one, and a bucket counted in C's one (Note
    [Counting without a frame]). Hooks made while this is active."""
    calls = [0]
    originals = countdown.gradient_ready, countdown.sentinel_ready

    def counting(original):
        @functools.wraps(original)
        def counted(*args):
            calls[0] += 1
            return original(*args)

        return counted

    countdown.gradient_ready, countdown.sentinel_ready = map(counting, originals)
    try:
        yield calls
    finally:
        countdown.gradient_ready, countdown.sentinel_ready = originals
