"""``python -m bench.scale RESULTS.json ...``: the step cost model's projection of graphddp-compiled to 8, 64 and
256 ranks (``graphddp.passes.project_scaling``), from benchmark runs of 2 ranks, as a table and a plot.

Each run gives its workload's measured compute (the phases of ``local``, or of ``local-compiled`` where the run has
it, scaled to its step: ``bench.predict.compute_phases``), where graphddp-compiled's buckets complete
in backward (its recorded iteration) and the calibrated link. The projection keeps all of that per rank and
lets only the all-reduce change with the number of ranks (Note [Step cost model]), twice: by a ring, and by the
faster of a ring and halving-doubling per bucket (``best``: log-latency, as gloo's halving-doubling and NCCL's
trees). It rests on: weak scaling (each rank keeps its batch), one all-reduce per bucket, a link whose per-rank latency and
bandwidth do not change with the number of ranks (a non-blocking switch; no congestion, no hierarchy), the
CPU cost per byte sent unchanged, and ranks in lockstep (no stragglers, no skew).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

from graphddp.passes import LinkModel, project_scaling

from .predict import link_of_run, mode_inputs

WORLDS = (2, 8, 64, 256)


ALGORITHMS = ("ring", "best")
"""The projections made: a ring all-reduce, and the faster of ring and halving-doubling per bucket."""


def project(
    summary: dict[str, Any], link: LinkModel | None = None, *, algorithm: str = "ring"
) -> dict[int, tuple[float, float]] | None:
    """graphddp-compiled's projected step and efficiency per world size (on ``link``, or the run's own), each
    bucket all-reduced by ``algorithm`` (``graphddp.passes.ALGORITHMS``)."""
    inputs = mode_inputs(summary, "graphddp-compiled")
    link = link or link_of_run(summary)
    if inputs is None or link is None:
        return None
    return project_scaling(inputs, dataclasses.replace(link, algorithm=algorithm), WORLDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="results.json of benchmark runs (python -m bench or bench.matrix cells)")
    parser.add_argument("--out", default="scale.png")
    args = parser.parse_args(argv)
    rows, curves = [], {}
    for path in args.results:
        summary = json.loads(Path(path).read_text())
        for algorithm in ALGORITHMS:
            projected = project(summary, algorithm=algorithm)
            if projected is None:
                print(f"bench.scale: {path} has no graphddp-compiled mode, local mode or calibration", file=sys.stderr)
                return 2
            label = f"{summary['options']['workload']}, {summary['link']}, {algorithm}"
            curves[label] = projected
            rows.append([label, *(f"{step * 1e3:.0f} ms ({eff * 100:.0f}%)" for step, eff in projected.values())])
    print(tabulate(rows, headers=["workload, link, all-reduce", *(f"{w} ranks" for w in WORLDS)], tablefmt="github"))
    plot(curves, Path(args.out))
    return 0


def plot(curves: dict[str, dict[int, tuple[float, float]]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.scale: matplotlib is not installed; no plot")
        return
    fig, (steps, efficiency) = plt.subplots(1, 2, figsize=(11, 4))
    colors: dict[str, str] = {}  # one colour per workload and link; the algorithm by the line's style
    for label, projected in curves.items():
        worlds = list(projected)
        cell, _, algorithm = label.rpartition(", ")
        color = colors.setdefault(cell, f"C{len(colors) % 10}")
        style = dict(color=color, linestyle="--" if algorithm == "best" else "-", marker="o", label=label)
        steps.plot(worlds, [projected[w][0] * 1e3 for w in worlds], **style)
        efficiency.plot(worlds, [projected[w][1] * 100 for w in worlds], **style)
    for ax in (steps, efficiency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(WORLDS), [str(w) for w in WORLDS])
        ax.set_xlabel("ranks (weak scaling; dashed: halving-doubling where faster)")
    steps.set_ylabel("predicted step, ms")
    efficiency.set_ylabel("scaling efficiency, % (compute alone / step)")
    efficiency.set_ylim(0, 105)
    steps.legend(fontsize=8)
    fig.suptitle("graphddp-compiled on paper: the step cost model from 2-rank runs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"written: {path}")


if __name__ == "__main__":
    sys.exit(main())
