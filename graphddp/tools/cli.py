"""The ``graphddp`` command: ``graphddp demo`` (train a small GPT on spawned ranks) and ``graphddp inspect`` (a model's
bucket plan and graph split, without ranks)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

from .._version import __version__
from ..options import BucketOptions
from ..passes import REDUCTIONS
from .bucket_args import add_bucket_arguments, bucket_options
from .demo import DemoOptions, run_demo
from .launch import LOG_FORMAT


def inner_backend(name: str) -> str:
    """``--inner``: a Dynamo backend name, checked before any rank starts (argparse: one line, exit 2)."""
    import torch

    if name == "graphddp":
        raise argparse.ArgumentTypeError("graphddp is the splitting backend itself; name the compiler of each segment")
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        usual = ", ".join(b for b in torch._dynamo.list_backends() if b != "graphddp")
        raise argparse.ArgumentTypeError(f"unknown backend {name!r}; for example {usual}")
    return name


def log_level(name: str) -> str:
    """``--log-level``: one of logging's level names, any case."""
    level = name.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"unknown level {name!r}; choose DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def torch_version() -> str:
    """The installed torch's version, read from its metadata (``graphddp --version`` needs no import of it)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphddp", description="Distributed data parallel that works with torch.compile")
    parser.add_argument("--log-level", type=log_level, default="WARNING", help="logging level for graphddp (INFO shows one line per rank)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (torch {torch_version()})")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small GPT on 2 spawned gloo ranks with graphddp under torch.compile")
    defaults = DemoOptions()
    demo.add_argument("--workload", default=defaults.workload, help="gpt, mlp or cnn")
    demo.add_argument("--size", default=defaults.size, help="tiny, small or bench")
    demo.add_argument("--steps", type=int, default=defaults.steps)
    demo.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks to spawn (not under torchrun)")
    demo.add_argument("--inner", type=inner_backend, default=defaults.inner, help="inner compiler per segment: inductor (default), aot_eager (compiles in seconds), eager")
    add_bucket_arguments(demo, defaults, note="smaller than graphddp.DDP's defaults, so the small model gets several buckets")

    commands.add_parser(
        "bench", add_help=False, help="the benchmark: graphddp bench [matrix|overhead|scale|gpu] ARGS (--help: its own)"
    )

    inspect = commands.add_parser(
        "inspect", help="show a model's bucket plan and graph split, in one process, without launching ranks"
    )
    inspect.add_argument("target", help="gpt, mlp, cnn, or package.module:factory returning (model, example_inputs)")
    inspect.add_argument("--world-size", type=int, default=2, help="ranks of the run to plan for (embedding tables are row-sparse when few enough rows are touched on all ranks together)")
    inspect.add_argument("--batch", type=int, default=None, help="batch size of a built-in workload")
    inspect.add_argument("--size", default="small", help="size of a built-in workload: tiny, small or bench")
    inspect.add_argument("--dump", default=None, metavar="DIR", help="also write the debug dump (with AOT graphs) to DIR")
    inspect.add_argument("--link", default=None, metavar="RATE[:LATENCY]", help="also predict the step on this link, e.g. 2gbit or 10gbit:20us (Note [Step cost model]); compute is estimated from the graph at this machine's rates")
    inspect.add_argument("--comm-cpu", type=float, default=0.0, metavar="MS_PER_MB", help="compute each MB sent costs a rank, as a CPU run logs it ('communication costs X ms of compute per MB'): charged on --link to a tied table's part, automatic caps and the predictions (default 0: not charged)")
    inspect.add_argument("--launch-us", type=float, default=0.0, metavar="US", help="what launching one collective costs the backward's thread, as a run logs it ('launching a collective costs X us'): charged on --link to every bucket, by automatic caps and in the predictions (default 0: not charged)")
    inspect.add_argument("--reduction", choices=REDUCTIONS, default="auto", help="how a compiled run reduces each graph: in-graph where it can (auto), split, in_graph (Note [In-graph reduction])")
    inspect.add_argument("--format", choices=("table", "json"), default="table")
    inspect.add_argument("--verbose", action="store_true", help="show the traceback of an error in TARGET")
    add_bucket_arguments(
        inspect, BucketOptions(), note="graphddp.DDP's defaults; auto chooses the caps of each graph as a compiled run "
        "does, for --link and --world-size (Note [Automatic caps])",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)  # what follows `bench` is the benchmark's own command line
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    if args.command == "demo":
        try:
            options = DemoOptions(
                workload=args.workload,
                size=args.size,
                steps=args.steps,
                world_size=args.world_size,
                inner=args.inner,
                **bucket_options(args).bucket_kwargs(),
            )
        except (TypeError, ValueError) as e:
            print(f"graphddp demo: {e}", file=sys.stderr)
            return 2
        run_demo(options, log_level=args.log_level)  # the ranks log at the same level
    elif args.command == "inspect":
        return _inspect(args)
    elif args.command == "bench":
        return run_bench(argv[argv.index("bench") + 1 :])
    return 0


BENCH_TOOLS = ("matrix", "overhead", "scale", "gpu")
"""``graphddp bench TOOL ...``: ``graphddp.bench.TOOL``'s command line; without a tool, ``graphddp.bench``'s."""


def run_bench(argv: list[str]) -> int:
    """The benchmark as installed (``bench/`` ships as ``graphddp.bench``), imported only when asked for."""
    import importlib

    tool = argv[0] if argv and argv[0] in BENCH_TOOLS else "__main__"
    module = importlib.import_module(f"graphddp.bench.{tool}")
    return int(module.main(argv[1:] if tool != "__main__" else argv) or 0)


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import InspectError, inspect_target, render

    if os.getcwd() not in sys.path:  # `graphddp inspect mymodels:factory` finds mymodels.py where it runs
        sys.path.insert(0, os.getcwd())

    try:
        inspection = inspect_target(
            args.target,
            **bucket_options(args).bucket_kwargs(),
            world_size=args.world_size,
            batch=args.batch,
            size=args.size,
            dump=args.dump,
            link=args.link,
            reduction=args.reduction,
            comm_cpu_ms_per_mb=args.comm_cpu,
            launch_us=args.launch_us,
        )
    except (InspectError, ValueError, TypeError) as e:
        if args.verbose:
            raise
        print(f"graphddp inspect: {e}", file=sys.stderr)
        return 2
    print(render(inspection, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
