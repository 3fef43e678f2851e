"""A big parameter stepped block by block, as its gradient's blocks come off the link.

Note [Steps by rows]
~~~~~~~~~~~~~~~~~~~~
In-graph, a big gradient goes in blocks of rows (Note [Gradient pieces] in ``passes/plan.py``), each all-reduced
on its own, and an optimizer stepping in backward steps each bucket after its wait (Note [Steps in the compiled
backward]). Stepped whole, the bucket holding the gradient completed last is stepped after the link is done (the
bench MLP's first weight, 16 MiB, 10-20 ms of AdamW on a 2-vCPU host), and a big gradient's step waits for its
last block while the link sends the next bucket. The optimizers ``step_in_backward`` accepts (``SUPPORTED`` in
``graphddp/runtime/optimizer_overlap.py``) update each element from that element's gradient and state alone, so a
parameter's rows can be stepped one block at a time, each as soon as its block is averaged, while the later
blocks are still on the link; only the last block's rows and the bucket's small parameters are left after it.

``RowSteps`` does it with the user's own optimizer, unchanged: for rows ``[a, b)`` it hands ``optimizer.step()``
(its groups narrowed to that parameter, Note [Optimizer overlap]) a stand-in, ``param.detach()[a:b]``, which shares
the parameter's memory, with the block's gradient, and as its state the rows ``[a, b)`` of each state tensor shaped
like the parameter (views: the optimizer's in-place updates land in the parameter's own state) and a copy of each
other entry (``step``, NAdam's ``mu_product``). Those others change once per ``optimizer.step()`` of the whole
parameter, so every block starts from the value before this iteration, and the last block's is kept when the
parameter is finished (``finish``: the rows no block stepped, with the bucket's own step node). A first step,
with no state yet, lets the optimizer create each block's, and ``finish`` puts them together in row order. The
result is the whole step's, element for element (``tests/one_process/test_row_steps.py``, every supported
optimizer; a fused one up to an element's last bit, its vectorised kernel rounding a vector's tail apart).
Only a contiguous parameter is cut into rows: fused CPU AdamW steps a strided view of rows wrongly.

Where: ``graphddp::wait_blocks_`` (``graphddp/runtime/in_graph_blocks.py``, Note [Blocks written in place]) first
copies in and steps the blocks it copies (the first block, sent with the bucket's small gradients, waited for
already), then each block written in place after its own wait, in the order the blocks were sent; the bucket's
step node then finishes the parameter (no rows left, only the state to settle) and steps the bucket's other
parameters whole. Where no block could be written in place (cast for the wire by ``fp16_compress_hook``) there
is no ``wait_blocks_``, and the step node steps the parameter whole, as before. The optimizer's step hooks run
once per ``step()`` call, so once per block and per chunk (below), and see the stand-in in its group; an exception
from a chunk's step on a first step loses the state made for the chunks before it. A backward abandoned half-way leaves a parameter partly
stepped, as it leaves the buckets stepped before it; the next forward forgets it (``forget``), with a warning.

Chunks: the same stand-ins step a big CPU parameter a few MiB of rows at a time (``CPU_CHUNK_BYTES``, where it
has more than one row and a dense gradient: ``steps_in_chunks``) wherever ``step_in_backward`` steps it, whole
buckets by the Reducer and by the step nodes included (``StepPerBucket.step_whole``). PyTorch's CPU optimizers
(``foreach`` off, their CPU default) make one pass over the parameter per operation and allocate temporaries of
its size: a chunk and its state can stay in cache between the passes, and its temporaries are small enough for
the allocator to reuse, where a big parameter's go through memory and come fresh from the kernel each step.
Which of the two saves more was not separated; the saving is measured (``CPU_CHUNK_BYTES``). Element for element
the result is the same.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

StepOnly = Callable[..., None]
"""``StepPerBucket.step_only(params, standing_in=...)``: ``optimizer.step()`` for ``params`` only, each parameter
whose id is in ``standing_in`` replaced in its group by that tensor for the call."""


@dataclasses.dataclass
class _Open:
    """A parameter some of whose rows this iteration has stepped."""

    param: torch.Tensor
    fresh: bool
    """No optimizer state before this iteration: each block's state is kept and put together at ``finish``."""
    covered: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks: list[tuple[int, dict[Any, Any]]] = dataclasses.field(default_factory=list)
    """``fresh`` only: each block's first row and the state the optimizer made for it."""
    others: dict[Any, Any] = dataclasses.field(default_factory=dict)
    """The entries not shaped like the parameter, as the latest block left them."""


