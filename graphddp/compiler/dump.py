"""The debug dump: every captured graph, its split, its segments and their AOTAutograd graphs, and the plan.

Layout (one folder per rank and per captured graph; a recompile gets a new folder, nothing is overwritten)::

    DIR/README.txt
    DIR/rank0/graph0/captured.py        the graph Dynamo captured
    DIR/rank0/graph0/split.py           the stitched module: one call per segment
    DIR/rank0/graph0/segments/submod_K.py
    DIR/rank0/graph0/aot/submod_K.forward.py, submod_K.backward.py
    DIR/rank0/graph0/buckets.txt        bucket table (tabulate) and segment table
    DIR/rank0/graph0/plan.json          the same, machine-readable, with the fingerprint and versions

Enabled by ``graphddp.backend(..., debug_dir=DIR)`` or ``GRAPHDDP_DEBUG_DIR=DIR``. With the dump off nothing
here runs; with it on, the AOT graphs come from a separate trace, so what is compiled does not change.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import fx

from .._version import __version__
from ..passes import BucketPlan, GraphSplit, arrange_reductions
from ..passes.report import BUCKET_HEADERS, SEGMENT_HEADERS, bucket_rows, plan_record, segment_rows
from ..runtime import in_graph_blocks  # noqa: F401  (registers the ops arrange_reductions puts in)
from .capture import as_fake

ENV_VAR = "GRAPHDDP_DEBUG_DIR"

README = """graphddp debug dump
===================
One folder per rank (rankN/) and, inside, one per graph Dynamo captured (graphN/; a recompile gets the next
free name, nothing is overwritten). In each graph folder:

  captured.py       the FX graph Dynamo captured (what graphddp.backend received)
  split.py          the stitched graph: one call per segment (submod_K), in forward order
  segments/         each segment's code (submod_K.py)
  aot/              the forward and backward graphs AOTAutograd made of each segment
                    (submod_K.forward.py, submod_K.backward.py)
  buckets.txt       the bucket plan: bucket index, bytes, parameter count, segment, whether that segment was
                    extended to have an output, parameter names; then one line per segment
  plan.json         the same plan, machine-readable: buckets (parameter names, dtypes, bytes), segments (node
                    counts, activation bytes crossing into each), the fingerprint ranks compare, versions

See docs/debug-dump.md in the graphddp repository for how to read them.
"""


class DebugDump:
    """Writes dumps under ``root``; checks at construction that ``root`` can be written."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".graphddp-write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(
                f"graphddp: cannot write the debug dump to {str(self.root)!r} ({e.strerror or e}). Pass a writable "
                f"debug_dir, or unset {ENV_VAR}."
            ) from None
        (self.root / "README.txt").write_text(README)

    @classmethod
    def from_argument_or_env(cls, debug_dir: str | os.PathLike[str] | None) -> DebugDump | None:
        target = debug_dir if debug_dir is not None else os.environ.get(ENV_VAR) or None
        return cls(target) if target is not None else None

    def graph_folder(self, graph: str) -> Path:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        base = self.root / f"rank{rank}"
        folder, n = base / graph, 1
        while folder.exists():  # never overwrite an earlier dump
            folder, n = base / f"{graph}_{n}", n + 1
        folder.mkdir(parents=True)
        return folder

    def write_graph(
        self,
        folder: Path,
        *,
        graph: str,
        captured: fx.GraphModule,
        plan: BucketPlan,
        split: GraphSplit,
        split_gm: fx.GraphModule | None,
    ) -> None:
        """Everything but the AOT graphs (written per segment by ``write_aot``)."""
        (folder / "captured.py").write_text(_code(captured))
        if split_gm is not None:
            (folder / "split.py").write_text(_code(split_gm))
            (folder / "segments").mkdir(exist_ok=True)
            for name, module in split_gm.named_children():
                if isinstance(module, fx.GraphModule):
                    (folder / "segments" / f"{name}.py").write_text(_code(module))
        (folder / "buckets.txt").write_text(
            f"graph {graph}, fingerprint {plan.fingerprint}, caps in bytes: bucket {plan.caps.bucket}, first "
            f"{plan.caps.first}, last {plan.caps.last}\n\n"
            + tabulate(bucket_rows(plan, split), headers=BUCKET_HEADERS)
            + "\n\n"
            + tabulate(segment_rows(split), headers=SEGMENT_HEADERS)
            + "\n"
        )
        (folder / "plan.json").write_text(json.dumps(plan_record(plan, split, graph=graph, versions=versions()), indent=2) + "\n")

    def write_aot(self, folder: Path, segments: dict[str, tuple[fx.GraphModule, list[Any]]], fake_mode: Any) -> None:
        """Trace each segment once more with AOTAutograd and keep the forward and backward graphs it makes.

        ``segments`` maps a name to the segment and its inputs (real or fake). The traces run in a tracing
        context of their own, after the real compiles, so they cannot change what was compiled.
        """
        aot = folder / "aot"
        aot.mkdir(exist_ok=True)
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            for name, (segment, args) in segments.items():
                fake_args = [as_fake(a, fake_mode) for a in args]
                try:
                    for kind, code in aot_graphs(segment, fake_args).items():
                        (aot / f"{name}.{kind}.py").write_text(code)
                except Exception as e:  # a diagnostic must not break compilation
                    (aot / f"{name}.error.txt").write_text(f"AOTAutograd could not trace this segment: {e!r}\n")


def aot_graphs(module: fx.GraphModule, fake_args: list[Any]) -> dict[str, str]:
    """The forward and backward graphs AOTAutograd makes of ``module`` (its code, as text)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, str] = {}

    def keep(kind: str):
        def compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            if kind == "backward" and arrange_reductions(gm.graph):  # in-graph reduction: as graphddp compiles it
                gm.recompile()
            graphs[kind] = _code(gm)
            return make_boxed_func(gm.forward)

        return compiler

    graph = copy.deepcopy(module.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):  # AOTAutograd wants a tuple of outputs
        output.args = ((output.args[0],),)
    copy_ = fx.GraphModule(module, graph)
    # AOTAutograd may lower the backward lazily, at the first backward call; the dump wants it now.
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        aot_module_simplified(copy_, fake_args, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    return graphs


def versions() -> dict[str, str]:
    return {"graphddp": __version__, "torch": torch.__version__}


def _code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)
