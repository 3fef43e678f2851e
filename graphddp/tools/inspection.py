"""``graphddp inspect TARGET``: the bucket plan and split of a model, in one process, with no ranks.

TARGET is a built-in workload (``gpt``, ``mlp``, ``cnn``) or ``package.module:factory``, a function returning
``(model, example_inputs)``. The model is captured with Dynamo once, and the same pipeline the backend runs
(``graphddp.compiler.graph_pipeline``) produces the plan: the result equals what ``graphddp.backend`` adopts in a real run
with the same caps. Nothing is compiled; ``--dump`` traces the AOT graphs of each segment.

Caps left to ``"auto"`` are chosen for each graph as the compiled path chooses them (Note [Automatic caps] in
``graphddp.passes.caps_choice``), from the inspected graph and a link and world size given rather than measured:
there are no ranks to calibrate on.
"""

from __future__ import annotations

import dataclasses
import json
import pkgutil
import re
from typing import Any

import torch
from tabulate import tabulate
from torch import fx, nn

from ..compiler.capture import capture_graphs, parameter_names
from ..compiler.dump import DebugDump, versions
from ..compiler.graph_pipeline import PreparedGraph, lower_graph, prepare_graph
from ..options import AUTO, BucketOptions
from ..passes import (
    BucketCaps,
    BucketPlan,
    CapsChoice,
    CapsSearch,
    ComputeRates,
    GraphParam,
    GraphSplit,
    LinkModel,
    MiB,
    ParamSpec,
    PiecesLayout,
    Prediction,
    ReductionChoice,
    StepInputs,
    bucket_channel,
    check_reduction,
    choose_channels,
    choose_graph_caps,
    choose_reduction,
    compose_plans,
    embedding_tables,
    estimated_in_pieces,
    estimated_step_inputs,
    forward_seconds,
    plan_blockers,
    predict_step,
    rate_bits_per_second,
    rows_apply,
)
from ..passes.report import BUCKET_HEADERS, SEGMENT_HEADERS, bucket_rows, plan_record, segment_rows
from ..runtime.calibration import measure_compute_rates
from ..runtime.rows_rule import RowsRule, charges_gloo_cpu
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
    caps_choice: CapsChoice | None = None
    """With ``auto`` caps: the choice that planned this graph, and the candidates it was chosen from."""
    reduction: ReductionChoice | None = None
    """How a compiled run reduces this graph (``graphddp.passes.choose_reduction``, Note [In-graph reduction])."""
    channels_choice: tuple[int, dict[int, float]] | None = None
    """With ``--link``: the channels the step cost model picks for this graph and each candidate's predicted step
    (``graphddp.passes.choose_channels``, Note [Step cost model])."""


def parse_link(text: str) -> LinkModel:
    """``RATE[:LATENCY]`` such as ``2gbit`` or ``10gbit:20us`` (default latency 50 us) as a link model."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit(?::(\d+(?:\.\d+)?)(us|ms))?", text.strip().lower())
    if not m:
        raise ValueError(f"--link must be RATE[:LATENCY] such as 2gbit or 10gbit:20us, got {text!r}")
    rate = rate_bits_per_second(f"{m.group(1)}{m.group(2)}bit")
    latency = 50e-6 if m.group(3) is None else float(m.group(3)) * (1e-6 if m.group(4) == "us" else 1e-3)
    return LinkModel.of_rate(rate, latency_s=latency)


def graph_step_inputs(
    gm: fx.GraphModule, split: GraphSplit, rates: ComputeRates, *, channels: int = 1, cpu_seconds_per_byte: float = 0.0
) -> StepInputs:
    """The step cost model's inputs for one graph: compute estimated from the graph at this machine's rates
    (Note [Step cost model]), each byte sent costing the compute ``cpu_seconds_per_byte`` and each bucket
    ``rates.reducer_seconds_per_bucket`` (its Python and its launch), as the automatic caps search charges them;
    the optimizer is not in them."""
    node_seconds = forward_seconds(gm, rates)
    inputs = estimated_step_inputs(
        split, node_seconds, cpu_seconds_per_byte=cpu_seconds_per_byte, cpu_seconds_per_bucket=rates.reducer_seconds_per_bucket
    )
    return dataclasses.replace(inputs, forward_s=sum(node_seconds.values()), channels=channels)


def in_graph_step_inputs(
    gm: fx.GraphModule, prepared: PreparedGraph, rates: ComputeRates, *, cpu_seconds_per_byte: float = 0.0
) -> tuple[StepInputs, PiecesLayout]:
    """``graph_step_inputs`` for a graph reduced in-graph: its big gradients sent in blocks as their matmuls
    compute them (``graphddp.passes.estimated_in_pieces``, as the automatic caps search predicts them; Note
    [Gradient pieces])."""
    inputs = graph_step_inputs(gm, prepared.split, rates, cpu_seconds_per_byte=cpu_seconds_per_byte)
    return estimated_in_pieces(inputs, prepared.plan, prepared.params, forward_seconds(gm, rates), rates)


def predict_graph(
    gm: fx.GraphModule, split: GraphSplit, link: LinkModel, world_size: int, rates: ComputeRates, *, channels: int = 1
) -> Prediction:
    """One graph's step on ``link``, its buckets on ``channels`` process groups in turn."""
    inputs = graph_step_inputs(gm, split, rates, channels=channels)
    return _numbered_as_the_split(predict_step(inputs, link, world_size), split.num_segments)


