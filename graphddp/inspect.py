"""``graphddp inspect TARGET``: the bucket plan and split of a model, in one process, with no ranks.

TARGET is a built-in workload (``gpt``, ``mlp``, ``cnn``) or ``package.module:factory``, a function returning
``(model, example_inputs)``. The model is captured with Dynamo once, and the same passes the backend runs
(``graphddp.passes``) produce the plan: the result equals what ``graphddp.backend`` adopts in a real run with the
same caps. Nothing is compiled unless ``--dump`` asks for the AOT graphs.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from .capture import capture_graphs, parameter_names
from .dump import DebugDump, versions
from .taps import GradientTap
from .passes import (
    BucketPlan,
    GraphSplit,
    ParamSpec,
    BucketCaps,
    compose_plans,
    embedding_tables,
    find_graph_params,
    plan_graph,
    split_at_buckets,
    tap_parts,
)
from .passes.report import BUCKET_HEADERS, SEGMENT_HEADERS, bucket_rows, plan_record, segment_rows
from .workloads import SIZES, WORKLOADS, build_workload


class InspectError(Exception):
    """A problem with TARGET: reported as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class GraphReport:
    name: str
    plan: BucketPlan
    split: GraphSplit


@dataclasses.dataclass(frozen=True)
class Inspection:
    target: str
    graphs: list[GraphReport]
    plan: BucketPlan
    """The plan the Reducer would run: the graphs' plans composed (see ``graphddp.proposals``)."""

    def record(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "fingerprint": self.plan.fingerprint,
            "graphs": [plan_record(g.plan, g.split, graph=g.name, versions=versions()) for g in self.graphs],
            "buckets": [{"index": b.index, "bytes": b.nbytes, "params": list(b.names)} for b in self.plan.buckets],
            "versions": versions(),
        }

    def text(self) -> str:
        parts = []
        for g in self.graphs:
            parts.append(f"{g.name}: {len(g.plan.buckets)} buckets, {g.split.num_segments} segments")
            parts.append(tabulate(_shorten(bucket_rows(g.plan, g.split)), headers=BUCKET_HEADERS))
            parts.append("")
            parts.append(tabulate(segment_rows(g.split), headers=SEGMENT_HEADERS))
            parts.append("")
        parts.append(f"fingerprint {self.plan.fingerprint} ({len(self.plan.buckets)} buckets in all)")
        return "\n".join(parts)


def inspect_target(
    target: str,
    *,
    bucket_cap_mb: float = 25,
    first_bucket_cap_mb: float = 1,
    last_bucket_cap_mb: float = 1,
    bucket_ramps: bool = True,
    sparse_embedding_grads: bool = True,
    world_size: int = 2,
    batch: int | None = None,
    size: str = "small",
    dump: str | None = None,
) -> Inspection:
    caps = BucketCaps.from_mb(bucket_cap_mb, first_bucket_cap_mb, last_bucket_cap_mb, ramps=bucket_ramps)
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world size must be a whole number, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    model, inputs = load_target(target, batch=batch, size=size)
    names = parameter_names(model)
    if not names:
        raise InspectError(f"{target}: the model has no parameter that requires a gradient; there is nothing to plan")
    writer = DebugDump(dump) if dump is not None else None
    row_sparse = sparse_embedding_grads and world_size > 1  # as graphddp.DDP decides (on CPU)
    graphs = []
    for i, captured in enumerate(capture_graphs(model, *inputs)):
        params = find_graph_params(captured.gm, captured.example_inputs, names)
        if not params:
            continue
        split = plan_graph(captured.gm, params, caps, world_size=world_size, row_sparse=row_sparse)
        graphs.append(GraphReport(f"graph{i}", split.plan, split))
        if writer is not None:
            _dump(writer, f"graph{i}", captured, split.plan, split)
    tables = embedding_tables(model) if row_sparse else frozenset()
    specs = [ParamSpec.of(n, p, row_sparse=n in tables) for n, p in model.named_parameters() if p.requires_grad]
    # Graphs are captured in the order forward runs them, as the Reducer composes them (graphddp.proposals).
    plan = compose_plans([g.plan for g in graphs], specs[::-1], caps=caps)
    return Inspection(target, graphs, plan)


def load_target(target: str, *, batch: int | None, size: str) -> tuple[nn.Module, tuple]:
    if target in WORKLOADS:
        if size not in SIZES:
            raise InspectError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
        workload = build_workload(target, size=size, batch_size=batch, seed=0)
        return workload.model, workload.make_batch(torch.Generator().manual_seed(0))
    if ":" not in target:
        raise InspectError(
            f"unknown target {target!r}: give a built-in workload ({', '.join(WORKLOADS)}) or package.module:factory"
        )
    module_name, _, factory_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise InspectError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise InspectError(f"{module_name!r} has no callable {factory_name!r}")
    try:
        made = factory()
    except Exception as e:
        raise InspectError(f"{target} raised {type(e).__name__}: {e}") from e
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise InspectError(f"{target} must return (model, example_inputs), got {type(made).__name__}")
    model, inputs = made
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _dump(writer: DebugDump, name: str, captured: Any, plan: BucketPlan, split: GraphSplit) -> None:
    folder = writer.graph_folder(name)
    split_gm = split_at_buckets(captured.gm, split) if split.num_segments > 1 else None
    if split_gm is not None:
        tap_parts(split_gm, split, lambda tap: GradientTap(None, tap.param, tap.part))  # as the backend does
    writer.write_graph(folder, graph=name, captured=captured.gm, plan=plan, split=split, split_gm=split_gm)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    modules = {n: m for n, m in split_gm.named_children() if n.startswith("submod_")} if split_gm is not None else {"graph": captured.gm}
    # Inputs of each segment: run the stitched module once with an interpreter that records them, in fake mode.
    inputs = _segment_inputs(split_gm, captured.example_inputs, fake_mode) if split_gm is not None else {"graph": captured.example_inputs}
    writer.write_aot(folder, {n: (m, inputs[n]) for n, m in modules.items()}, fake_mode)


def _segment_inputs(split_gm: Any, example_inputs: list[Any], fake_mode: Any) -> dict[str, list[Any]]:
    recorded: dict[str, list[Any]] = {}

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            recorded[str(target)] = list(args)
            return super().call_module(target, args, kwargs)

    with fake_mode:
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        Recorder(split_gm).run(*fakes)
    return recorded


def _shorten(rows: list[list[Any]], width: int = 70) -> list[list[Any]]:
    return [r[:-1] + [r[-1] if len(r[-1]) <= width else r[-1][: width - 3] + "..."] for r in rows]


def render(inspection: Inspection, fmt: str) -> str:
    return json.dumps(inspection.record(), indent=2) if fmt == "json" else inspection.text()
