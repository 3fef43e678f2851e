"""Launch a benchmark run with torchrun (loopback, or one emulated host per rank) and report it."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from graphddp.ddp import BucketOptions
from graphddp.tools.launch import free_port, processes_with, stop_job

from .allocator import allocator_env
from .interleave import INTERLEAVINGS
from .link import Link, LinkSpec
from .modes import MODES, NO_DDP, ModeName, compute_baseline
from .predict import predict_modes


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions(BucketOptions):
    """One benchmark run (bucket caps: see ``bench.modes.ModeConfig``)."""

    workload: str = "gpt"
    """gpt, mlp or cnn (``graphddp.tools.workloads``)."""
    size: str = "bench"
    """tiny, small or bench."""
    batch_size: int | None = None
    """Per-rank batch size (default: the size's own)."""
    world_size: int = 2
    modes: tuple[str, ...] = MODES
    iters: int = 10
    """Timed iterations per mode (after warm-up)."""
    rounds: int = 2
    """The timed iterations are spread over this many rounds through all modes (bench/worker.py)."""
    warmup: int = 2
    pin: bool = True
    """Pin each rank to CPUs of its own (an equal slice, when there is at least one CPU per rank): every emulated
    host gets its own processors, and the OS cannot stack two ranks' compute threads on one CPU (bench/worker.py)."""
    inner: str = "inductor"
    link: str = "loopback"
    """``loopback`` or ``RATE[:DELAY]`` (``2gbit``, ``1gbit:2ms``)."""
    allocator: str = "system"
    """The ranks' CPU memory allocator: ``system`` or ``retain`` (``bench.allocator``: freed memory kept and reused,
    no page faults for the next step's tensors)."""
    interleave: str = "modes"
    """The order of the timed iterations (``bench/worker.py``): ``modes``, one mode alive at a time, its iterations
    in a row; or ``steps``, every mode alive at once, one iteration of each in turn."""
    out: str = "bench-out"

    def __post_init__(self) -> None:
        super().__post_init__()  # bad caps: one line, before any rank starts
        if self.caps_search is not None:
            auto = ", ".join(f for f in ("bucket_cap_mb", "first_bucket_cap_mb", "last_bucket_cap_mb") if getattr(self, f) == "auto")
            raise ValueError(
                f"the run's caps must be numbers of MiB (PyTorch's modes, the comm mode and the predictions plan with "
                f"them), got auto for {auto}; time automatic caps as a mode, e.g. --modes local,comm,graphddp-compiled@auto"
            )
        for mode in self.modes:
            ModeName.parse(mode)  # raises on an unknown mode or variant
        if len(set(self.modes)) != len(self.modes):
            twice = sorted({m for m in self.modes if self.modes.count(m) > 1})
            raise ValueError(f"each mode may be named once; named more than once: {', '.join(twice)}")
        if self.iters < 1 or self.world_size < 1 or self.warmup < 0:
            raise ValueError("iters and world_size must be >= 1, warmup >= 0")
        if not isinstance(self.pin, bool):
            raise TypeError(f"pin must be True or False, got {self.pin!r}")
        if not 1 <= self.rounds <= self.iters:
            raise ValueError(f"rounds must be between 1 and iters ({self.iters}), got {self.rounds}")
        if self.link != "loopback":
            LinkSpec.parse(self.link)
        allocator_env(self.allocator)  # raises on an unknown allocator
        if self.interleave not in INTERLEAVINGS:
            raise ValueError(f"interleave must be one of {', '.join(INTERLEAVINGS)}, got {self.interleave!r}")


AGAINST_TORCH = (
    ("graphddp-compiled / torch-compiled", "graphddp-compiled", "torch-compiled"),
    ("graphddp-eager / torch-eager", "graphddp-eager", "torch-eager"),
)
"""The ratios of graphddp's modes to PyTorch's: ``(label, graphddp's mode, PyTorch's mode)``."""


def run(options: BenchOptions) -> dict[str, Any]:
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "workload": options.workload,
        "size": options.size,
        "batch_size": options.batch_size,
        "modes": list(options.modes),
        "iters": options.iters,
        "rounds": options.rounds,
        "warmup": options.warmup,
        "pin": options.pin,
        "interleave": options.interleave,
        "out": str(out.resolve()),
        "mode_config": {**options.bucket_kwargs(), "inner": options.inner},
    }
    config_path = (out / "config.json").resolve()  # absolute: on every rank's command line, it finds the job's processes
    config_path.write_text(json.dumps(config, indent=2))
    for stale in out.glob("rank*.json"):
        stale.unlink()
    env = allocator_env(options.allocator)
    if options.link == "loopback":
        run_jobs([_torchrun(options.world_size, 1, 0, "127.0.0.1", config_path)], str(config_path), env)
    else:
        with Link(LinkSpec.parse(options.link), options.world_size) as link:
            commands = [
                ["ip", "netns", "exec", link.host(r), *_torchrun(1, options.world_size, r, link.address(0), config_path, link.address(r))]
                for r in range(options.world_size)
            ]
            # Every namespace has the same hostname, so gloo must be told which interface to use.
            run_jobs(commands, str(config_path), {**env, "GLOO_SOCKET_IFNAME": "eth0"})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(options.world_size)]
    return summarize(options, ranks)


