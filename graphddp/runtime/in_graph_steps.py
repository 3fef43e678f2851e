"""Optimizer steps inside the compiled backward: ``step_in_backward`` on the in-graph strategy.

Note [Steps in the compiled backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On the split, the Reducer steps each bucket at the end of backward as its all-reduce completes (Note [Optimizer
overlap] in ``graphddp/runtime/optimizer_overlap.py``). In-graph there is no Reducer in the backward, and the
compiled backward returns every gradient at once, after the last wait: the optimizer would run after the link,
where a link-bound step can least afford it. So a graph compiled while an optimizer is registered gets one more
node per bucket (``graphddp/compiler/in_graph.py``): ``graphddp::step_bucket(key, averaged)``, right after the
bucket's wait. Its Python runs the user's optimizer over the bucket's parameters, with their averaged gradients
standing in ``.grad`` for the call (added to what ``.grad`` held, as autograd will add them); autograd then puts
the same averages into ``.grad`` when the compiled backward returns, as without it.

* **Not dropped, ordered after its wait**: the node returns a [1] zero that is added into the abandon signal's
  gradient (Note [Abandoned backward]), so the graph needs it; it reads the waited gradients, so it runs after
  them. ``graphddp.passes.sink_bucket_steps`` moves each one, with its wait, to the end of the backward: after
  every other computation, so no kernel reads a parameter the step already changed. There the waits come in
  bucket order: while bucket k is stepped, the later buckets are still on the link.
* **When**: only where the graph was compiled with the optimizer registered and more than one rank averages
  (one rank has no wait to hide behind: its graphs run split, where the Reducer steps). An optimizer registered
  after a graph was compiled in-graph without these nodes sends every graph back to the split, as before.
* **One graph**: where the module compiles into several graphs (graph breaks), they run split and the Reducer
  steps. A later graph's backward runs first; a parameter it shares with an earlier graph (a tied weight) would
  be stepped on part of its gradient, before the earlier graph's backward had read it. For the same reason a
  graph that steps must run once per forward: a second run over the same parameters (a block called twice across
  a graph break, which Dynamo compiles into graphs of one parameter set) raises before it runs, on every rank.
* **A big gradient's blocks**: where the gradient is sent in blocks written in place (Note [Gradient pieces],
  Note [Blocks written in place]), ``graphddp::wait_blocks_`` is handed the step node's key and steps each
  block's rows as the block is in (the first block's at once, the others as their waits return), so only the
  last block's rows and the bucket's small parameters are stepped after the link is done (Note [Steps by rows]
  in ``graphddp/runtime/row_steps.py``).
* **The key**: an int naming (the DDP's target, the bucket's parameter names), made when the graph is compiled.
  The target is held weakly: a node of a freed DDP steps nothing.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from ..passes.reduction import STEP_OP  # the passes find the nodes by this name: they import nothing of the runtime
from .launch_context import CUDAGRAPH_UNSAFE


class StepsParameters(Protocol):
    """What a node's key refers to: steps a bucket's parameters, given their averaged gradients."""

    def step_bucket(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None: ...

    def step_rows(self, name: str, offset: int, grad: torch.Tensor) -> None: ...


_keys = itertools.count()
_buckets: dict[int, tuple[weakref.ref[StepsParameters], tuple[str, ...]]] = {}


def bucket_key(target: StepsParameters, names: Sequence[str]) -> int:
    """A key for one bucket of a graph being compiled: ``target.step_bucket(names, ...)`` when its node runs."""
    for dead in [k for k, (ref, _) in _buckets.items() if ref() is None]:  # keys of freed DDPs' graphs
        del _buckets[dead]
    key = next(_keys)
    _buckets[key] = (weakref.ref(target), tuple(names))
    return key


@torch.library.custom_op(STEP_OP, mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def step_bucket(key: int, grads: list[torch.Tensor]) -> torch.Tensor:
    """Step the parameters of bucket ``key`` with ``grads``, their averaged gradients; a [1] float32 zero."""
    entry = _buckets.get(key)
    target = entry[0]() if entry is not None else None
    if target is not None:
        target.step_bucket(entry[1], grads)  # type: ignore[index]
    return grads[0].new_zeros(1, dtype=torch.float32)


def step_rows(key: int, position: int, offset: int, grad: torch.Tensor) -> None:
    """The rows of the parameter at ``position`` of bucket ``key``'s step that start at element ``offset`` of it
    (flattened) stepped with ``grad``, their averaged gradient, before its step node steps the rest (Note [Steps by
    rows]); what ``graphddp::wait_blocks_`` calls for each block."""
    entry = _buckets.get(key)
    target = entry[0]() if entry is not None else None
    if target is not None:
        target.step_rows(entry[1][position], offset, grad)  # type: ignore[index]


@step_bucket.register_fake
def _(key: int, grads: list[torch.Tensor]) -> torch.Tensor:
    return grads[0].new_empty(1, dtype=torch.float32)