def _numbered_as_the_split(p: Prediction, count: int, layout: PiecesLayout | None = None) -> Prediction:
    """The cost model numbers segments in the order backward runs them; inspect's tables number them as the split
    does (``segment 0`` first in forward, last in backward): one numbering in all of inspect's output. With
    ``layout`` (a graph's blocks, ``in_graph_step_inputs``), a block's nodes say which bucket and block they are."""

    def name(node: str) -> str:
        node = layout.name(node) if layout is not None else node
        kind, _, rest = node.partition(" ")
        position, _, block = rest.partition(" ")
        return f"segment {count - 1 - int(position)}" + (f" {block}" if block else "") if kind == "segment" else node

    return dataclasses.replace(p, timeline={name(n): t for n, t in p.timeline.items()}, critical_path=tuple(map(name, p.critical_path)))


@dataclasses.dataclass(frozen=True)
class Inspection:
    target: str
    graphs: list[GraphReport]
    plan: BucketPlan
    """The plan the Reducer would run: the graphs' plans composed (see ``graphddp.runtime.plans``)."""
    channels: int = 1
    """Process groups the buckets go on in turn (Note [Channels] in ``graphddp.runtime.channels``)."""

    def record(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "fingerprint": self.plan.fingerprint,
            "graphs": [
                plan_record(g.plan, g.split, graph=g.name, versions=versions())
                | {"reduction": str(g.reduction) if g.reduction is not None else None}
                | _prediction_record(g.prediction)
                | _choice_record(g.caps_choice)
                | _channels_record(g.channels_choice)
                for g in self.graphs
            ],
            "channels": self.channels,
            "buckets": [
                {"index": b.index, "bytes": b.nbytes, "params": list(b.names), "channel": bucket_channel(b.index, self.channels)}
                for b in self.plan.buckets
            ],
            "versions": versions(),
        }

    def text(self) -> str:
        parts = []
        for g in self.graphs:
            parts.append(f"{g.name}: {len(g.plan.buckets)} buckets, {g.split.num_segments} segments")
            if g.reduction is not None:
                parts.append(f"reduction: {g.reduction}")
            if g.caps_choice is not None:
                parts.append(_choice_text(g.caps_choice))
            parts.append(tabulate(_shorten(bucket_rows(g.plan, g.split)), headers=BUCKET_HEADERS))
            parts.append("")
            parts.append(tabulate(segment_rows(g.split), headers=SEGMENT_HEADERS))
            parts.append("")
            if g.prediction is not None:
                parts += [_prediction_text(g.prediction), ""]
            if g.channels_choice is not None:
                pick, steps = g.channels_choice
                candidates = ", ".join(f"{k}: {seconds * 1e3:.1f} ms" for k, seconds in steps.items())
                parts += [f"channels the model picks: {pick} (predicted step by channels: {candidates})", ""]
        parts.append(f"fingerprint {self.plan.fingerprint} ({len(self.plan.buckets)} buckets in all)")
        if self.channels > 1:
            parts.append(f"{self.channels} channels: bucket i is reduced on process group i % {self.channels} (Note [Channels])")
        return "\n".join(parts)