def _torchrun(nproc: int, nnodes: int, node_rank: int, host: str, config: Path, local_addr: str | None = None) -> list[str]:
    port = free_port() if host == "127.0.0.1" else 29517
    # Namespaces share one hostname, so torchrun can guess neither which host serves the rendezvous nor
    # which address the others reach this one at: say both.
    where = [f"--rdzv-conf=is_host={int(node_rank == 0)}", f"--local-addr={local_addr}"] if local_addr else []
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", "--rdzv-id=graphddp-bench", *where,
        "-m", f"{__package__}.worker", str(config),  # bench.worker in the repository, graphddp.bench.worker installed
    ]  # fmt: skip


def run_jobs(commands: list[list[str]], marker: str, extra_env: dict[str, str] | None = None) -> None:
    """Start every command (a torchrun job each); on the first failure or on Ctrl-C, stop every job whole, its
    workers too (``stop_job``: they run in sessions of their own), found by ``marker`` on their command lines."""
    env = {**os.environ, **(extra_env or {})}
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in commands]
    try:
        while None in (codes := [p.poll() for p in procs]):  # every job polled: a later one may have failed
            if any(code not in (None, 0) for code in codes):
                raise RuntimeError(f"a benchmark rank failed: exit codes {codes}")
            time.sleep(0.2)
        if any(code != 0 for code in codes):
            raise RuntimeError(f"a benchmark rank failed: exit codes {codes}")
    finally:
        if any(p.poll() is None for p in procs) or processes_with(marker):  # failed, interrupted, or a worker lingers
            for p in procs:
                stop_job(p, marker)