def _by_rows(value: Any, shape: torch.Size) -> bool:
    """A state entry kept per element: sliced by rows like the parameter."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class RowSteps:
    """The rows of big parameters stepped block by block (Note [Steps by rows])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer  # its ``state`` read at each use: ``load_state_dict`` puts in a new dict
        self._open: dict[int, _Open] = {}

    def forget(self) -> None:
        """A forward begins: a parameter still open was left by a backward abandoned half-way (a backward's blocks
        and its step node run in that backward), its stepped rows stay stepped; the next starts afresh."""
        if self._open:
            logger.warning(
                "graphddp: %d parameter(s) were stepped in part by a backward that stopped before its end; their "
                "stepped rows stay stepped (Note [Steps by rows])", len(self._open),
            )  # fmt: skip
            self._open.clear()

    def is_open(self, param: torch.Tensor) -> bool:
        """Some rows of ``param`` were stepped this iteration: ``finish`` it."""
        return id(param) in self._open

    def step(self, param: torch.Tensor, start: int, grad: torch.Tensor, step_only: StepOnly) -> None:
        """Step rows ``[start, start + len(grad))`` of ``param`` with ``grad`` (added to those rows of ``.grad``,
        as autograd will add the whole averaged gradient)."""
        if not self._cut_into_rows(param):
            return  # the step node steps it whole, or nothing does
        opened = self._open.get(id(param))
        stop = start + grad.shape[0]
        if opened is not None and any(a < stop and start < b for a, b in opened.covered):
            logger.warning(
                "graphddp: rows %d-%d of a parameter of shape %s were stepped again before the rest of it: the "
                "backward before stopped half-way; its stepped rows stay stepped", start, stop, tuple(param.shape),
            )  # fmt: skip
            opened = None
        if opened is None:
            opened = self._open[id(param)] = _Open(param, fresh=not self._optimizer.state.get(param))
        self._step_rows(opened, start, stop, _with_held(param, start, stop, grad), step_only)

    def chunked(self, param: torch.Tensor) -> bool:
        """Is ``param`` stepped in chunks of rows when stepped whole (``step_whole``)? A CPU parameter of more than
        one chunk (``CPU_CHUNK_BYTES``) that the optimizer holds, with a dense gradient."""
        grad = param.grad
        return (
            grad is not None and not grad.is_sparse
            and steps_in_chunks(param.shape, param.nbytes, on_cpu=param.device.type == "cpu")
            and self._cut_into_rows(param)
        )  # fmt: skip

    def _cut_into_rows(self, param: torch.Tensor) -> bool:
        """May ``param`` be stepped some rows at a time? Only a parameter the optimizer holds (nothing else steps
        it), and only where its rows are contiguous: PyTorch's fused CPU AdamW steps a strided view of rows wrongly
        (``tests/one_process/test_row_steps.py``, a transposed parameter)."""
        return param.is_contiguous() and any(p is param for group in self._optimizer.param_groups for p in group["params"])

    def step_whole(self, param: torch.Tensor, step_only: StepOnly) -> None:
        """Step the whole of ``param`` with its ``.grad``, in chunks of rows (``chunked``: the Note's last
        paragraph)."""
        opened = _Open(param, fresh=not self._optimizer.state.get(param))
        self._step_rows(opened, 0, param.shape[0], param.grad, step_only)  # type: ignore[arg-type]
        self._settle(opened)

    def finish(self, param: torch.Tensor, grad: torch.Tensor, step_only: StepOnly) -> None:
        """Step the rows of ``param`` no block stepped with ``grad``'s (the whole averaged gradient), and settle its
        optimizer state: the entries every block started from, the blocks' states put together on a first step."""
        opened = self._open.pop(id(param))
        start = 0
        for a, b in [*sorted(opened.covered), (param.shape[0], param.shape[0])]:
            if start < a:
                self._step_rows(opened, start, a, _with_held(param, start, a, grad[start:a]), step_only)
            start = max(start, b)
        self._settle(opened)

    def _settle(self, opened: _Open) -> None:
        """The optimizer state of a parameter every row of which is stepped: the entries every block started
        from, the blocks' states put together on a first step."""
        param = opened.param
        blocks = [state for _, state in sorted(opened.blocks, key=lambda block: block[0])]
        if not (opened.others or any(blocks)):
            return  # an optimizer with no state (SGD without momentum): none made
        whole = self._optimizer.state[param]
        if opened.fresh:  # each block's state, made by the optimizer: its rows in row order
            for key in blocks[0].keys() - opened.others.keys():
                whole[key] = torch.cat([state[key] for state in blocks])
        for key, value in opened.others.items():
            current = whole.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
                current.copy_(value)  # the same tensor, as the optimizer made it (a capturable step's device)
            else:
                whole[key] = value

    def _step_rows(self, opened: _Open, start: int, stop: int, grad: torch.Tensor, step_only: StepOnly) -> None:
        """Rows ``[start, stop)`` stepped with ``grad``, their whole gradient, chunk by chunk."""
        for a, b in _chunks(opened.param, start, stop):
            self._step_chunk(opened, a, b, grad[a - start : b - start], step_only)

    def _step_chunk(self, opened: _Open, start: int, stop: int, grad: torch.Tensor, step_only: StepOnly) -> None:
        param = opened.param
        rows = param.detach()[start:stop]  # the parameter's own memory: the optimizer writes its rows
        rows.grad = grad
        state = self._optimizer.state
        given = {} if opened.fresh else {
            key: value[start:stop] if _by_rows(value, param.shape) else _copied(value)
            for key, value in state[param].items()
        }  # fmt: skip
        state[rows] = dict(given)
        try:
            step_only([param], standing_in={id(param): rows})
        finally:
            made = state.pop(rows, {})
        self._keep(opened, start, stop, given, made)

    @staticmethod
    def _keep(opened: _Open, start: int, stop: int, given: Mapping[Any, Any], made: Mapping[Any, Any]) -> None:
        """What the optimizer left in a block's state: row entries stay where they are (a replaced one is written
        back into the parameter's), the others are kept for ``finish``."""
        shape = torch.Size([stop - start, *opened.param.shape[1:]])
        for key, value in made.items():
            if opened.fresh and _by_rows(value, shape):
                continue  # kept with the block's state below
            if key in given and _by_rows(given[key], shape):
                if value is not given[key]:
                    given[key].copy_(value)
            else:
                opened.others[key] = value
        if opened.fresh:
            opened.blocks.append((start, dict(made)))
        opened.covered.append((start, stop))



