"""``bucket_cap_mb="auto"``: the calibrated inputs of Note [Automatic caps] (``graphddp.passes.caps_choice``),
measured once when the DDP is built, and the two choices made from them.

Built collectively at construction (every rank measures the link and compute rates the same way, rank 0's
figures are broadcast), so both choices are functions of agreed data: the eager one of the ready times of the
first backward (rank 0's, broadcast with the ready order, ``graphddp.runtime.plans``), the compiled one of the captured
graph. Until a choice is made, the caps the user did not leave to ``"auto"`` and the defaults for the others
plan the buckets.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..passes import (
    BucketCaps,
    CapsChoice,
    CapsSearch,
    ComputeRates,
    GraphParam,
    LinkModel,
    ParamSpec,
    choose_caps,
    choose_graph_caps,
    step_inputs_from_ready_times,
)
from ..passes.plan import dtype_name
from .calibration import compute_rates, cpu_cost_of_communication, link_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AutoCaps:
    """What the automatic choice knows about the ranks and their link."""

    search: CapsSearch
    link: LinkModel
    rates: ComputeRates
    cpu_seconds_per_byte: float
    world: int
    rank: int
    _made: list[tuple[CapsChoice, dict[str, Any]]] = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)
    # Each choice made so far, with what it was made for beyond the calibration (``choices``, ``as_record``).

    @property
    def choices(self) -> tuple[CapsChoice, ...]:
        """Every choice made from this calibration so far, in order: the eager one at the first backward, one per
        compiled graph (a recompiled graph keeps its first choice)."""
        return tuple(choice for choice, _ in self._made)

    @classmethod
    def calibrate(cls, search: CapsSearch, group: dist.ProcessGroup, device: torch.device) -> AutoCaps:
        """Measure the link, the compute rates and (CPU collectives) communication's cost in compute. Collective."""
        link = link_of(group, device=device)
        rates = compute_rates(group, device=device)
        cpu = cpu_cost_of_communication(group, link=link) if device.type == "cpu" else 0.0
        return cls(search, link, rates, cpu, dist.get_world_size(group), dist.get_rank(group))

    def for_ready_times(
        self, specs_in_ready_order: Sequence[ParamSpec], ready_s: Sequence[float], backward_s: float, *, wire: torch.dtype | None = None
    ) -> BucketCaps:
        """Caps for eager buckets, from the (agreed) ready times of one backward; ``wire``: the dtype a compressing
        comm hook sends the buckets in (None: the gradients' own)."""
        started = time.perf_counter()
        choice = choose_caps(
            self.search.candidates(),
            lambda caps: step_inputs_from_ready_times(
                specs_in_ready_order, ready_s, caps, backward_s=backward_s, cpu_seconds_per_byte=self.cpu_seconds_per_byte,
                cpu_seconds_per_bucket=self.rates.reducer_seconds_per_bucket, wire=wire,
            ),
            self.link,
            self.world,
            standing=self.search.standing,
        )
        ready = [[spec.name, t] for spec, t in zip(specs_in_ready_order, ready_s)]
        made_for = {"source": "first backward", "wire": _dtype_name(wire), "backward_s": backward_s, "ready_s": ready}
        return self._keep(choice, made_for, started, f"from the first backward ({backward_s * 1e3:.0f} ms)")

    def for_graph(
        self, gm: fx.GraphModule, params: Sequence[GraphParam], *, row_sparse: bool, blocks: bool = False, wire: torch.dtype | None = None
    ) -> BucketCaps:
        """Caps for a captured graph, its backward estimated from its shapes, its big gradients sent in ``blocks``
        where it will be reduced in-graph, in ``wire`` where a compressing comm hook casts them."""
        started = time.perf_counter()
        choice = choose_graph_caps(
            gm, params, self.search, rates=self.rates, link=self.link, world=self.world,
            row_sparse=row_sparse, cpu_seconds_per_byte=self.cpu_seconds_per_byte, blocks=blocks, wire=wire,
        )  # fmt: skip
        made_for = {"source": "graph", "row_sparse": row_sparse, "blocks": blocks, "wire": _dtype_name(wire)}
        return self._keep(choice, made_for, started, "for a compiled graph")

    def _keep(self, choice: CapsChoice, made_for: dict[str, Any], started: float, source: str) -> BucketCaps:
        """Keep a choice with what it was made for (``as_record``) and log it with its search time, which the record
        leaves out so that every rank's record is the same but for its rank."""
        self._made.append((choice, made_for))
        logger.info(
            "[rank %d] graphddp: automatic caps %s, searched in %.2f s: %s", self.rank, source, time.perf_counter() - started, choice.describe()
        )
        return choice.caps

    def as_record(self, top: int = 5) -> dict[str, Any]:
        """What this rank measured at construction and chose from it, as plain data (JSON): the link, the compute
        rates, gloo's CPU cost per byte, the standing caps, and each choice with what it was made for (eager: the
        first backward's seconds and ready times by parameter; compiled: whether tables went as rows and big
        gradients in blocks, the graph itself is not kept), the standing caps' prediction and the ``top``
        candidates, in MiB and ms. The bench keeps it beside a run's times."""

        def caps(c: BucketCaps) -> dict[str, Any]:
            return {"mb": c.mb, **dataclasses.asdict(c)}

        standing = self.search.standing
        return {
            "link": dataclasses.asdict(self.link),
            "rates": {**dataclasses.asdict(self.rates), "reducer_seconds_per_bucket": self.rates.reducer_seconds_per_bucket},
            "cpu_seconds_per_byte": self.cpu_seconds_per_byte,
            "world": self.world,
            "rank": self.rank,
            "standing": caps(standing) if standing is not None else None,
            "choices": [
                {
                    **made_for, "caps": caps(c.caps), "predicted_ms": c.predicted_s * 1e3, "kept_standing": c.kept_standing,
                    "robust": caps(c.robust) if c.robust is not None else None, "worst_regret": c.worst_regret,
                    "robust_ms": next((s * 1e3 for r, s in c.ranking if r == c.robust), None), "margin": c.margin,
                    "standing_ms": next((s * 1e3 for r, s in c.ranking if r == standing), None),
                    "ranking": [[caps(r), s * 1e3] for r, s in c.ranking[:top]],
                }
                for c, made_for in self._made
            ],
        }  # fmt: skip


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    """A dtype in a record (JSON) as the debug dump writes it (``"float16"``), or None."""
    return None if dtype is None else dtype_name(dtype)
