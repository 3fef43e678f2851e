"""graphddp's Python Reducer against PyTorch's C++ one on a GPU: ``python -m bench.gpu --out DIR``.

A GPT-2-small-sized model (124M parameters: 12 layers, 12 heads, width 768, vocabulary 50304, tied head), bf16
autocast, AdamW (fused), batch 8 x 1024 tokens, NCCL at world size 1: nothing to send, so what differs between the
modes is each Reducer's own cost (hooks, bucket copies, launches, waits) and the compiled graph's. Every mode runs
in a fresh process (its own memory peak, its own Dynamo cache) and reports the median of ``--steps`` steps after
``--warmup``: the step's wall time (synchronised each step), forward+backward and optimizer times from CUDA
events, and the peak memory allocated. graphddp-eager is also profiled (``torch.profiler``, a few steps) so the
per-parameter Python cost can be read off, and graphddp-compiled's step is predicted by the cost model (Note [Step
cost model]) from the captured graph at this GPU's measured bf16 rates and an NCCL link fitted on the group.

Writes ``DIR/gpu.json``, ``DIR/profile-graphddp-eager.txt`` (torch.profiler) and ``DIR/python-MODE.txt`` (cProfile
of graphddp's modes); prints a table. docs/gpu.md holds a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphddp.tools.launch import import_before_init

MODES = ("local", "torch-eager", "graphddp-eager", "torch-compiled", "graphddp-compiled", "graphddp-compiled+split")
"""``graphddp-compiled`` reduces in-graph where it can (Note [In-graph reduction]); ``+split`` keeps the split and
the Reducer, for the comparison."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuRun:
    steps: int = 30
    """Measured steps per mode (the median is reported)."""
    warmup: int = 10
    """Steps before measuring (compiles happen here)."""
    batch: int = 8
    seq: int = 1024
    profile_steps: int = 5
    """graphddp-eager steps recorded by torch.profiler after the measured ones (0: none)."""

    def __post_init__(self) -> None:
        for name in ("steps", "warmup", "batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


def gpt2_small() -> torch.nn.Module:
    from graphddp.tools.workloads import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False))


