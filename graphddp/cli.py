"""The ``graphddp`` command: ``graphddp demo`` (more subcommands arrive with the backend and the benchmark)."""

from __future__ import annotations

import argparse
import logging
import sys

from .demo import DemoOptions, run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphddp", description="Distributed data parallel that works with torch.compile")
    parser.add_argument("--log-level", default="WARNING", help="logging level for graphddp (INFO shows one line per rank)")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small GPT on 2 spawned gloo ranks with graphddp under torch.compile")
    defaults = DemoOptions()
    demo.add_argument("--workload", default=defaults.workload, help="gpt, mlp or cnn")
    demo.add_argument("--size", default=defaults.size, help="tiny, small or bench")
    demo.add_argument("--steps", type=int, default=defaults.steps)
    demo.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks to spawn (not under torchrun)")
    demo.add_argument("--bucket-cap-mb", type=float, default=defaults.bucket_cap_mb)
    demo.add_argument("--first-bucket-cap-mb", type=float, default=defaults.first_bucket_cap_mb)
    demo.add_argument("--inner", default=defaults.inner, help="inner compiler per segment: inductor (default), aot_eager (compiles in seconds), eager")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        try:
            options = DemoOptions(
                workload=args.workload,
                size=args.size,
                steps=args.steps,
                world_size=args.world_size,
                bucket_cap_mb=args.bucket_cap_mb,
                first_bucket_cap_mb=args.first_bucket_cap_mb,
                inner=args.inner,
            )
        except (TypeError, ValueError) as e:
            print(f"graphddp demo: {e}", file=sys.stderr)
            return 2
        run_demo(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
