"""Choose bucket caps from the step cost model: ``bucket_cap_mb="auto"``.

Note [Automatic caps]
~~~~~~~~~~~~~~~~~~~~~
Small buckets start communicating early in backward but pay the link's latency once each; large ones pay it
rarely but leave more to send after backward. Which wins depends on the link (α, β), the world size and where
in backward the gradients become ready, all of which the step cost model (Note [Step cost model] in
``passes/cost.py``) takes. So each cap the user leaves to ``"auto"`` is searched over a fixed grid
(``MIDDLE_MB`` for ``bucket_cap_mb``, ``EDGE_MB`` for the first and last), every combination is planned exactly
as a run would plan it, its step predicted at several compute speeds, and the candidate closest to the fastest at
every speed ("Robust to the compute rate", below) kept where it beats the caps that stand without a choice by more
than ``CAPS_MARGIN`` ("A margin", below); ties go to the earlier candidate, whose caps are larger (fewer
collectives, less per-bucket overhead the model does not see).

Where the gradients become ready comes from one of two sources:

* **measured** (eager): the seconds from the end of forward to each parameter's gradient hook in the first
  synchronised backward (``step_inputs_from_ready_times``);
* **estimated** (compiled): each segment's backward from the captured graph's shapes and the device's rates
  (``graphddp.passes.graph_cost``), because the split must be chosen while Dynamo compiles, before anything
  ran (``step_inputs_from_split``). Where the graph will be reduced in-graph on more than one rank, a gradient
  larger than its cap goes in blocks as its matmul computes them (Note [Gradient pieces]), and each candidate
  is predicted so (``step_inputs_in_pieces``): a cap decides how early such a gradient starts to travel, which
  a search that saw it whole missed (gpt at 1 Gbit/s: 100 MiB chosen, where the runs put 8 MiB ahead of it).

Every measured input is agreed by all ranks before the choice (rank 0's measurements, broadcast), and the search
is deterministic, so every rank chooses the same caps without a further collective. One input is a rank's own: a
compiled graph's shapes, which the estimate reads, and which may differ between ranks whose first compiled inputs
differ in shape (each rank padded to its own longest sequence). Those ranks may choose other caps, and so propose
other plans; the plan agreement finds it (Note [Plan agreement] in ``graphddp/runtime/plans.py``) and says so,
naming each rank's caps for that graph: every rank adopts rank 0's plan and reduces split, or, where the plans
hold parts of tied tables, which name one rank's graph nodes, every rank raises (with
``find_unused_parameters``, warns and keeps the plan in force). Inputs of one shape on every rank, or fixed caps,
avoid it. A rank's own too: the comm hook it registered, whose wire dtype the prediction takes; ranks that register
different hooks issue different collectives anyway. The buckets are predicted as sent (``sent_bytes``): under a
compressing comm hook (``fp16_compress_hook``, ``bf16_compress_hook``:
``graphddp.runtime.reductions.CommHook.wire_dtype``) in its dtype, a big gradient's blocks cast for the wire and
every one copied back after the last, not written in place (``step_inputs_in_pieces``); the casts themselves are
not charged. A hook registered after the choice leaves the caps as chosen, and says so.

**A margin, as the other planners keep.** The search returns its candidate only where its predicted step
beats the caps that stand without a choice (``CapsSearch.standing``: the user's fixed caps and the defaults for the
others) by more than ``CAPS_MARGIN`` of that step; otherwise the standing caps stay. Where the link does not bind,
every candidate predicts within a fraction of a percent of every other, and the fastest of them is chosen by the
model's rounding, not by the step: in the session 38 matrix, caps chosen on predicted gains of 0.1-2.4 % (gpt at 5
Gbit/s: 64/64/0.25 MiB; cnn: 2/2/2 MiB) ran level with the defaults or 13-38 % slower, and in session 39 cnn's 2/2/2
MiB, chosen on 2.4-3.8 %, ran 7-25 % slower; gpt at 1 Gbit/s, predicted ~10 % faster at 4-8 MiB, ran 7-15 % faster.
``choose_channels`` and ``choose_optimizer_overlap`` keep their defaults below a margin for the same reason: what
the model does not see (the CPUs gloo shares, a collective's fixed costs in-graph) moves a step by more than such a
lead.

**Robust to the compute rate.** The compute rate a run calibrates (or the backward it times) is what the machine
did at that moment, not a fixed figure: the construction's 512³ matmul measured 51, 79 and 97 Gflop/s in three
runs of the bench on one VM type, and 81-103 in twelve tries on a quiet machine, where each try's own spread was
small. gloo's CPU per byte is measured on its own (Note [What communication costs a CPU rank]) and not varied
here: offline, over all eight combinations of session 42's two runs' inputs, the rates alone moved the choice.
Where the link binds, the fastest candidate at one rate is often not the fastest at another, while many lie within
a few percent of each other: gpt at 1 Gbit/s, two runs in session 42, chose 4/0.25/4 MiB at 79 Gflop/s
and 8/1/8 at 97, each within 2 % of the other's choice, and the choice moved to 2/2/2, 2/1/2, 8/4/8, 16/0.25/16
or the defaults as the same run's rate was scaled by 0.7-1.4. So the search predicts every candidate at each of
``COMPUTE_SPEEDS`` (the calibrated rate times 1/1.4 to 1.4: compute durations divided by the factor, the link and
gloo's CPU per byte as measured, ``StepInputs.at_compute_speed``) and chooses the candidate whose predicted step
is the closest to the fastest one's at every speed: the smallest worst-case regret, ``max_s (t_c(s) / min_c'
t_c'(s) - 1)``, ties to the earlier candidate. Both of session 42's runs then choose the same caps (4/1/4 MiB
with the model of session 43), at most 2.3 % off the fastest at any speed in either run, where their former
choices were up to 2.9 % (4/0.25/4) and 4.3 % (8/1/8) off, and 0.4 % and 1.3 % slower than the fastest at their
measured rates. Two runs whose rates differ by more than the band (51 and 97 Gflop/s: their bands do not meet)
may still choose differently. The margin compares that candidate, not the fastest, with the standing caps at the
measured rate (``CapsChoice.robust``, which the record keeps beside a kept choice); once chosen, it is at most its
worst regret behind the standing caps at any speed searched. Five speeds cost the search about twice its time (the
plans are made once per candidate, only the predictions five times): 0.95-1.13 s against 0.44-0.52 s for the bench
gpt's 102 candidates, once per compiled graph and once at the first backward (each choice logs its search time; the
record leaves it out, so that every rank's record is the same but for its rank).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import fx

from .cost import LinkModel, StepInputs, check_margin, predict_step
from .graph_cost import ComputeRates, forward_seconds, segment_backward_seconds
from .graph_params import GraphParam
from .pieces_cost import estimated_in_pieces
from .plan import BucketCaps, ParamSpec, plan_buckets
from .plan_graph import plan_graph
from .split import GraphSplit

CAPS_MARGIN = 0.05
"""The predicted gain below which the standing caps stay (Note [Automatic caps], "A margin"): a share of their
predicted step, as ``choose_channels``'s. Set from two matrices (2 ranks, gpt/mlp/cnn at 1 and 5 Gbit/s), their
choices predicted again offline in session 39: in session 38, the five cells chosen on gains of 0.1-2.4 % ran level
with the defaults or 13-38 % slower, and gpt at 1 Gbit/s, chosen on 8.6-10.9 %, gained 7-15 % in every round; in
session 39, with a 3 % margin, cnn at 1 Gbit/s was still chosen (2/2/2 MiB, on a gain of 2.4-3.8 %: 2.4-2.7 % at the
rates this VM measures, 3.8 % at the 1.5e11 flop/s a run's calibration can reach) and ran 7-25 % slower than the
defaults, while the cells kept at the defaults ran level with them."""

COMPUTE_SPEEDS = (1 / 1.4, 1 / 1.2, 1.0, 1.2, 1.4)
"""The compute speeds, as multiples of the calibrated one, at which the search predicts every candidate (Note
[Automatic caps], "Robust to the compute rate"): a band of 1.4 either way, wide enough to hold session 42's two
runs' rates (79 and 97 Gflop/s) in each other's band, not every rate this VM type measured (51-103); 1.0, the
measured rate, is where the margin is judged."""

MIDDLE_MB = (100.0, 64.0, 25.0, 16.0, 8.0, 4.0, 2.0, 1.0)
"""Candidates for ``bucket_cap_mb``, largest first (ties go to larger caps)."""
EDGE_MB = (4.0, 1.0, 0.25)
"""Candidates for the first and last buckets' caps, besides the middle cap itself (no ramp at that end)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapsSearch:
    """Which caps to search (None) and which the user fixed (MiB)."""

    bucket_mb: float | None = None
    first_mb: float | None = None
    last_mb: float | None = None
    ramps: bool = True
    standing: BucketCaps | None = None
    """The caps planned until a choice is made (``BucketOptions.caps``: the fixed ones, the defaults for the
    others), kept unless the search's candidate beats them by more than ``CAPS_MARGIN`` (Note [Automatic caps]).
    None: the search's candidate, however small its lead."""

    def searched(self) -> tuple[str, ...]:
        """The options left to ``"auto"``, as users write them."""
        names = (("bucket_cap_mb", self.bucket_mb), ("first_bucket_cap_mb", self.first_mb), ("last_bucket_cap_mb", self.last_mb))
        return tuple(name for name, mb in names if mb is None)

    def candidates(self) -> list[BucketCaps]:
        """Every combination of the searched caps with the fixed ones, larger caps first."""
        candidates = []
        for middle in MIDDLE_MB if self.bucket_mb is None else (self.bucket_mb,):
            edges = [middle] + [e for e in EDGE_MB if e < middle]
            for first, last in itertools.product(
                edges if self.first_mb is None else (self.first_mb,), edges if self.last_mb is None else (self.last_mb,)
            ):
                candidates.append(BucketCaps.from_mb(middle, first, last, ramps=self.ramps))
        return candidates


@dataclasses.dataclass(frozen=True)
class CapsChoice:
    caps: BucketCaps
    predicted_s: float
    """Predicted seconds of the backward-and-communication part of the step with ``caps``."""
    ranking: tuple[tuple[BucketCaps, float], ...]
    """Every candidate, and the standing caps where they are off the grid, with its prediction at the measured
    rates, fastest first (for logs and tests)."""
    kept_standing: bool = False
    """The standing caps stayed: the search's candidate (``robust``) was not predicted faster than them by more
    than ``margin`` (Note [Automatic caps])."""
    margin: float = CAPS_MARGIN
    """The share of the standing caps' step a candidate had to gain."""
    robust: BucketCaps | None = None
    """The search's candidate: the one closest to the fastest at every compute speed (Note [Automatic caps],
    "Robust to the compute rate"). ``caps`` unless the standing caps were kept."""
    worst_regret: float = 0.0
    """How far ``robust``'s predicted step is, at worst over the compute speeds searched, from the fastest
    candidate's at that speed (a share of it)."""

    def describe(self, top: int = 3) -> str:
        ranked = ", ".join(f"{_mb(c)} -> {s * 1e3:.1f} ms" for c, s in self.ranking[:top])
        robust = f"within {self.worst_regret:.1%} of the fastest at every compute speed"
        if not self.kept_standing:
            return f"{_mb(self.caps)} -> {self.predicted_s * 1e3:.1f} ms, {robust} (fastest first: {ranked})"
        assert self.robust is not None
        gain = 1 - dict(self.ranking)[self.robust] / self.predicted_s
        return (
            f"kept {_mb(self.caps)} -> {self.predicted_s * 1e3:.1f} ms: {_mb(self.robust)}, {robust}, is faster by "
            f"{gain:.1%}, not more than {self.margin:.0%} (fastest first: {ranked})"
        )


def choose_caps(
    candidates: Sequence[BucketCaps],
    inputs_for: Callable[[BucketCaps], StepInputs],
    link: LinkModel,
    world: int,
    *,
    standing: BucketCaps | None = None,
    margin: float = CAPS_MARGIN,
    speeds: Sequence[float] = COMPUTE_SPEEDS,
) -> CapsChoice:
    """The candidate whose predicted step stays closest to the fastest one's at every compute speed in ``speeds``
    (the first such, on a tie; Note [Automatic caps], "Robust to the compute rate"); with ``standing``, those caps
    unless the choice is shorter at the measured speed by more than ``margin`` (a share of their step)."""
    if not candidates:
        raise ValueError("choosing caps needs at least one candidate")
    check_margin(margin)
    if 1.0 not in speeds:
        raise ValueError(f"the compute speeds searched must include the measured one, 1.0; got {tuple(speeds)}")
    options = [*candidates, *([standing] if standing is not None and standing not in candidates else [])]
    steps = []  # per option: its predicted step at each speed
    for caps in options:
        inputs = inputs_for(caps)
        steps.append([predict_step(inputs.at_compute_speed(speed), link, world).step_s for speed in speeds])
    fastest_at = [min(column) for column in zip(*steps)]
    regrets = [max(_regret(step, fastest) for step, fastest in zip(row, fastest_at)) for row in steps]
    robust = next(k for k, regret in enumerate(regrets) if regret <= min(regrets) + REGRET_TIE)
    measured = list(speeds).index(1.0)
    predicted = [(caps, row[measured]) for caps, row in zip(options, steps)]
    ranking = tuple(sorted(predicted, key=lambda cs: cs[1]))  # stable: ties keep the candidates' order
    chosen, chosen_s = predicted[robust]
    found = {"ranking": ranking, "margin": margin, "robust": chosen, "worst_regret": regrets[robust]}
    if standing is not None:
        standing_s = dict(predicted)[standing]
        if chosen_s >= standing_s * (1 - margin):  # the standing caps themselves too: a margin is never negative
            return CapsChoice(standing, standing_s, kept_standing=True, **found)
    return CapsChoice(chosen, chosen_s, **found)


def _regret(step: float, fastest: float) -> float:
    """How far ``step`` is from the fastest at one speed, a share of the fastest (0 where both are 0)."""
    if fastest > 0:
        return step / fastest - 1
    return 0.0 if step == fastest else float("inf")


REGRET_TIE = 1e-9
"""Worst regrets closer than this are a tie (floating-point rounding of equal predictions), won by the earlier
candidate: larger caps."""


def step_inputs_from_ready_times(
    specs_in_ready_order: Sequence[ParamSpec],
    ready_s: Sequence[float],
    caps: BucketCaps,
    *,
    backward_s: float,
    cpu_seconds_per_byte: float = 0.0,
    cpu_seconds_per_bucket: float = 0.0,
    wire: torch.dtype | None = None,
) -> StepInputs:
    """The step's inputs for buckets planned with ``caps`` over parameters whose gradients became ready
    ``ready_s`` seconds into backward (measured; ``backward_s`` is the whole backward), sent in ``wire``
    (``sent_bytes``)."""
    if len(specs_in_ready_order) != len(ready_s):
        raise ValueError("every parameter needs its ready time")
    buckets = [bucket.params for bucket in plan_buckets(specs_in_ready_order, caps=caps).buckets]
    return step_inputs_from_buckets(
        buckets, dict(zip((p.name for p in specs_in_ready_order), ready_s)), backward_s=backward_s,
        cpu_seconds_per_byte=cpu_seconds_per_byte, cpu_seconds_per_bucket=cpu_seconds_per_bucket, wire=wire,
    )  # fmt: skip


def sent_bytes(params: Sequence[ParamSpec], wire: torch.dtype | None = None) -> int:
    """Bytes one all-reduce of these gradients sends: their own, or every element in ``wire``, the dtype a
    compressing comm hook casts the bucket to (``fp16_compress_hook``: half of fp32 gradients' bytes)."""
    return sum(p.nbytes_in(wire) for p in params)


def step_inputs_from_buckets(
    buckets: Sequence[Sequence[ParamSpec]],
    ready_s: Mapping[str, float],
    *,
    backward_s: float,
    cpu_seconds_per_byte: float = 0.0,
    cpu_seconds_per_bucket: float = 0.0,
    wire: torch.dtype | None = None,
) -> StepInputs:
    """The step's inputs for ``buckets`` (launch order; made by any rule, e.g. PyTorch's DDP's in the bench) over
    parameters whose gradients became ready ``ready_s[name]`` seconds into backward. A bucket is complete when
    its last gradient is, and not before the one launched ahead of it."""
    missing = sorted({p.name for bucket in buckets for p in bucket} - set(ready_s))
    if missing:
        raise ValueError(f"every parameter needs its ready time; none for {missing[:3]}")
    completions, running = [], 0.0
    for bucket in buckets:
        running = max([running, *(ready_s[p.name] for p in bucket)])
        completions.append(min(running, backward_s))
    nbytes = [sent_bytes(bucket, wire) for bucket in buckets]
    inputs = step_inputs_from_completions(completions, nbytes, backward_s, cpu_seconds_per_byte)
    return dataclasses.replace(inputs, cpu_seconds_per_bucket=cpu_seconds_per_bucket)


def step_inputs_from_split(
    split: GraphSplit,
    segment_seconds: Sequence[float],
    *,
    cpu_seconds_per_byte: float = 0.0,
    cpu_seconds_per_bucket: float = 0.0,
    wire: torch.dtype | None = None,
) -> StepInputs:
    """The step's inputs for a graph cut into ``split``: segment ``i``'s backward takes ``segment_seconds[i]``,
    and backward runs the segments last to first; each bucket sent in ``wire`` (``sent_bytes``)."""
    count = split.num_segments
    completed_at = {}  # bucket -> its segment's position in backward order
    for segment in split.segments:
        for k in segment.buckets:
            completed_at[k] = count - 1 - segment.index
    positions, running = [], 0
    for bucket in split.plan.buckets:  # buckets no segment completes (gradients from outside) wait for the end
        running = max(running, completed_at.get(bucket.index, count - 1))
        positions.append(running)
    return StepInputs(
        segment_backward_s=tuple(segment_seconds[count - 1 - p] for p in range(count)),
        bucket_bytes=tuple(sent_bytes(b.params, wire) for b in split.plan.buckets),
        completed_by=tuple(positions),
        cpu_seconds_per_byte=cpu_seconds_per_byte,
        cpu_seconds_per_bucket=cpu_seconds_per_bucket,
    )


def choose_graph_caps(
    gm: fx.GraphModule,
    params: Sequence[GraphParam],
    search: CapsSearch,
    *,
    rates: ComputeRates,
    link: LinkModel,
    world: int,
    row_sparse: bool,
    cpu_seconds_per_byte: float = 0.0,
    blocks: bool = False,
    speeds: Sequence[float] = COMPUTE_SPEEDS,
    wire: torch.dtype | None = None,
) -> CapsChoice:
    """Caps for one captured graph: each candidate planned and cut as the backend would, its segments' backward
    estimated from the graph (Note [Automatic caps]); with ``blocks`` (the graph will be reduced in-graph, on more
    than one rank), a gradient larger than its cap sent block by block as its matmul computes it, as the run
    sends it (``step_inputs_in_pieces``, Note [Gradient pieces]): a smaller cap cuts it into more, earlier blocks.
    ``wire``: the dtype a compressing comm hook sends in (``sent_bytes``)."""
    node_seconds = forward_seconds(gm, rates)

    def inputs_for(caps: BucketCaps) -> StepInputs:
        split = plan_graph(gm, params, caps, row_sparse=row_sparse)
        inputs = estimated_step_inputs(
            split, node_seconds, cpu_seconds_per_byte=cpu_seconds_per_byte, cpu_seconds_per_bucket=rates.reducer_seconds_per_bucket, wire=wire
        )
        if not blocks or world < 2 or all(b.pieces is None for b in split.plan.buckets):  # one rank sends nothing
            return inputs
        return estimated_in_pieces(inputs, split.plan, params, node_seconds, rates, wire=wire)[0]

    return choose_caps(search.candidates(), inputs_for, link, world, standing=search.standing, speeds=speeds)


def estimated_step_inputs(
    split: GraphSplit,
    node_seconds: Mapping[str, float],
    *,
    cpu_seconds_per_byte: float = 0.0,
    cpu_seconds_per_bucket: float = 0.0,
    wire: torch.dtype | None = None,
) -> StepInputs:
    """The step's inputs for a graph cut into ``split``, each segment's backward estimated from its nodes'
    forward seconds (``graphddp.passes.graph_cost``); forward and optimizer left out (the same for every cut)."""
    seconds = segment_backward_seconds(split.partition, node_seconds, split.num_segments)
    return step_inputs_from_split(
        split, seconds, cpu_seconds_per_byte=cpu_seconds_per_byte, cpu_seconds_per_bucket=cpu_seconds_per_bucket, wire=wire
    )


def step_inputs_from_completions(completions: Sequence[float], nbytes: Sequence[int], backward_s: float, cpu: float = 0.0) -> StepInputs:
    """The step's inputs for buckets of ``nbytes`` complete ``completions`` seconds into a backward of
    ``backward_s``: segments between successive completions, and one to the end of backward."""
    edges = sorted(set(completions) | {backward_s})
    starts = [0.0, *edges[:-1]]
    return StepInputs(
        segment_backward_s=tuple(end - start for start, end in zip(starts, edges)),
        bucket_bytes=tuple(nbytes),
        completed_by=tuple(edges.index(c) for c in completions),
        cpu_seconds_per_byte=cpu,
    )


def _mb(caps: BucketCaps) -> str:
    return f"{caps.mb} MiB"