CPU_CHUNK_BYTES = 4 * 2**20
"""Rows of a parameter stepped per ``optimizer.step()`` call on a CPU (the Note's last paragraph): AdamW over a
4096 x 4096 weight on the 2-vCPU development host (32 MiB last-level cache), 64 ms whole, 29 ms in 4 MiB chunks
(32 and 34 ms in 1 and 16 MiB ones; ``docs/benchmarks.md``, session 37). On a GPU a step's kernels stream memory
anyway, and each chunk would add their launches: no chunks there."""


def steps_in_chunks(shape: Sequence[int], nbytes: int, *, on_cpu: bool) -> bool:
    """Is a parameter of ``shape`` and ``nbytes`` (its gradient dense, its memory contiguous: ``RowSteps`` cuts no
    other into rows) stepped in more than one chunk of rows when stepped whole? The one rule ``RowSteps.chunked``
    and the bench's prediction (``bench.worker``, whose models' parameters are contiguous) use."""
    return on_cpu and len(shape) >= 1 and shape[0] > _rows_per_chunk(shape[0], nbytes)


def _rows_per_chunk(rows: int, nbytes: int) -> int:
    return max(1, CPU_CHUNK_BYTES // max(1, nbytes // max(1, rows)))


def _chunks(param: torch.Tensor, start: int, stop: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of ``param`` in chunks of ``CPU_CHUNK_BYTES`` (one chunk off the CPU)."""
    if param.device.type != "cpu" or stop - start <= 1:
        return [(start, stop)]
    per_chunk = _rows_per_chunk(param.shape[0], param.nbytes)
    return [(a, min(a + per_chunk, stop)) for a in range(start, stop, per_chunk)]


def _with_held(param: torch.Tensor, start: int, stop: int, grad: torch.Tensor) -> torch.Tensor:
    """Rows ``[start, stop)``' averaged ``grad`` added to what ``.grad`` holds there, as autograd will add it."""
    held = param.grad
    return grad if held is None else held[start:stop] + grad
