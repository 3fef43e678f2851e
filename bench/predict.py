"""Predict every mode's iteration with the step cost model (Note [Step cost model] in ``passes/cost.py``), from
what the run measured apart from the mode itself: the link (α-β fit and CPU cost per byte, ``calibration``; and
the cost per byte of putting a gradient sent in pieces back together),
compute alone (``local``'s forward, backward and optimizer; ``local-compiled``'s for a compiled mode, where the run
has it), and where in backward each bucket is complete.

Where buckets complete: a graphddp mode's own recorded iteration gives each bucket's launch as a fraction of
its backward's compute (eager and split: when its last gradient arrived; in-graph: when the compiled backward issued
its all-reduce), scaled to ``local``'s backward. PyTorch's modes have no events of ours, so their buckets are laid out as
PyTorch's Reducer rebuilds them after its first iteration, by its own function (``torch_buckets``), over the
parameters' ready fractions recorded in ``graphddp-eager``'s iteration.
``naive`` all-reduces each gradient after backward; ``comm`` sends the buckets back to back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphddp.passes import (
    BucketCaps,
    LinkModel,
    ParamSpec,
    StepInputs,
    choose_channels,
    choose_optimizer_overlap,
    plan_buckets,
    predict_step,
    step_inputs_from_buckets,
    step_inputs_from_completions,
)

from . import modes
from .modes import ModeName, compute_baseline

GLOO_COLLECTIVES_IN_FLIGHT = 2
"""Collectives one gloo process group runs at once: ``ProcessGroupGloo``'s worker threads (``Options.threads``, 2 by
default). The ``comm`` mode issues every bucket at once, so while one bucket's bytes are on the wire the next one's
latency runs beside them: the step model's two channels (Note [Channels]). Sending them one after the other
overpredicted ``comm`` by ~55 % at cnn 5 Gbit/s (5 buckets, 1.3 ms of latency each) in every matrix run up to
session 12. The DDP modes issue a bucket as backward completes it, and their predictions did not move by 0.1 %
with two in flight (session 13, offline on that run), so they keep one."""


def predict_modes(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode: ``predicted_s`` (and ``exposed_s``, the communication the model says stays exposed)."""
    link = link_of_run(summary)
    if link is None or "local" not in summary["modes"]:
        return {}
    world = summary["options"]["world_size"]
    out = {}
    inputs_of: dict[str, StepInputs] = {}
    for mode in summary["modes"]:
        base = ModeName.parse(mode).base
        if base == "naive":
            forward, backward, optimizer = compute_phases(summary, mode)
            sent = sum(link.allreduce_s(nbytes, world) for _, nbytes in summary["params"])
            out[mode] = {"predicted_s": forward + backward + optimizer + sent, "exposed_s": sent}
        elif base == "comm":
            sent = _comm_alone(summary, link, world)
            out[mode] = {"predicted_s": sent, "exposed_s": sent}
        elif (inputs := mode_inputs(summary, mode)) is not None:
            inputs_of[mode] = inputs
            p = predict_step(inputs, link, world)
            out[mode] = {"predicted_s": p.step_s, "exposed_s": p.exposed_s}
            if base.startswith("graphddp"):  # what the planner would pick for this schedule (Note [Channels])
                pick, steps = choose_channels(inputs, link, world)
                out[mode]["channels_pick"] = {"channels": pick, "predicted_s": {str(k): v for k, v in steps.items()}}
    # Would the planner step the optimizer in backward here? graphddp-compiled's schedule against its ``+step``
    # one (the split's, where per-bucket steps run), where the run has both.
    after, stepped = inputs_of.get("graphddp-compiled"), inputs_of.get("graphddp-compiled+step")
    if after is not None and stepped is not None:
        pays, steps = choose_optimizer_overlap(after, stepped, link, world)
        out["graphddp-compiled"]["step_pick"] = {"step_in_backward": pays, "predicted_s": steps}
    return out


def _comm_alone(summary: dict[str, Any], link: LinkModel, world: int) -> float:
    """The ``comm`` mode: the plan's buckets, every one issued at once, no compute, ``GLOO_COLLECTIVES_IN_FLIGHT``
    at a time."""
    buckets = plan_buckets(_specs(summary["params"])[::-1], caps=_caps(summary["options"])).buckets
    at_once = step_inputs_from_completions([0.0] * len(buckets), [b.nbytes for b in buckets], 0.0)
    return predict_step(dataclasses.replace(at_once, channels=GLOO_COLLECTIVES_IN_FLIGHT), link, world).step_s


def link_of_run(summary: dict[str, Any]) -> LinkModel | None:
    calibration = summary.get("calibration")
    if not calibration:
        return None
    return LinkModel(latency_s=calibration["latency_s"], seconds_per_byte=calibration["seconds_per_byte"])