def inspect_target(
    target: str,
    *,
    bucket_cap_mb: float | str = 25,
    first_bucket_cap_mb: float | str = 1,
    last_bucket_cap_mb: float | str = 1,
    bucket_ramps: bool = True,
    bucket_cap_mb_list: tuple[float, ...] | None = None,
    sparse_embedding_grads: bool | str = AUTO,
    world_size: int = 2,
    batch: int | None = None,
    size: str = "small",
    dump: str | None = None,
    link: str | None = None,
    reduction: str = "auto",
    channels: int | str = 1,
    comm_cpu_ms_per_mb: float = 0.0,
    launch_us: float = 0.0,
) -> Inspection:
    """The plan and split of ``target`` as a run with these options makes them (the CLI's flags, by name).
    ``comm_cpu_ms_per_mb``: the compute each MB sent costs a rank, as a CPU run measures and logs it ("communication
    costs X ms of compute per MB"); charged, on ``link``, to a tied table's part (the rows verdict), to automatic
    caps and to the predictions. 0: not charged (without ranks nothing measures it). ``launch_us``: what launching
    one collective costs the backward's thread, as a run logs it ("launching a collective costs X us"), charged, on
    ``link``, to every bucket, by automatic caps and in the predictions (``ComputeRates.launch_s``); 0: not
    charged."""
    options = BucketOptions(
        bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb, last_bucket_cap_mb=last_bucket_cap_mb,
        bucket_ramps=bucket_ramps, bucket_cap_mb_list=bucket_cap_mb_list, sparse_embedding_grads=sparse_embedding_grads,
        channels=channels,
    )  # fmt: skip
    caps = options.caps  # with "auto": the stand-ins a run plans with until it has chosen
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world size must be a whole number, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    link_model = parse_link(link) if link is not None else None
    cpu = _comm_cpu_seconds_per_byte(comm_cpu_ms_per_mb, link_model)
    launch = _launch_seconds(launch_us, link_model)
    # As graphddp.DDP decides: one rank communicates nothing, so its automatic caps keep the stand-ins.
    search = options.caps_search if world_size > 1 else None
    fixed_channels = options.channels if isinstance(options.channels, int) else None  # None: "auto", per graph
    if fixed_channels is None and link_model is None:
        raise InspectError(
            "channels='auto' are chosen for a link: give the link to plan for with --link RATE[:LATENCY] (e.g. "
            "--link 10gbit:20ms), or a number of channels"
        )
    if search is not None and link_model is None:
        raise InspectError(
            "automatic caps are chosen for a link and a world size: give the link to plan for with --link "
            "RATE[:LATENCY] (e.g. --link 10gbit or --link 10gbit:20us) and the ranks with --world-size"
        )
    check_reduction(reduction)
    model, inputs = load_target(target, batch=batch, size=size)
    names = parameter_names(model)
    if not names:
        raise InspectError(f"{target}: the model has no parameter that requires a gradient; there is nothing to plan")
    writer = DebugDump(dump) if dump is not None else None
    # As graphddp.DDP decides for a CPU model under the default comm hook; "auto" on the link given (without one,
    # rows wherever they apply, as True: Note [Row-sparse gradients], "When rows pay").
    rows_on = rows_apply(enabled=sparse_embedding_grads is not False, world_size=world_size, device="cpu", custom_comm_hook=False)
    rates = dataclasses.replace(measure_compute_rates(), launch_s=launch) if link_model is not None else None
    measured = link_model if not isinstance(sparse_embedding_grads, bool) else None
    # gloo's CPU where a CPU run charges it: measured by automatic caps, else for a tied table's part only.
    charged = measured is not None and charges_gloo_cpu(model, frozenset(), cpu_group=True, automatic_caps=search is not None)
    rows = RowsRule(enabled=sparse_embedding_grads, link=measured, world=world_size, cpu_seconds_per_byte=cpu if charged else 0.0)

    def row_sparse(params: list[GraphParam]) -> bool:
        return rows_on and rows.for_graph(params)

    auto = None  # with "auto": each graph's caps chosen for it, as in a compiled run
    if search is not None and link_model is not None and rates is not None:
        auto = GraphCapsChooser(
            search, link=link_model, rates=rates, world=world_size, cpu_seconds_per_byte=cpu,
            blocks=choose_reduction(reduction, []).strategy == "in_graph",  # as the backend asks (a plan's blockers aside)
        )  # fmt: skip
    graph_caps = auto.for_graph if auto is not None else caps
    graphs = []
    for i, captured in enumerate(capture_graphs(model, *inputs)):
        prepared = prepare_graph(captured.gm, captured.example_inputs, names, caps=graph_caps, row_sparse=row_sparse)
        if prepared is None:
            continue
        prediction = channels_choice = None
        # As the backend decides for a DDP with the default comm hook and options, and an AOTAutograd compiler.
        strategy = choose_reduction(reduction, plan_blockers(prepared.plan))
        if link_model is not None and rates is not None:
            layout = None
            if strategy.strategy == "in_graph" and world_size > 1 and any(b.pieces for b in prepared.plan.buckets):
                inputs, layout = in_graph_step_inputs(captured.gm, prepared, rates, cpu_seconds_per_byte=cpu)
            else:
                inputs = graph_step_inputs(captured.gm, prepared.split, rates, cpu_seconds_per_byte=cpu)
            channels_choice = choose_channels(dataclasses.replace(inputs, cpu_seconds_per_byte=0.0), link_model, world_size)  # as a run picks
            on = dataclasses.replace(inputs, channels=fixed_channels or channels_choice[0])
            prediction = _numbered_as_the_split(predict_step(on, link_model, world_size), prepared.split.num_segments, layout)
        choice = auto.choice_for(captured.gm) if auto is not None else None
        graphs.append(GraphReport(f"graph{i}", prepared.plan, prepared.split, prediction, choice, strategy, channels_choice))
        if writer is not None:
            lower_graph(prepared, captured.gm, captured.example_inputs, name=f"graph{i}", dump=writer)
    candidates = embedding_tables(model) if rows_on else frozenset()
    tables = rows.eager_tables({n: (p.shape, p.dtype) for n, p in model.named_parameters() if n in candidates})
    specs = [ParamSpec.of(n, p, row_sparse=n in tables) for n, p in model.named_parameters() if p.requires_grad]
    # Graphs are captured in the order forward runs them, as the Reducer composes them (graphddp.runtime.plans),
    # with the caps in force (with "auto", the stand-ins: each graph's own plan carries its chosen caps).
    plan = compose_plans([g.plan for g in graphs], specs[::-1], caps=caps)
    picked = next((g.channels_choice[0] for g in graphs if g.channels_choice is not None), 1)
    return Inspection(target, graphs, plan, channels=fixed_channels or picked)


