"""``graphddp inspect TARGET``: the bucket plan and split of a model, in one process, with no ranks.

TARGET is a built-in workload (``gpt``, ``mlp``, ``cnn``) or ``package.module:factory``, a function returning
``(model, example_inputs)``. The model is captured with Dynamo once, and the same pipeline the backend runs
(``graphddp.compiler.graph_pipeline``) produces the plan: the result equals what ``graphddp.backend`` adopts in a real run
with the same caps. Nothing is compiled; ``--dump`` traces the AOT graphs of each segment.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from typing import Any

import torch
from tabulate import tabulate
from torch import fx, nn

from ..compiler.capture import capture_graphs, parameter_names
from ..compiler.dump import DebugDump, versions
from ..compiler.graph_pipeline import lower_graph, prepare_graph
from ..passes import (
    BucketCaps,
    BucketPlan,
    ComputeRates,
    GraphSplit,
    LinkModel,
    ParamSpec,
    Prediction,
    compose_plans,
    embedding_tables,
    estimated_step_inputs,
    forward_seconds,
    predict_step,
    rate_bits_per_second,
    rows_apply,
)
from ..passes.report import BUCKET_HEADERS, SEGMENT_HEADERS, bucket_rows, plan_record, segment_rows
from ..runtime.calibration import measure_compute_rates
from .workloads import SIZES, WORKLOADS, build_workload


class InspectError(Exception):
    """A problem with TARGET: reported as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class GraphReport:
    name: str
    plan: BucketPlan
    split: GraphSplit
    prediction: Prediction | None = None
    """With ``--link``: the step cost model's timeline of this graph's forward, backward and all-reduces."""


def parse_link(text: str) -> LinkModel:
    """``RATE[:LATENCY]`` such as ``2gbit`` or ``10gbit:20us`` (default latency 50 us) as a link model."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit(?::(\d+(?:\.\d+)?)(us|ms))?", text.strip().lower())
    if not m:
        raise ValueError(f"--link must be RATE[:LATENCY] such as 2gbit or 10gbit:20us, got {text!r}")
    rate = rate_bits_per_second(f"{m.group(1)}{m.group(2)}bit")
    latency = 50e-6 if m.group(3) is None else float(m.group(3)) * (1e-6 if m.group(4) == "us" else 1e-3)
    return LinkModel.of_rate(rate, latency_s=latency)


def predict_graph(gm: fx.GraphModule, split: GraphSplit, link: LinkModel, world_size: int, rates: ComputeRates) -> Prediction:
    """One graph's step on ``link``: compute estimated from the graph at this machine's rates (Note [Step cost
    model]); the optimizer is not in it."""
    node_seconds = forward_seconds(gm, rates)
    inputs = dataclasses.replace(estimated_step_inputs(split, node_seconds), forward_s=sum(node_seconds.values()))
    return predict_step(inputs, link, world_size)


@dataclasses.dataclass(frozen=True)
class Inspection:
    target: str
    graphs: list[GraphReport]
    plan: BucketPlan
    """The plan the Reducer would run: the graphs' plans composed (see ``graphddp.runtime.plans``)."""

    def record(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "fingerprint": self.plan.fingerprint,
            "graphs": [
                plan_record(g.plan, g.split, graph=g.name, versions=versions()) | _prediction_record(g.prediction) for g in self.graphs
            ],
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
            if g.prediction is not None:
                parts += [_prediction_text(g.prediction), ""]
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
    link: str | None = None,
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
    # As graphddp.DDP decides for a CPU model under the default comm hook.
    row_sparse = rows_apply(enabled=sparse_embedding_grads, world_size=world_size, device="cpu", custom_comm_hook=False)
    link_model = parse_link(link) if link is not None else None
    rates = measure_compute_rates() if link_model is not None else None
    graphs = []
    for i, captured in enumerate(capture_graphs(model, *inputs)):
        prepared = prepare_graph(captured.gm, captured.example_inputs, names, caps=caps, row_sparse=row_sparse)
        if prepared is None:
            continue
        prediction = None
        if link_model is not None and rates is not None:
            prediction = predict_graph(captured.gm, prepared.split, link_model, world_size, rates)
        graphs.append(GraphReport(f"graph{i}", prepared.plan, prepared.split, prediction))
        if writer is not None:
            lower_graph(prepared, captured.gm, captured.example_inputs, name=f"graph{i}", dump=writer)
    tables = embedding_tables(model) if row_sparse else frozenset()
    specs = [ParamSpec.of(n, p, row_sparse=n in tables) for n, p in model.named_parameters() if p.requires_grad]
    # Graphs are captured in the order forward runs them, as the Reducer composes them (graphddp.runtime.plans).
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


def _prediction_text(p: Prediction) -> str:
    rows = [[node, f"{start * 1e3:.1f}", f"{end * 1e3:.1f}"] for node, (start, end) in sorted(p.timeline.items(), key=lambda kv: kv[1])]
    return "\n".join([
        f"predicted step (forward, backward, all-reduces; no optimizer): {p.step_s * 1e3:.1f} ms, of which "
        f"{p.exposed_s * 1e3:.1f} ms communication not hidden by backward (Note [Step cost model])",
        "critical path (segments numbered in the order backward runs them): " + " -> ".join(p.critical_path),
        tabulate(rows, headers=["predicted timeline", "start ms", "end ms"]),
    ])  # fmt: skip


def _prediction_record(p: Prediction | None) -> dict[str, Any]:
    if p is None:
        return {}
    timeline = {node: [start, end] for node, (start, end) in p.timeline.items()}
    return {"prediction": {"step_s": p.step_s, "exposed_s": p.exposed_s, "critical_path": list(p.critical_path), "timeline": timeline}}


def _shorten(rows: list[list[Any]], width: int = 70) -> list[list[Any]]:
    return [r[:-1] + [r[-1] if len(r[-1]) <= width else r[-1][: width - 3] + "..."] for r in rows]


def render(inspection: Inspection, fmt: str) -> str:
    return json.dumps(inspection.record(), indent=2) if fmt == "json" else inspection.text()