def mode_inputs(summary: dict[str, Any], mode: str) -> StepInputs | None:
    """The step cost model's inputs for a DDP mode of this run (None where the run recorded too little)."""
    name = ModeName.parse(mode)
    forward, backward, optimizer = compute_phases(summary, mode)
    cpu = summary["calibration"]["cpu_seconds_per_byte"]
    inputs: StepInputs | None = None
    if name.base.startswith("graphddp"):
        inputs = _graphddp_inputs(summary, mode, backward, cpu)
    elif name.base.startswith("torch") and (ready := _ready_fractions(summary)):
        specs = sorted(_specs(summary["params"]), key=lambda p: ready[p.name])
        buckets = torch_buckets(specs, bucket_cap_mb=summary["options"]["bucket_cap_mb"])
        inputs = step_inputs_from_buckets(
            buckets, {name: f * backward for name, f in ready.items()}, backward_s=backward, cpu_seconds_per_byte=cpu
        )
    if inputs is None:
        return None
    if name.base.startswith("graphddp"):  # buckets on channels in turn (Note [Channels]); PyTorch's DDP has one
        configured = name.channels or summary["options"].get("channels") or 1
        link = link_of_run(summary)
        if not isinstance(configured, int) and link is not None:  # "auto": what the model picks for this schedule
            configured = choose_channels(inputs, link, summary["options"]["world_size"])[0]
        configured = configured if isinstance(configured, int) else 1
        inputs = dataclasses.replace(inputs, channels=configured)
    if name.step_in_backward:  # the optimizer's work, shared out by the bytes each all-reduce lets step
        stepped, chunked = _stepped_bytes(summary, mode, inputs)
        ratio = summary["calibration"].get("chunked_step_ratio", 1.0)  # big parameters in chunks: cheaper a byte
        per_byte = optimizer / sum(stepped)
        return _with(inputs, forward, 0.0, tuple(per_byte * (b - c + c * ratio) for b, c in zip(stepped, chunked)))
    return _with(inputs, forward, optimizer, ())


def torch_buckets(specs_in_ready_order: list[ParamSpec], *, bucket_cap_mb: float | None) -> list[list[ParamSpec]]:
    """The buckets PyTorch's DDP sends, in launch order, by its own rules (``bench.modes.torch_buckets``, on meta
    tensors of the parameters' shapes). Up to session 27 the model laid them out with graphddp's planner and a
    1 MiB first bucket."""
    tensors = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in specs_in_ready_order]
    return [[specs_in_ready_order[i] for i in bucket] for bucket in modes.torch_buckets(tensors, bucket_cap_mb)]


