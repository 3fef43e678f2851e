"""The split without asking for it: plain ``torch.compile`` on a graphddp.DDP module splits at buckets.

Note [Split without asking]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's DDP gets DDPOptimizer without the user naming it: while a DDP forward runs, the DDP module is
``torch.nn.parallel.DistributedDataParallel._active_ddp_module``, and when Dynamo converts a frame it sees that
module and, with ``torch._dynamo.config.optimize_ddp`` on (the default), compiles the frame with
``torch._dynamo.backends.distributed.DDPOptimizer(bucket_bytes_cap=..., backend_compile_fn=<the user's
backend>).compile_fn`` instead of the user's backend.

graphddp takes part in the same protocol:

1. ``graphddp.DDP.forward`` makes itself the active DDP module while the wrapped module runs (``activate``);
2. ``install`` puts a subclass of DDPOptimizer in its place, which, when the active module is a graphddp.DDP,
   hands Dynamo graphddp's backend (Note [graphddp backend]) with the user's backend as the inner compiler of
   every segment, and otherwise builds PyTorch's DDPOptimizer exactly as before (so torch's DDP is unaffected).

So ``torch.compile(model)`` (Inductor), ``backend="aot_eager"``, a callable backend, ``model.compile()``, with
any ``mode=``/``options=``, all split at graphddp's buckets, and a backend that is already graphddp's is used as it
is. ``optimize_ddp=False`` turns the split off, as it does for PyTorch's DDP. A torch without these hooks gets one
warning naming ``graphddp.compile``.

**One recompile region per DDP.** Dynamo caches compiled frames by code object, and a second module of the same
class passes the first one's guards (its parameters are graph inputs), under the same user backend: without more,
a second graphddp.DDP would run the graphs compiled for the first, whose plan, in-graph variant and gradient taps
belong to the first DDP (it fell back to the split and its hooks). Dynamo splits its cache into regions
(``torch.compile(..., isolate_recompiles=True)``: a thread-local region id, each lookup in the current region and
then, read-only, in the default one), so ``activate`` puts each graphddp.DDP's forward in a region of its own and
``deactivate`` restores the one before: the frames its forward runs are compiled for it. Where the wrapped module
is compiled itself (``DDP(torch.compile(model))``, ``model.compile()``, a compiled submodule), its own wrapper sets
its region inside the DDP's as it runs: so each forward lends the DDP the wrappers found in its module at its first
forward (those in Dynamo's default region; one compiled with ``isolate_recompiles=True`` keeps its own), and gives
them back after it. A compiled module wrapped by a second DDP, or shared by two, runs each DDP's own graphs, and
called bare, graphs of its own; a module compiled after the DDP's first forward is not lent. A torch without
regions keeps the old sharing (``torch._dynamo.reset()`` between the two).
The price: a DDP's compiled frames stay cached after it is freed, and Dynamo compiles one code object at most
``accumulated_recompile_limit`` times (256) over all regions, then runs it eagerly: a process that builds that many
compiled DDPs of one class calls ``torch._dynamo.reset()`` between them (the bench and the tests do).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.torch_ddp import TorchDDP, active_ddp_module, set_active_ddp_module

logger = logging.getLogger(__name__)

_installed: bool | None = None
_split_backends: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_graphddp_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Every module ``activate`` made the active DDP: graphddp's DDPs (this layer never imports the DDP class)."""

try:  # Dynamo's recompile regions (the Note, "One recompile region per DDP"); a torch without them shares one cache
    from torch._C._dynamo.eval_frame import set_eval_frame_isolate_recompiles_id as _set_region
except ImportError:
    _set_region = None
_regions: weakref.WeakKeyDictionary[nn.Module, tuple[int, tuple[weakref.ref, ...]]] = weakref.WeakKeyDictionary()
_FIRST_REGION = 1 << 40  # far from the ids torch.compile(isolate_recompiles=True) draws, from 0
_region_ids = itertools.count(_FIRST_REGION)


def user_backend(compile_fn: Any) -> Any:
    """The backend the user gave ``torch.compile``, under Dynamo's debug wrapper."""
    return getattr(compile_fn, "_torchdynamo_orig_backend", compile_fn)


def split_backend_for(compile_fn: Callable[..., Any]) -> Any:
    """graphddp's backend with ``compile_fn`` as its inner compiler (one per user backend, so its ``splits``
    collect every graph compiled through it); ``compile_fn`` itself when it is graphddp's already."""
    from .backend import GraphDDPBackend, registered_backend

    key = user_backend(compile_fn)
    named = getattr(key, "compiler_fn", key)  # torch._TorchCompileWrapper: a named backend given mode/options
    if isinstance(named, GraphDDPBackend) or named is registered_backend:
        return compile_fn
    try:
        found = _split_backends.get(key)
    except TypeError:  # not weakly referenceable: a backend of its own each time
        return GraphDDPBackend(compile_fn)
    if found is None:
        found = _split_backends[key] = GraphDDPBackend(compile_fn)
    return found