class GraphCapsChooser:
    """``"auto"`` caps for each captured graph, chosen as ``graphddp.runtime.auto_caps.AutoCaps.for_graph`` chooses
    them in a compiled run (Note [Automatic caps]), with the link and world size given instead of calibrated on a
    process group. Communication's cost in CPU compute is not measured without ranks: the one given
    (``--comm-cpu``), or nothing."""

    def __init__(
        self, search: CapsSearch, *, link: LinkModel, rates: ComputeRates, world: int, cpu_seconds_per_byte: float = 0.0,
        blocks: bool = False,
    ) -> None:
        self.search = search
        self.blocks = blocks
        """Graphs are reduced in-graph on more than one rank: big gradients go in blocks (``choose_graph_caps``)."""
        self.link = link
        self.rates = rates
        self.world = world
        self.cpu_seconds_per_byte = cpu_seconds_per_byte
        self._choices: dict[int, CapsChoice] = {}  # id of the graph -> its choice

    def for_graph(self, gm: fx.GraphModule, params: list[GraphParam], row_sparse: bool) -> BucketCaps:
        """``prepare_graph``'s ``caps``: the choice for ``gm`` (its tables as rows or not), remembered for the report."""
        choice = choose_graph_caps(
            gm, params, self.search, rates=self.rates, link=self.link, world=self.world, row_sparse=row_sparse,
            cpu_seconds_per_byte=self.cpu_seconds_per_byte, blocks=self.blocks,
        )  # fmt: skip
        self._choices[id(gm)] = choice
        return choice.caps

    def choice_for(self, gm: fx.GraphModule) -> CapsChoice | None:
        return self._choices.get(id(gm))