def _stepped_bytes(summary: dict[str, Any], mode: str, inputs: StepInputs) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per all-reduce of ``inputs``: the bytes of the parameters whose optimizer step it is the last to wait for,
    and of those, the bytes stepped in cache-sized chunks (``graphddp.runtime.row_steps.steps_in_chunks``, Note
    [Steps by rows]). A bucket in pieces steps each block's rows once that block is in and the rest with its last block,
    and a tied table's part with the table's rows (``bench.worker.bucket_layout``'s ``stepped`` and ``chunked``);
    without that record (PyTorch's modes, older runs), each all-reduce steps its own bytes, none in chunks."""
    layout = summary["buckets"].get(mode) or []
    recorded = len(layout) == len(inputs.bucket_bytes) and all("stepped" in b for b in layout)
    if recorded and any(b["stepped"] for b in layout):
        return tuple(b["stepped"] for b in layout), tuple(b.get("chunked", 0) for b in layout)
    return inputs.bucket_bytes, (0,) * len(inputs.bucket_bytes)


def compute_phases(summary: dict[str, Any], mode: str) -> tuple[float, float, float]:
    """Forward, backward and optimizer of the compute ``mode`` runs with no communication at all: ``local``, or
    ``local-compiled`` for a compiled mode where the run measured it (``compute_baseline``), scaled so that they
    add up to that mode's step.

    Why scaled: the bench times a step as its slower rank's (``bench.run.summarize``), as a synchronised step
    runs, but each phase as the median over every rank's samples. The medians add up to a typical rank's step,
    2-17 % below the slower rank's in the session 14 runs, and every prediction built on them came out that much
    fast. A DDP step waits for the slower rank, so its compute is the slower rank's: the phases keep their shares
    and take the step's length."""
    measured = summary["modes"][compute_baseline(mode, summary["modes"])]
    phases = measured["phases_s"]
    forward, backward, optimizer = phases["forward"], phases["backward"], phases["optimizer"]
    total = forward + backward + optimizer
    scale = measured["median_s"] / total if total > 0 else 1.0
    return forward * scale, backward * scale, optimizer * scale


def _graphddp_inputs(summary: dict[str, Any], mode: str, backward: float, cpu: float) -> StepInputs | None:
    """A graphddp mode's buckets, complete where its recorded iteration launched them (rank 0's)."""
    timelines, layout = summary["timelines"].get(mode), summary["buckets"].get(mode)
    if not timelines or not layout:
        return None
    window = _BackwardWindow.of(timelines[0], last_launch=len(layout) - 1)
    if window is None:
        return None
    completions, running = [], 0.0
    for k in range(len(layout)):
        running = max(running, window.fraction(window.first.get(("launch", k), window.end_ms)) * backward)
        completions.append(running)
    inputs = step_inputs_from_completions(completions, [b["sent"] for b in layout], backward, cpu)
    buckets = tuple(b["bucket"] for b in layout) if all("bucket" in b for b in layout) else ()  # older runs: none
    return dataclasses.replace(inputs, tail_per_bucket_s=_assembly_s(summary, layout), bucket_of=buckets)


def _assembly_s(summary: dict[str, Any], layout: list[dict[str, Any]]) -> tuple[float, ...]:
    """Per all-reduce: the copy it leaves for the end of backward, where a gradient sent in pieces in-graph is put
    back together once its last piece is in (``bench.worker.bucket_layout``'s ``assembled`` bytes, at the
    calibrated cost per byte); empty where the run recorded neither (the split, older runs)."""
    per_byte = summary["calibration"].get("assembly_seconds_per_byte", 0.0)
    assembled = [b.get("assembled", 0) for b in layout]
    if not per_byte or not any(assembled):
        return ()
    return tuple(per_byte * n for n in assembled)


def _ready_fractions(summary: dict[str, Any]) -> dict[str, float]:
    """Each parameter's ready time as a fraction of backward, from graphddp-eager's recorded iteration."""
    timelines = summary["timelines"].get("graphddp-eager")
    window = _BackwardWindow.of(timelines[0]) if timelines else None
    if window is None:
        return {}
    ready = {}
    for kind, _bucket, param, t_ms in timelines[0]:
        if kind == "ready" and param and param not in ready:
            ready[param] = window.fraction(t_ms)
    return {n: ready.get(n, 1.0) for n, _ in summary["params"]}


@dataclasses.dataclass(frozen=True)
class _BackwardWindow:
    """One recorded iteration's backward, from its ``backward`` mark to the end of its compute (ms; see ``of``)."""

    first: dict[tuple[str, int | None], float]
    """The first time (ms) of each (kind, bucket) event."""
    start_ms: float
    end_ms: float

    @classmethod
    def of(cls, events: list[list[Any]], *, last_launch: int | None = None) -> _BackwardWindow | None:
        """The window of one recorded iteration, to the end of its backward's compute: the earliest of
        ``finalize``, the launch of the last bucket (``last_launch``, its index; every graphddp mode's window, the
        Reducer's too, where the launch and ``finalize`` are a few µs apart) and ``compute_end`` (an in-graph
        backward's first wait), where recorded. An in-graph timeline's ``finalize`` is its last issued all-reduce
        (``bench.worker.profiled_timeline``); a row-sparse table that is the last bucket issues its rows only once
        its mask is back, behind every bucket still on the link, so that finalize holds the exposed
        communication, and with steps in backward its mask goes after the other buckets' steps too. A window to
        either put every bucket's completion early: gpt's compiled modes came out 12-19 % fast in sessions
        44-46. Assumed, as the bench's workloads are: one compiled graph (a graph break's later graph waits
        mid-backward), and no all-reduce beside the buckets' (an abandon signal summed apart would shift the
        launches' numbering by one)."""
        first: dict[tuple[str, int | None], float] = {}
        for kind, bucket, _param, t_ms in events:
            first.setdefault((kind, bucket), t_ms)
        start, end = first.get(("backward", None)), first.get(("finalize", None))
        if start is None or end is None:
            return None
        earlier = (first.get(("launch", last_launch)), first.get(("compute_end", None)))
        end = min([end, *(t for t in earlier if t is not None and t > start)])
        return cls(first, start, end) if end > start else None

    def fraction(self, t_ms: float) -> float:
        """How far into backward ``t_ms`` is, clamped to [0, 1]."""
        return min(max((t_ms - self.start_ms) / (self.end_ms - self.start_ms), 0.0), 1.0)


def _specs(params: list[list[Any]]) -> list[ParamSpec]:
    return [ParamSpec(name, (nbytes // 4,), torch.float32, "cpu") for name, nbytes in params]


def _caps(options: dict[str, Any]) -> BucketCaps:
    return BucketCaps.from_mb(
        options["bucket_cap_mb"], options["first_bucket_cap_mb"], options["last_bucket_cap_mb"], ramps=options["bucket_ramps"]
    )


def _with(inputs: StepInputs, forward: float, after: float, steps: tuple[float, ...]) -> StepInputs:
    return dataclasses.replace(inputs, forward_s=forward, after_backward_s=after, step_per_bucket_s=steps)

