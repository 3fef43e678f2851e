"""Which embedding tables are reduced as rows: ``sparse_embedding_grads`` and, with ``"auto"``, the link measured
when the DDP is built (Note [Row-sparse gradients] in ``graphddp/passes/row_sparse.py``, "When rows pay").

One object answers for the eager plan (``eager_tables``) and for each compiled graph (``for_graph``), from data
every rank shares: the module's structure, the graph's, and rank 0's measurements broadcast. So ranks plan alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..passes import GraphParam, LinkModel, RowsVerdict, row_sparse_params, rows_pay, tied_tables
from .auto_caps import AutoCaps
from .calibration import cpu_cost_of_communication, link_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowsRule:
    """``sparse_embedding_grads`` as the DDP applies it."""

    enabled: bool | str
    """``True``: rows wherever they apply; ``False``: never; ``"auto"``: where they pay on ``link``."""
    link: LinkModel | None = None
    """The link measured at construction (``"auto"``, only where rows apply to an ``nn.Embedding``); None: rows
    wherever they apply, as ``True``."""
    cpu_seconds_per_byte: float = 0.0
    """gloo's CPU per byte, where automatic caps measured it or a tied table's parts are charged it (CPU groups);
    0 otherwise."""
    world: int = 1
    """Ranks of the DDP's group: the link's all-reduces are predicted for them."""
    rank: int = 0
    """This rank, for the log lines."""

    @classmethod
    def measure(
        cls, enabled: bool | str, module: nn.Module, group: dist.ProcessGroup, device: torch.device, *, applies: bool,
        auto_caps: AutoCaps | None, ignored: frozenset[str] = frozenset(),
    ) -> RowsRule:
        """The rule for ``module``'s DDP. Collective where ``"auto"`` must measure the link (rows ``applies`` and the
        module has a table the DDP reduces: not among the ``ignored`` parameters): every rank decides that from the
        same options and module structure."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if isinstance(enabled, bool) or not applies or not _has_embedding(module, ignored):  # nothing to measure
            return cls(enabled=enabled, world=world, rank=rank)
        charged = charges_gloo_cpu(module, ignored, cpu_group=device.type == "cpu", automatic_caps=auto_caps is not None)
        if auto_caps is not None:  # measured already, gloo's CPU per byte too
            link, cpu = auto_caps.link, auto_caps.cpu_seconds_per_byte
        else:
            link = link_of(group, device=device)
            cpu = cpu_cost_of_communication(group, link=link) if charged else 0.0
        return cls(enabled=enabled, link=link, cpu_seconds_per_byte=cpu, world=world, rank=rank)

    @property
    def on(self) -> bool:
        """Rows may be used at all (``graphddp.passes.rows_apply`` asks the rest)."""
        return self.enabled is not False

    def verdict(self, tables: Sequence[tuple[int, int]], parts: Sequence[int] = ()) -> RowsVerdict | None:
        """``rows_pay`` on the measured link (``parts``: per table, its parts sent dense beside the rows); None
        where nothing was measured (rows wherever they apply)."""
        if self.link is None:
            return None
        return rows_pay(tables, link=self.link, world=self.world, cpu_seconds_per_byte=self.cpu_seconds_per_byte, parts=parts)

    def eager_tables(self, candidates: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> frozenset[str]:
        """Of ``candidates`` (``graphddp.passes.embedding_tables``: name to shape and bucket dtype), those reduced
        as rows eagerly: each table for itself."""
        chosen = set()
        for name, (shape, dtype) in candidates.items():
            verdict = self.verdict([_shape(shape, dtype)])
            if verdict is not None:
                logger.info("[rank %d] graphddp.DDP: embedding table %s reduced %s", self.rank, name, verdict.describe())
            if verdict is None or verdict.rows:
                chosen.add(name)
        return frozenset(chosen)

    def for_graph(self, params: Sequence[GraphParam]) -> bool:
        """Are a captured graph's tables planned as rows? All its tables together (one plan of the graph: the
        rows go in-graph or on the split alike, Note [Rows in the compiled backward])."""
        tables = row_sparse_params(params)
        if not tables:
            return False
        specs = {p.spec.name: p.spec for p in params}
        shapes = [_shape(specs[t.name].shape, specs[t.name].dtype) for t in tables]
        verdict = self.verdict(shapes, parts=[len(t.parts) for t in tables])  # a tied table's other uses: its parts
        if verdict is None:
            return True
        logger.info("[rank %d] graphddp: a compiled graph's embedding tables %s reduced %s", self.rank, sorted(t.name for t in tables), verdict.describe())
        return verdict.rows


def charges_gloo_cpu(module: nn.Module, ignored: frozenset[str], *, cpu_group: bool, automatic_caps: bool) -> bool:
    """Is gloo's CPU per byte charged in the rows verdicts? Where caps are chosen automatically, always: they measure
    it for every choice and hand it on. Otherwise only for a tied table's parts on a CPU group (the Note, "When rows
    pay"): about 0.7 s, decided from the module's structure, which every rank shares. ``RowsRule.measure`` and
    ``graphddp inspect`` both ask here."""
    return automatic_caps or (cpu_group and bool(tied_tables(module) - ignored))


def _shape(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """``(rows, bytes per row)`` of a 2-D table."""
    return int(shape[0]), int(shape[1]) * dtype.itemsize


def _has_embedding(module: nn.Module, ignored: frozenset[str]) -> bool:
    """A dense ``nn.Embedding`` that trains, tied or not, and that the DDP reduces (its weight not ``ignored``): a
    table some plan may reduce as rows."""
    names = {id(p): n for n, p in module.named_parameters()}
    return any(
        isinstance(m, nn.Embedding) and not m.sparse and m.weight.requires_grad and names.get(id(m.weight)) not in ignored
        for m in module.modules()
    )