def wrapped(mode: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(the DDP module, or the model for local; what a step calls)``."""
    import graphddp

    if mode == "local":
        return model, model
    if mode.startswith("torch"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    else:
        ddp = graphddp.DDP(model, device_ids=[0])
    if "compiled" in mode:
        # PyTorch's DDP under torch.compile: Dynamo's DDPOptimizer splits at its buckets; graphddp's DDP: the
        # graphddp backend around Inductor, in-graph where it can unless +split.
        if mode.startswith("torch"):
            return ddp, torch.compile(ddp)
        reduction = "split" if mode.endswith("+split") else "auto"
        return ddp, torch.compile(ddp, backend=graphddp.backend("inductor", reduction=reduction))
    return ddp, ddp


def run_mode(mode: str, options: GpuRun, init_file: str, out: str, results: Any) -> None:
    torch.cuda.set_device(0)
    import_before_init()  # Note [The default group outlives destroy_process_group]
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = gpt2_small().cuda()
    params = sum(p.numel() for p in model.parameters())
    ddp, step_model = wrapped(mode, model)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, 50304, (options.batch, options.seq + 1), device="cuda", generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def step() -> tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        marks[1].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks[2].record()
        return marks[0], marks[1], marks[2]

    compile_started = time.perf_counter()
    for _ in range(options.warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - compile_started
    torch.cuda.reset_peak_memory_stats()
    walls, fb, optim = [], [], []
    for _ in range(options.steps):
        started = time.perf_counter()
        a, b, c = step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - started)
        fb.append(a.elapsed_time(b) / 1e3)
        optim.append(b.elapsed_time(c) / 1e3)
    record = {
        "mode": mode,
        "params": params,
        "step_s": statistics.median(walls),
        "step_s_min": min(walls),
        "forward_backward_s": statistics.median(fb),
        "optimizer_s": statistics.median(optim),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "warmup_s": warmup_s,
    }
    # The extras may fail on their own (a profiler or capture problem) without losing the measured figures.
    if mode == "graphddp-eager" and options.profile_steps:
        record["profile"] = guarded(profile, step, options.profile_steps, os.path.join(out, f"profile-{mode}.txt"))
    if mode.startswith("graphddp") and options.profile_steps:
        record["python"] = guarded(python_profile, step, options.profile_steps, os.path.join(out, f"python-{mode}.txt"))
    if mode == "graphddp-compiled":
        record["prediction"] = guarded(predict, model, x, y, ddp.reducer.caps)
    if mode.startswith("graphddp"):
        from bench.modes import reduction_ran

        record["buckets"] = len(ddp.bucket_plan.buckets)
        record["reduction"] = reduction_ran(ddp)  # eager, in_graph, or split and why
    results.put(record)
    dist.destroy_process_group()


def guarded(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # reported in the record, beside the figures that did come out
        return {"error": f"{type(e).__name__}: {e}"}


def profile(step: Any, steps: int, path: str) -> dict[str, float]:
    """A few steps under torch.profiler: the table to ``path``, the CPU time of graphddp's own ranges returned."""
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path, "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
        f.write("\n\n")
        f.write(averages.table(sort_by="cpu_time_total", row_limit=40))
    ours = {e.key: e.cpu_time_total / 1e6 / steps for e in averages if e.key.startswith("graphddp")}
    return dict(sorted(ours.items(), key=lambda kv: -kv[1])[:12])


def python_profile(step: Any, steps: int, path: str) -> dict[str, float]:
    """A few steps under cProfile (Python functions only, no CUDA tracing): which of graphddp's Python functions
    the step's CPU time goes to; the table to ``path``, graphddp's top functions (cumulative s per step) returned."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("graphddp", 40)
    with open(path, "w") as f:
        f.write(text.getvalue())
    ours = {f"{name}:{line}({fn})": entry[3] / steps for (name, line, fn), entry in stats.stats.items() if "graphddp" in name}  # type: ignore[attr-defined]
    return dict(sorted(ours.items(), key=lambda kv: -kv[1])[:15])


def predict(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, caps: Any) -> dict[str, Any]:
    """The cost model's forward+backward of the captured graph at this GPU's bf16 rates (Note [Step cost model]).
    At world size 1 a ring all-reduce sends nothing (2 (w - 1) / w = 0), so the link does not enter and none is
    fitted (``link_of`` needs two ranks); the optimizer is measured, not predicted."""
    from graphddp.compiler.capture import capture_graphs, parameter_names
    from graphddp.compiler.graph_pipeline import prepare_graph
    from graphddp.passes import LinkModel
    from graphddp.runtime.calibration import measure_compute_rates
    from graphddp.tools.inspection import predict_graph

    rates = measure_compute_rates(torch.device("cuda"), dtype=torch.bfloat16, matmul_size=4096)
    link = LinkModel.of_rate(400e9)  # any link: at world size 1 nothing crosses it
    names = parameter_names(model)
    total = 0.0
    graphs = []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        captured = capture_graphs(model, x, y)
    for c in captured:
        prepared = prepare_graph(c.gm, c.example_inputs, names, caps=caps, row_sparse=False)
        if prepared is None:
            continue
        p = predict_graph(c.gm, prepared.split, link, 1, rates)
        total += p.step_s
        graphs.append({"step_s": p.step_s, "segments": len(prepared.split.segments)})
    return {
        "forward_backward_s": total,
        "graphs": graphs,
        "rates": {"matmul_tflops": rates.flops_per_s / 1e12, "elementwise_gb_s": rates.bytes_per_s / 1e9},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    for field in dataclasses.fields(GpuRun):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.gpu: no CUDA GPU here", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    options = GpuRun(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GpuRun)})
    os.makedirs(args.out, exist_ok=True)
    ctx = mp.get_context("spawn")
    records = []
    for mode in modes:
        results = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            proc = ctx.Process(target=run_mode, args=(mode, options, os.path.join(d, "init"), args.out, results))
            proc.start()
            while proc.is_alive() and results.empty():
                proc.join(timeout=1)
            record = None if results.empty() else results.get()
            proc.join()
        if record is None:
            print(f"{mode}: failed (exit code {proc.exitcode})", file=sys.stderr)
            continue
        records.append(record)
        print(summary_line(records[-1], records), flush=True)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "options": dataclasses.asdict(options), "modes": records}, f, indent=2)
    return 0


def summary_line(record: dict[str, Any], records: list[dict[str, Any]]) -> str:
    base = {r["mode"]: r for r in records}
    kind = record["mode"].split("-", 1)[-1].split("+", 1)[0]  # eager or compiled, whatever the variant
    ref = base.get(f"torch-{kind}") if record["mode"].startswith("graphddp") else None
    ratio = f"  ×{record['step_s'] / ref['step_s']:.3f} of {ref['mode']}" if ref else ""
    ratio += f"  [{record['reduction']}]" if "reduction" in record else ""
    return (
        f"{record['mode']:18s} step {record['step_s'] * 1e3:7.1f} ms  (fwd+bwd {record['forward_backward_s'] * 1e3:6.1f}, "
        f"optimizer {record['optimizer_s'] * 1e3:5.1f})  peak {record['peak_memory_bytes'] / 2**30:5.2f} GiB{ratio}"
    )


if __name__ == "__main__":
    sys.exit(main())