def _comm_cpu_seconds_per_byte(ms_per_mb: float, link: LinkModel | None) -> float:
    """``--comm-cpu`` checked: ms of compute per MB sent, as seconds per byte (the same number, 1e-9 apart)."""
    return _charged_on_link(ms_per_mb, flag="--comm-cpu", unit="ms per MB", link=link) * 1e-9  # 1 ms per MB is 1 ns/B


def _launch_seconds(launch_us: float, link: LinkModel | None) -> float:
    """``--launch-us`` checked: µs of one collective's launch, as seconds."""
    return _charged_on_link(launch_us, flag="--launch-us", unit="microseconds", link=link) * 1e-6


def _charged_on_link(value: float, *, flag: str, unit: str, link: LinkModel | None) -> float:
    """A cost a run measures on its ranks and inspect is given (``flag``, in ``unit``): a finite number >= 0, and
    only with a link to charge it on."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{flag} must be a number of {unit}, got {type(value).__name__} {value!r}")
    if not 0 <= value < float("inf"):
        raise ValueError(f"{flag} must be a finite number of {unit} >= 0, got {value}")
    if value and link is None:
        raise InspectError(
            f"{flag} is charged on a link: give the link to plan for with --link RATE[:LATENCY] (e.g. --link 5gbit)"
        )
    return value


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
        factory = pkgutil.resolve_name(target)  # package.module:factory, as entry points name objects
    except AttributeError:
        raise InspectError(f"{module_name!r} has no callable {factory_name!r}") from None
    except Exception as e:
        raise InspectError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
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
        "critical path (segments numbered as in the segment table; backward runs them last to first): " + " -> ".join(p.critical_path),
        tabulate(rows, headers=["predicted timeline", "start ms", "end ms"]),
    ])  # fmt: skip


def _prediction_record(p: Prediction | None) -> dict[str, Any]:
    if p is None:
        return {}
    timeline = {node: [start, end] for node, (start, end) in p.timeline.items()}
    return {"prediction": {"step_s": p.step_s, "exposed_s": p.exposed_s, "critical_path": list(p.critical_path), "timeline": timeline}}


def _channels_record(choice: tuple[int, dict[int, float]] | None) -> dict[str, Any]:
    if choice is None:
        return {}
    return {"channels_choice": {"channels": choice[0], "predicted_s": {str(k): s for k, s in choice[1].items()}}}


def _choice_text(choice: CapsChoice) -> str:
    return (
        f"automatic caps (Note [Automatic caps]): {_mb(choice.caps)}; predicted backward with its all-reduces: "
        f"{choice.describe()}"
    )


def _choice_record(choice: CapsChoice | None) -> dict[str, Any]:
    if choice is None:
        return {}
    ranking = [{"caps": dataclasses.asdict(caps), "predicted_s": seconds} for caps, seconds in choice.ranking]
    return {
        "automatic_caps": {
            "caps": dataclasses.asdict(choice.caps), "predicted_s": choice.predicted_s, "ranking": ranking,
            "kept_standing": choice.kept_standing, "worst_regret": choice.worst_regret,
            "robust": dataclasses.asdict(choice.robust) if choice.robust is not None else None,
        }
    }  # fmt: skip


def _mb(caps: BucketCaps) -> str:
    """Caps as ``bucket/first/last MiB``, as the runtime's automatic-caps log lines write them."""
    return f"{caps.bucket / MiB:g}/{caps.first / MiB:g}/{caps.last / MiB:g} MiB"


def _shorten(rows: list[list[Any]], width: int = 70) -> list[list[Any]]:
    return [r[:-1] + [r[-1] if len(r[-1]) <= width else r[-1][: width - 3] + "..."] for r in rows]


def render(inspection: Inspection, fmt: str) -> str:
    return json.dumps(inspection.record(), indent=2) if fmt == "json" else inspection.text()