# -- the report --------------------------------------------------------------------------------------------------
def summarize(options: BenchOptions, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: iteration time (slowest rank per iteration), spread, throughput, compile time, overlap, memory,
    and the median time of each phase; the ratios, also round by round (modes of one round ran back to back)."""
    per_rank_batch = ranks[0]["batch_size"]
    modes: dict[str, dict[str, Any]] = {}
    per_round: dict[str, list[float]] = {}
    for mode in options.modes:
        iteration = [max(r["modes"][mode]["times_s"][i] for r in ranks) for i in range(options.iters)]
        median = statistics.median(iteration)
        rss = [r["modes"][mode]["added_peak_rss_mb"] for r in ranks if r["modes"][mode]["added_peak_rss_mb"] is not None]
        round_of = ranks[0]["modes"][mode]["round_of"]
        per_round[mode] = [statistics.median(t for t, k in zip(iteration, round_of) if k == r) for r in range(options.rounds)]
        modes[mode] = {
            "median_s": median,
            "min_s": min(iteration),
            "max_s": max(iteration),
            "samples_per_s": per_rank_batch * options.world_size / median,
            "compile_s": max(r["modes"][mode]["first_s"] for r in ranks) - median,
            "added_peak_rss_mb": max(rss) if rss else None,
            "phases_s": _median_phases([p for r in ranks for p in r["modes"][mode]["phases_s"]]),
            "round_medians_s": per_round[mode],
            "tail_s": _median_tail([r["modes"][mode]["phases_s"] for r in ranks]),
            "page_faults": _median_page_faults([r["modes"][mode].get("page_faults") for r in ranks]),
        }
    local, comm = modes.get("local", {}).get("median_s"), modes.get("comm", {}).get("median_s")
    for name, m in modes.items():
        if local is not None and name not in (*NO_DDP, "comm"):
            compute = modes[compute_baseline(name, modes)]["median_s"]  # the compute of the mode's own kind
            m["exposed_comm_s"] = m["median_s"] - compute
            if comm:
                m["overlap"] = min(1.0, max(0.0, (compute + comm - m["median_s"]) / comm))
    ratios, ratio_rounds = {}, {}
    for label, a, b in AGAINST_TORCH:
        if a in modes and b in modes:
            ratios[label] = modes[a]["median_s"] / modes[b]["median_s"]
            ratio_rounds[label] = [x / y for x, y in zip(per_round[a], per_round[b])]
    if "graphddp-compiled" in modes and local is not None and comm is not None:
        baseline = compute_baseline("graphddp-compiled", modes)
        label = f"graphddp-compiled / max({baseline}, comm)"
        ratios[label] = modes["graphddp-compiled"]["median_s"] / max(modes[baseline]["median_s"], comm)
        ratio_rounds[label] = [x / max(y, z) for x, y, z in zip(per_round["graphddp-compiled"], per_round[baseline], per_round["comm"])]
    summary = {
        "options": dataclasses.asdict(options),
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "rank_cpus": [r["cpus"] for r in ranks],
        "torch": torch.__version__,
        "link": options.link,
        "modes": modes,
        "ratios": ratios,
        "ratio_rounds": ratio_rounds,
        "timelines": {
            mode: [r["modes"][mode]["timeline"] for r in ranks] for mode in options.modes if ranks[0]["modes"][mode]["timeline"]
        },
        "calibration": ranks[0].get("calibration"),
        # Counted with --interleave steps only (each mode built afresh compiles before it is timed): None otherwise.
        "compiles_while_timed": max(r.get("compiles_while_timed", 0) for r in ranks) if options.interleave == "steps" else None,
        "params": ranks[0].get("params", []),
        "buckets": {mode: ranks[0]["modes"][mode].get("buckets") for mode in options.modes},
        "reductions": {mode: ranks[0]["modes"][mode].get("reduction") for mode in options.modes},
        "auto_caps": {mode: [r["modes"][mode].get("auto_caps") for r in ranks] for mode in options.modes if ranks[0]["modes"][mode].get("auto_caps")},
    }
    for mode, per_rank in summary["timelines"].items():
        modes[mode]["first_send"] = first_send(per_rank[0])
    for mode, predicted in predict_modes(summary).items():
        modes[mode].update(predicted)
        modes[mode]["prediction_error"] = predicted["predicted_s"] / modes[mode]["median_s"] - 1
    return summary


def first_send(timeline: list[list[Any]]) -> dict[str, float] | None:
    """When the link first gets work in one recorded iteration: the first all-reduce that starts after backward
    begins, in ms after that start and as a share of the backward (to the ``optimizer`` mark). None when the
    timeline has no such all-reduce."""
    marks = {kind: t for kind, bucket, _param, t in timeline if bucket is None}
    start, end = marks.get("backward"), marks.get("optimizer")
    launches = [t for kind, bucket, _param, t in timeline if kind == "launch" and start is not None and t >= start]
    if start is None or end is None or end <= start or not launches:
        return None
    return {"ms": min(launches) - start, "share": (min(launches) - start) / (end - start)}


def automatic_caps_line(record: dict[str, Any]) -> str:
    """One rank's automatic caps in one line (``graphddp.runtime.auto_caps.AutoCaps.as_record``): each choice, kept
    or chosen, its prediction against the standing caps' (the margin is a share of theirs), and the calibration it
    came from."""
    link, rates = record["link"], record["rates"]
    choices = []
    for c in record["choices"]:
        mine, theirs = c["predicted_ms"], c["standing_ms"]
        if c["kept_standing"]:
            (best_caps, best_ms), word = c["ranking"][0], "best"
            if c.get("robust"):  # since session 43: the margin is judged on the candidate robust to the compute rate
                best_caps, best_ms, word = c["robust"], c["robust_ms"], "candidate"
            lead = f"{word} {best_caps['mb']} MiB {best_ms:.1f} ms, {1 - best_ms / mine:.1%} faster" if best_caps != c["caps"] else "the best"
            choices.append(f"kept {c['caps']['mb']} MiB ({mine:.1f} ms predicted; {lead}; margin {c['margin']:.0%})")
        else:
            against = f", {1 - mine / theirs:.1%} faster than {record['standing']['mb']} MiB's {theirs:.1f} ms" if theirs else ""
            robust = f", within {c['worst_regret']:.1%} of the fastest at every compute speed" if "worst_regret" in c else ""
            choices.append(f"chose {c['caps']['mb']} MiB ({mine:.1f} ms predicted{against}{robust})")
    launch = f"a launch {rates['launch_s'] * 1e6:.0f} µs, " if "launch_s" in rates else ""  # recorded since session 45
    return (
        f"automatic caps {'; '.join(choices) or 'not chosen yet'}; from a link of {link['latency_s'] * 1e6:.0f} µs and "
        f"{8 / link['seconds_per_byte'] / 1e9:.2f} Gbit/s, matmul {rates['flops_per_s'] / 1e9:.0f} Gflop/s, elementwise "
        f"{rates['bytes_per_s'] / 1e9:.1f} GB/s, {launch}gloo's CPU {record['cpu_seconds_per_byte'] * 1e9:.2f} ns/B"
    )


def automatic_caps_lines(mode: str, rounds: list[dict[str, Any]]) -> list[str]:
    """Rank 0's automatic caps of ``mode``, round by round (each round builds its DDP again, and an eager choice
    follows that round's first backward): one line where every round chose alike."""
    lines = [automatic_caps_line(r) for r in rounds]
    if len(set(lines)) == 1:
        return [f"{mode}: {lines[0]}"]
    return [f"{mode}, round {i + 1}: {line}" for i, line in enumerate(lines)]


def table(summary: dict[str, Any]) -> str:
    rows = []
    for mode, m in summary["modes"].items():
        rows.append([
            mode, f"{m['median_s'] * 1e3:.1f}", f"{m['min_s'] * 1e3:.1f}-{m['max_s'] * 1e3:.1f}", f"{m['samples_per_s']:.1f}",
            f"{m['compile_s']:.1f}", _ms(m.get("exposed_comm_s")), _pct(m.get("overlap")), _whole(m.get("added_peak_rss_mb")),
            _whole(m.get("page_faults")), _ms(m.get("predicted_s")), _signed_pct(m.get("prediction_error")),
        ])  # fmt: skip
    headers = [
        "mode", "median ms", "spread ms", "samples/s", "compile s", "exposed comm ms", "overlap", "added peak RSS MB",
        "page faults", "predicted ms", "error",
    ]  # fmt: skip
    lines = [tabulate(rows, headers=headers), "", phase_table(summary), ""]
    for mode, m in summary["modes"].items():
        if m.get("first_send") is not None:
            lines.append(f"{mode}: first all-reduce {m['first_send']['ms']:.0f} ms into backward ({m['first_send']['share']:.0%} of it)")
    for mode, per_rank in summary.get("auto_caps", {}).items():
        lines += automatic_caps_lines(mode, per_rank[0])
    for mode, m in summary["modes"].items():
        if (pick := m.get("channels_pick")) is not None:
            steps = ", ".join(f"{k}: {v * 1e3:.0f} ms" for k, v in pick["predicted_s"].items())
            lines.append(f"{mode}: the model picks {pick['channels']} channel(s) for this schedule ({steps})")
    if summary.get("compiles_while_timed"):
        lines.append(f"warning: {summary['compiles_while_timed']} graph(s) compiled during timed iterations: those were not steady steps")
    for label, value in summary["ratios"].items():
        rounds = summary.get("ratio_rounds", {}).get(label, [])
        spread = f" (round by round: {min(rounds):.3f}-{max(rounds):.3f}, {len(rounds)} rounds)" if len(rounds) > 1 else ""
        lines.append(f"{label}: {value:.3f}{spread}")
    return "\n".join(lines)


PHASES = ("forward", "backward", "allreduce", "optimizer")


def phase_table(summary: dict[str, Any]) -> str:
    """Median ms of each phase per mode (all ranks' iterations): where communication shows up, if anywhere."""
    seen = {n for m in summary["modes"].values() for n in m["phases_s"]}
    names = [n for n in PHASES if n in seen] + sorted(seen - set(PHASES))
    rows = [[mode, *(_ms(m["phases_s"].get(n)) for n in names), _ms(m.get("tail_s"))] for mode, m in summary["modes"].items()]
    return tabulate(rows, headers=["phase ms", *names, "tail after backward"])


def _median_page_faults(per_rank: list[list[int] | None]) -> float | None:
    """The median over iterations of the most minor page faults a rank took in one (None from ranks that did not
    count them): how much of the step ran on memory the C library had just given back (``bench/allocator.py``)."""
    if any(faults is None for faults in per_rank):
        return None
    return statistics.median(max(column) for column in zip(*per_rank))  # type: ignore[arg-type]


def _median_phases(iterations: list[dict[str, float]]) -> dict[str, float]:
    names: list[str] = []
    for phases in iterations:
        names += [n for n in phases if n not in names and not n.endswith("_ns")]
    return {n: statistics.median(p[n] for p in iterations if n in p) for n in names}


def _median_tail(per_rank: list[list[dict[str, float]]]) -> float | None:
    """graphddp modes: the median time from the end of the slowest rank's backward compute to the last averaged
    gradient written on any rank: the communication nothing hid. None for other modes."""
    tails = []
    for iteration in zip(*per_rank):
        if all("finalize_ns" in p for p in iteration):
            tails.append((max(p["written_ns"] for p in iteration) - max(p["finalize_ns"] for p in iteration)) / 1e9)
    return statistics.median(tails) if tails else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _signed_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def _whole(v: float | None) -> str:
    """A count or MB, to the nearest whole one."""
    return "-" if v is None else f"{v:.0f}"
