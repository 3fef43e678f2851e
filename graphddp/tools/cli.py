"""The ``graphddp`` command: ``graphddp demo`` (more subcommands arrive with the backend and the benchmark)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .demo import DemoOptions, run_demo


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphddp", description="Distributed data parallel that works with torch.compile")
    parser.add_argument("--log-level", type=log_level, default="WARNING", help="logging level for graphddp (INFO shows one line per rank)")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small GPT on 2 spawned gloo ranks with graphddp under torch.compile")
    defaults = DemoOptions()
    demo.add_argument("--workload", default=defaults.workload, help="gpt, mlp or cnn")
    demo.add_argument("--size", default=defaults.size, help="tiny, small or bench")
    demo.add_argument("--steps", type=int, default=defaults.steps)
    demo.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks to spawn (not under torchrun)")
    demo.add_argument("--bucket-cap-mb", type=float, default=defaults.bucket_cap_mb)
    demo.add_argument("--first-bucket-cap-mb", type=float, default=defaults.first_bucket_cap_mb)
    demo.add_argument("--last-bucket-cap-mb", type=float, default=defaults.last_bucket_cap_mb)
    demo.add_argument("--no-bucket-ramps", action="store_true", help="PyTorch's bucket layout (Note [Bucket ramps])")
    demo.add_argument("--no-sparse-embedding-grads", action="store_true", help="every bucket all-reduced dense (Note [Row-sparse gradients])")
    demo.add_argument("--inner", type=inner_backend, default=defaults.inner, help="inner compiler per segment: inductor (default), aot_eager (compiles in seconds), eager")

    inspect = commands.add_parser(
        "inspect", help="show a model's bucket plan and graph split, in one process, without launching ranks"
    )
    inspect.add_argument("target", help="gpt, mlp, cnn, or package.module:factory returning (model, example_inputs)")
    inspect.add_argument("--bucket-cap-mb", type=float, default=25)
    inspect.add_argument("--first-bucket-cap-mb", type=float, default=1)
    inspect.add_argument("--last-bucket-cap-mb", type=float, default=1)
    inspect.add_argument("--no-bucket-ramps", action="store_true", help="PyTorch's bucket layout (Note [Bucket ramps])")
    inspect.add_argument("--no-sparse-embedding-grads", action="store_true", help="no row-sparse buckets, no parts (Note [Row-sparse gradients])")
    inspect.add_argument("--world-size", type=int, default=2, help="ranks of the run to plan for (embedding tables are row-sparse when few enough rows are touched on all ranks together)")
    inspect.add_argument("--batch", type=int, default=None, help="batch size of a built-in workload")
    inspect.add_argument("--size", default="small", help="size of a built-in workload: tiny, small or bench")
    inspect.add_argument("--dump", default=None, metavar="DIR", help="also write the debug dump (with AOT graphs) to DIR")
    inspect.add_argument("--link", default=None, metavar="RATE[:LATENCY]", help="also predict the step on this link, e.g. 2gbit or 10gbit:20us (Note [Step cost model]); compute is estimated from the graph at this machine's rates")
    inspect.add_argument("--format", choices=("table", "json"), default="table")
    inspect.add_argument("--verbose", action="store_true", help="show the traceback of an error in TARGET")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        try:
            options = DemoOptions(
                workload=args.workload,
                size=args.size,
                steps=args.steps,
                world_size=args.world_size,
                bucket_cap_mb=args.bucket_cap_mb,
                first_bucket_cap_mb=args.first_bucket_cap_mb,
                last_bucket_cap_mb=args.last_bucket_cap_mb,
                bucket_ramps=not args.no_bucket_ramps,
                sparse_embedding_grads=not args.no_sparse_embedding_grads,
                inner=args.inner,
            )
        except (TypeError, ValueError) as e:
            print(f"graphddp demo: {e}", file=sys.stderr)
            return 2
        run_demo(options)
    elif args.command == "inspect":
        return _inspect(args)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import InspectError, inspect_target, render

    if os.getcwd() not in sys.path:  # `graphddp inspect mymodels:factory` finds mymodels.py where it runs
        sys.path.insert(0, os.getcwd())

    try:
        inspection = inspect_target(
            args.target,
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            last_bucket_cap_mb=args.last_bucket_cap_mb,
            bucket_ramps=not args.no_bucket_ramps,
            sparse_embedding_grads=not args.no_sparse_embedding_grads,
            world_size=args.world_size,
            batch=args.batch,
            size=args.size,
            dump=args.dump,
            link=args.link,
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
