"""Pictures of a run: a bar chart of the modes, a timeline of one iteration per rank, a Chrome trace.

Timelines come from graphddp's recorded events (``graphddp.runtime.trace``): forward, backward, each compiled segment's
backward start, and each bucket's all-reduce from launch to completion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def chrome_trace(summary: dict[str, Any], path: Path) -> None:
    """A Chrome trace-event file (Perfetto, ``chrome://tracing``): one process per (mode, rank) with numeric ids
    and a ``process_name``; one thread per row (compute, segments, one per concurrent collective) with a
    ``thread_name``; complete events (``ph: X``) in microseconds, never overlapping within a row."""
    events: list[dict[str, Any]] = []
    pid = 0
    for mode, per_rank in summary["timelines"].items():
        for rank, timeline in enumerate(per_rank):
            pid += 1
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"{mode} rank {rank}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            rows = _rows(timeline)
            for tid, row in enumerate(rows, start=1):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
            for name, start, end, row in _spans(timeline):
                events.append({
                    "name": name, "cat": row.split(" ")[0], "ph": "X", "ts": round(start * 1e3, 3),
                    "dur": round(max(end - start, 0.0) * 1e3, 3), "pid": pid, "tid": rows.index(row) + 1,
                })  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _rows(timeline: list[list[Any]]) -> list[str]:
    """The rows of one rank's timeline, in drawing order."""
    seen = {row for *_, row in _spans(timeline)}
    return [r for r in ("compute", "segments") if r in seen] + sorted((r for r in seen if r.startswith("comm")), key=_row_number)


def _row_number(row: str) -> int:
    return int(row.split(" ")[1])


def _spans(timeline: list[list[Any]]) -> list[tuple[str, float, float, str]]:
    """(name, start ms, end ms, row) spans from one rank's events. Collectives that overlap in time (gloo runs
    several at once) go on rows ``comm 0``, ``comm 1``, ...: each on the first row free at its start."""
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
    collectives = sorted((t, at[("done", b)], b) for (kind, b), t in at.items() if kind == "launch" and ("done", b) in at)
    free_at: list[float] = []  # per comm row: when its last collective ends
    for start, end, b in collectives:
        row = next((i for i, free in enumerate(free_at) if free <= start), len(free_at))
        if row < len(free_at):
            free_at[row] = end
        else:
            free_at.append(end)
        spans.append((f"bucket {b}", start, end, f"comm {row}"))
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
        rows = [(rank, row) for rank, timeline in enumerate(per_rank) for row in _rows(timeline)]
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * len(rows)))
        colors = {"compute": "#69c", "segments": "#fb4", "comm": "#c44"}
        for y, (rank, row) in enumerate(reversed(rows)):
            for name, start, end, span_row in _spans(per_rank[rank]):
                if span_row != row:
                    continue
                ax.broken_barh([(start, max(end - start, 0.05))], (y + 0.1, 0.8), facecolors=colors[row.split(" ")[0]], edgecolor="k", linewidth=0.3)
                label = name.replace("bucket ", "b").replace("segment ", "s").replace(" backward", "")
                if row != "compute" and end - start > 0:
                    ax.text((start + end) / 2, y + 0.5, label, ha="center", va="center", fontsize=6, clip_on=True)
                elif row == "compute":
                    ax.text(start + 1, y + 0.5, name, ha="left", va="center", fontsize=7)
        ax.set_yticks([y + 0.5 for y in range(len(rows))], [f"rank {rank} {row}" for rank, row in reversed(rows)], fontsize=7)
        ax.set_xlabel("ms since the start of the iteration")
        ax.set_title(f"{mode}: one iteration (blue: phases; yellow: compiled segments' backward sN; red: bucket bN, launch to completion)", fontsize=9)
        fig.tight_layout()
        written.append(out / f"timeline-{mode}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
