"""Pictures of a run: a bar chart of the modes, a timeline of one iteration per rank, a Chrome trace.

Timelines come from graphddp's recorded events (``graphddp.trace``): forward, backward, each compiled segment's
backward start, and each bucket's all-reduce from launch to completion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def chrome_trace(summary: dict[str, Any], path: Path) -> None:
    """``chrome://tracing`` / Perfetto JSON: one process per rank, a compute row and a comm row."""
    events = []
    for mode, per_rank in summary["timelines"].items():
        for rank, timeline in enumerate(per_rank):
            for name, start, end, row in _spans(timeline):
                events.append({"name": name, "ph": "X", "ts": start * 1e3, "dur": (end - start) * 1e3,
                               "pid": f"{mode} rank {rank}", "tid": row})  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _spans(timeline: list[list[Any]]) -> list[tuple[str, float, float, str]]:
    """(name, start ms, end ms, row) spans from one rank's events."""
    at = {}
    spans = []
    for kind, bucket, _param, t in timeline:
        at.setdefault((kind, bucket), t)
    phases = [("forward", "backward"), ("backward", "optimizer"), ("optimizer", "end")]
    for begin, finish in phases:
        if (begin, None) in at and (finish, None) in at:
            spans.append((begin, at[(begin, None)], at[(finish, None)], "compute"))
    segments = sorted((t, b) for (kind, b), t in at.items() if kind == "segment_backward")
    for i, (t, b) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else at.get(("finalize", None), t)
        spans.append((f"segment {b} backward", t, end, "segments"))
    for (kind, b), t in at.items():
        if kind == "launch" and ("done", b) in at:
            spans.append((f"bucket {b} all-reduce", t, at[("done", b)], "comm"))
    return spans


def draw(summary: dict[str, Any], out: Path) -> list[Path]:
    """PNG bar chart and timeline; returns the files written (none without matplotlib, which is then said)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no PNG pictures (pip install matplotlib)")
        return []
    written = []
    modes = list(summary["modes"])
    medians = [summary["modes"][m]["median_s"] * 1e3 for m in modes]
    low = [medians[i] - summary["modes"][m]["min_s"] * 1e3 for i, m in enumerate(modes)]
    high = [summary["modes"][m]["max_s"] * 1e3 - medians[i] for i, m in enumerate(modes)]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(modes, medians, yerr=[low, high], capsize=4, color=["#999"] * 2 + ["#c66"] + ["#69c", "#36a", "#6b6", "#282"][: len(modes) - 3])
    ax.set_ylabel("iteration time, ms (median, min-max)")
    ax.set_title(f"{summary['options']['workload']} ({summary['options']['size']}), {summary['options']['world_size']} ranks, link {summary['link']}")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    written.append(out / "modes.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for mode, per_rank in summary["timelines"].items():
        fig, ax = plt.subplots(figsize=(11, 1.2 + 1.1 * len(per_rank)))
        rows = {"compute": 0.0, "segments": 0.33, "comm": 0.66}
        colors = {"compute": "#69c", "segments": "#fb4", "comm": "#c44"}
        for rank, timeline in enumerate(per_rank):
            for _name, start, end, row in _spans(timeline):
                y = rank + rows[row]
                ax.broken_barh([(start, max(end - start, 0.05))], (y, 0.28), facecolors=colors[row], edgecolor="k", linewidth=0.3)
        ax.set_yticks([r + 0.5 for r in range(len(per_rank))], [f"rank {r}" for r in range(len(per_rank))])
        ax.set_xlabel("ms since the start of the iteration  (blue: forward/backward/optimizer, yellow: compiled segments' backward, red: bucket all-reduce)")
        ax.set_title(f"{mode}: one iteration")
        fig.tight_layout()
        written.append(out / f"timeline-{mode}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