def install() -> bool:
    """Put graphddp into Dynamo's DDP hook (once per process); False where this torch has no such hook."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from torch._dynamo.backends import distributed as dynamo_distributed

        original = dynamo_distributed.DDPOptimizer
        hooks_present = hasattr(TorchDDP, "_active_ddp_module") and hasattr(
            torch._dynamo.utils, "get_optimize_ddp_mode"
        )
    except (ImportError, AttributeError):
        original, hooks_present = None, False
    if not hooks_present or original is None:
        _installed = False
        logger.warning(
            "graphddp: this torch (%s) has no Dynamo DDP hook, so torch.compile(model) with a plain backend does "
            "not split at graphddp's buckets (no overlap). Use graphddp.compile(model, backend) or "
            "torch.compile(model, backend=graphddp.backend(...)).",
            torch.__version__,
        )
        return False
    if not getattr(original, "_graphddp_dispatch", False):
        dynamo_distributed.DDPOptimizer = _dispatching_optimizer(original)
    _installed = True
    return True


def _dispatching_optimizer(original: type) -> type:
    class DDPOptimizerOrGraphDDP(original):  # type: ignore[misc, valid-type]
        """PyTorch's DDPOptimizer, unless the active DDP module is a graphddp.DDP (Note [Split without asking])."""

        _graphddp_dispatch = True

        def __new__(cls, bucket_bytes_cap: int, backend_compile_fn: Any, first_bucket_cap: int | None = None) -> Any:
            active = active_ddp_module()
            if active is not None and active in _graphddp_modules:
                return _GraphDDPSplit(split_backend_for(backend_compile_fn))
            return original(
                bucket_bytes_cap=bucket_bytes_cap, backend_compile_fn=backend_compile_fn, first_bucket_cap=first_bucket_cap
            )

    DDPOptimizerOrGraphDDP.__qualname__ = DDPOptimizerOrGraphDDP.__name__ = original.__name__
    return DDPOptimizerOrGraphDDP


class _GraphDDPSplit:
    """What Dynamo asks of a DDPOptimizer: ``compile_fn``."""

    def __init__(self, compile_fn: Callable[..., Any]) -> None:
        self.compile_fn = compile_fn


# Called from graphddp.DDP.forward, whose callees Dynamo traces: kept out of the graph.
@torch.compiler.disable
def activate(ddp: nn.Module) -> Any:
    """Make ``ddp`` the active DDP module for Dynamo (step 1 of Note [Split without asking]) and its recompile
    region the current one, lending it the compile wrappers inside its module; returns what was before, for
    ``deactivate`` (nested DDPs: the innermost is active)."""
    _graphddp_modules.add(ddp)
    if _set_region is None:
        return set_active_ddp_module(ddp), None, ()
    region, held = _region_of(ddp)
    contexts = [context for context in (ref() for ref in held) if context is not None]
    lent = tuple((context, context._isolate_recompiles_id) for context in contexts)
    for context in contexts:
        context._isolate_recompiles_id = region  # read by the wrapper at each call
    return set_active_ddp_module(ddp), _set_region(region), lent


@torch.compiler.disable
def deactivate(previous: Any) -> None:
    module, region, lent = previous
    set_active_ddp_module(module)
    for context, before in reversed(lent):
        context._isolate_recompiles_id = before
    if region is not None:
        _set_region(region)


def _region_of(ddp: nn.Module) -> tuple[int, tuple[weakref.ref, ...]]:
    """``ddp``'s recompile region (the Note, "One recompile region per DDP") and the compile wrappers inside its
    module that its forwards lend it: both found once, kept while it lives."""
    found = _regions.get(ddp)
    if found is None:
        wrapped = getattr(ddp, "module", None)
        found = _regions[ddp] = (next(_region_ids), _lendable_contexts(wrapped) if isinstance(wrapped, nn.Module) else ())
    return found


def _lendable_contexts(module: nn.Module) -> tuple[weakref.ref, ...]:
    """The compile wrappers in ``module`` (itself or any submodule: ``torch.compile(model)``, ``model.compile()``)
    that run their frames in Dynamo's default region, or in a graphddp.DDP's that holds them now (an outer DDP's
    forward). Each wrapper sets its own region as it runs, inside the DDP's, so without the loan two DDPs over
    compiled modules of one class would share one cache again. One compiled with ``isolate_recompiles=True`` keeps
    its own region."""
    contexts: dict[int, Any] = {}
    for m in module.modules():
        for context in _dynamo_contexts(m):
            if getattr(context, "_isolate_recompiles_id", None) == _DEFAULT_REGION or _is_ddp_region(context):
                contexts[id(context)] = context
    return tuple(weakref.ref(context) for context in contexts.values())  # held weakly: they live with the module


def _is_ddp_region(context: Any) -> bool:
    return getattr(context, "_isolate_recompiles_id", -1) >= _FIRST_REGION


_DEFAULT_REGION = -1
"""The region id of a ``torch.compile`` without ``isolate_recompiles``."""


def _dynamo_contexts(module: nn.Module) -> list[Any]:
    """The Dynamo contexts that compile ``module``'s calls: an ``OptimizedModule``'s (``torch.compile(model)``), or
    the one ``model.compile()`` closed its wrapper over; none on a torch that has neither."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext
    except ImportError:
        return []
    found = [module.dynamo_ctx] if isinstance(module, OptimizedModule) else []
    wrapper = getattr(module, "_compiled_call_impl", None)
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, _TorchDynamoContext):
            found.append(content)
    return found
