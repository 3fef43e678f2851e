"""``python -m bench``: every mode in one run, a table, JSON, pictures, and the ratios that matter."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from graphddp.tools.bucket_args import add_bucket_arguments, bucket_options
from graphddp.tools.cli import inner_backend

from .allocator import ALLOCATORS
from .interleave import INTERLEAVINGS
from .link import Link, LinkUnavailable
from .modes import MODES
from .pictures import chrome_trace, draw
from .run import BenchOptions, run, table


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through `with Link(...)`, which removes the namespaces


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    d = BenchOptions()
    parser.add_argument("--workload", default=d.workload, choices=("gpt", "mlp", "cnn"))
    parser.add_argument("--size", default=d.size, choices=("tiny", "small", "bench"))
    parser.add_argument("--batch-size", type=int, default=None, help="per rank (default: the size's own)")
    parser.add_argument("--world-size", type=int, default=d.world_size)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--iters", type=int, default=d.iters)
    parser.add_argument("--rounds", type=int, default=d.rounds, help="spread the timed iterations over this many rounds through all modes")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--no-pin", action="store_true", help="let the OS place the ranks (default: each rank on a CPU of its own, when there are enough)")
    parser.add_argument("--inner", type=inner_backend, default=d.inner, help="inner compiler of both compiled modes")
    parser.add_argument("--link", default=d.link, help="loopback, or RATE[:DELAY] such as 2gbit or 1gbit:2ms")
    parser.add_argument("--out", default=d.out, help="folder for JSON, PNG and trace files")
    parser.add_argument(
        "--allocator", choices=ALLOCATORS, default=d.allocator,
        help="the ranks' CPU allocator: system, or retain (freed memory kept for reuse: no page faults; bench/allocator.py)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", choices=INTERLEAVINGS, default=d.interleave,
        help="modes: one mode alive at a time, its iterations in a row; steps: every mode alive, one iteration of each in turn",
    )  # fmt: skip
    add_bucket_arguments(
        parser, d, note="graphddp's modes and the comm mode plan with these caps; PyTorch's modes take --bucket-cap-mb "
        "only (their first bucket is PyTorch's own 1 MiB, with no ramps). The run's caps are numbers: time auto as a "
        "mode, graphddp-compiled@auto",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    try:
        options = BenchOptions(
            workload=args.workload, size=args.size, batch_size=args.batch_size, world_size=args.world_size,
            modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), iters=args.iters, rounds=args.rounds, warmup=args.warmup, pin=not args.no_pin,
            inner=args.inner, link=args.link, allocator=args.allocator, interleave=args.interleave, out=args.out, **bucket_options(args).bucket_kwargs(),
        )  # fmt: skip
        if options.link != "loopback":
            Link.check_available()
    except (ValueError, LinkUnavailable) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    print(f"bench: {options.workload} ({options.size}), {options.world_size} ranks, link {options.link}, modes {', '.join(options.modes)}", flush=True)
    try:
        summary = run(options)
    except LinkUnavailable as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    out = Path(options.out)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    chrome_trace(summary, out / "trace.json")
    pictures = draw(summary, out)
    print(table(summary))
    print(f"written: {out / 'results.json'}, {out / 'trace.json'}" + "".join(f", {p}" for p in pictures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
