"""Optimizer steps during backward: each bucket's parameters stepped as soon as their averaged gradient is final.

Note [Optimizer overlap]
~~~~~~~~~~~~~~~~~~~~~~~~
``ddp.step_in_backward(optimizer)`` hands graphddp the user's own optimizer. At the end of backward the Reducer
awaits the buckets and writes each one's averages into ``.grad`` while later buckets are still in flight (Note
[Reducer]); with an optimizer registered it then steps that bucket's parameters at once, so the optimizer's work
hides behind the remaining all-reduces instead of following them. It takes the buckets as their all-reduces
complete (``Launcher.reduced_as_completed``), not in index order: gloo runs two collectives of a group at once,
and a small bucket launched after a large one is often done first, so its step fits in the large one's shadow.

A bucket is stepped by calling the optimizer's own ``step()`` with its parameter groups narrowed to the bucket's
parameters (the groups' hyperparameters, a learning-rate scheduler's changes and the optimizer's ``state`` stay
the optimizer's own, so ``optimizer.state_dict()`` and schedulers work as before). That equals one
``optimizer.step()`` over every parameter exactly when the optimizer updates each parameter from its own
gradient and state alone, which holds for PyTorch's element-wise optimizers (``SUPPORTED``); the others (LBFGS,
anything that reads every gradient at once, such as a global gradient-norm clip) are refused. A bucket holding a
parameter that this rank did not use is stepped once the ranks' usage is known (its gradient is final only then).

The training loop drops its ``optimizer.step()`` (graphddp made it) and keeps ``optimizer.zero_grad()``. Under
``no_sync()`` nothing is reduced and nothing is stepped: the step comes with the synchronising backward, as in
the usual accumulation loop.

Under ``torch.compile`` a graph reducing in-graph steps each bucket inside its compiled backward instead, by a
node after the bucket's wait (Note [Steps in the compiled backward] in ``graphddp/runtime/in_graph_steps.py``).

Whether it pays is the step cost model's call (``graphddp.passes.choose_optimizer_overlap``), from the schedule
the stepping run recorded against the one that steps after backward. The model says yes only for a predicted
gain above ``STEP_IN_BACKWARD_MARGIN`` (3 %); on CPU hosts the steps share the cores with gloo's reductions, and
below that the measured sign did not follow the predicted one.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .row_steps import RowSteps

if TYPE_CHECKING:
    from .buckets import FlatBucket
    from .launcher import Launcher

SUPPORTED = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
)
"""Optimizers whose update of a parameter depends only on that parameter's gradient and state."""

_NONE: Mapping[int, torch.Tensor] = types.MappingProxyType({})


class NoStep:
    """No optimizer registered: the training loop steps it."""

    def bucket_final(self, k: int, whole: list[int], params: Sequence[torch.nn.Parameter], events: Any) -> None:
        """Bucket ``k``'s parameters ``whole`` (indices into ``params``) have their final ``.grad``: nothing to do."""

    @staticmethod
    def reduced(launcher: Launcher) -> Iterator[tuple[FlatBucket, torch.Tensor]]:
        """The order the end of backward takes the buckets in: the index order."""
        return launcher.reduced_in_order()


class StepPerBucket:
    """``step_in_backward(optimizer)``: step each bucket's parameters once their averages are in ``.grad``."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainable: Sequence[torch.nn.Parameter]) -> None:
        if not isinstance(optimizer, SUPPORTED):
            raise TypeError(
                f"graphddp.DDP.step_in_backward: {type(optimizer).__name__} is not one of the optimizers that update "
                f"each parameter from its own gradient ({', '.join(c.__name__ for c in SUPPORTED)}); stepping it "
                "bucket by bucket would change its result. Call optimizer.step() after backward instead."
            )
        mine = {id(p) for p in trainable}
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        outside = [p for p in stepped if id(p) not in mine and p.requires_grad]  # a frozen one never has a gradient
        if outside:
            raise ValueError(
                f"graphddp.DDP.step_in_backward: the optimizer holds {len(outside)} trainable parameter(s) this DDP "
                f"module does not synchronise in its buckets (shape of the first: {tuple(outside[0].shape)}): ignored "
                "ones (_set_params_and_buffers_to_ignore_for_model), delayed ones (delay_all_reduce_named_params) or "
                "another module's; graphddp would never step them. Give those an optimizer of their own, stepped after "
                "backward."
            )
        self.optimizer = optimizer
        self.rows = RowSteps(optimizer)
        """Big parameters stepped block by block in the compiled backward (Note [Steps by rows])."""

    @staticmethod
    def reduced(launcher: Launcher) -> Iterator[tuple[FlatBucket, torch.Tensor]]:
        """The order the end of backward takes the buckets in: as their reductions complete, so a bucket done
        before an earlier one is stepped while that one is still being sent."""
        return launcher.reduced_as_completed()

    def bucket_final(self, k: int, whole: list[int], params: Sequence[torch.nn.Parameter], events: Any) -> None:
        """Bucket ``k``'s parameters ``whole`` (indices into ``params``) have their final ``.grad``: step them."""
        if whole:
            self.step_whole([params[i] for i in whole])
            events.record("stepped", k)

    @torch.no_grad()
    def step_with(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
        """Step ``params`` with ``grads`` in ``.grad`` for the call (added to what ``.grad`` holds, as autograd
        will add them), then ``.grad`` as it was (Note [Steps in the compiled backward]); a parameter some of
        whose rows were stepped already (``step_rows``) only has the rest stepped (Note [Steps by rows])."""
        whole = []
        for p, g in zip(params, grads):
            if self.rows.is_open(p):
                self.rows.finish(p, g, self.step_only)
            else:
                whole.append((p, g))
        held = [p.grad for p, _ in whole]
        try:
            for (p, g), h in zip(whole, held):
                p.grad = g if h is None else h + g
            self.step_whole([p for p, _ in whole])
        finally:
            for (p, _), h in zip(whole, held):
                p.grad = h

    @torch.no_grad()
    def step_whole(self, params: Sequence[torch.nn.Parameter]) -> None:
        """``optimizer.step()`` for ``params`` only, with their ``.grad``; a big CPU parameter in chunks of rows
        (``RowSteps.chunked``, Note [Steps by rows]), the same step element for element."""
        chunked = {id(p) for p in params if self.rows.chunked(p)}
        for p in params:
            if id(p) in chunked:
                self.rows.step_whole(p, self.step_only)
        self.step_only([p for p in params if id(p) not in chunked])

    @torch.no_grad()
    def step_rows(self, param: torch.nn.Parameter, start: int, grad: torch.Tensor) -> None:
        """Step rows ``[start, start + len(grad))`` of ``param`` with ``grad``, their averaged gradient, before
        the rest of it (Note [Steps by rows])."""
        self.rows.step(param, start, grad, self.step_only)

    @torch.no_grad()
    def step_only(self, params: Sequence[torch.Tensor], *, standing_in: Mapping[int, torch.Tensor] = _NONE) -> None:
        """``optimizer.step()`` for ``params`` only (Note [Optimizer overlap]), each parameter whose id is in
        ``standing_in`` replaced in its group by that tensor for the call (Note [Steps by rows])."""
        if not params:
            return
        wanted = {id(p) for p in params}
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        try:
            for group, all_params in zip(groups, everything):
                group["params"] = [standing_in.get(id(p), p) for p in all_params if id(p) in wanted]
            self.optimizer.step()
        finally:
            for group, all_params in zip(groups, everything):
                group["params"] = all_params
