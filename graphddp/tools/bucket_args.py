"""The bucket arguments of every command that plans buckets: ``graphddp demo``, ``graphddp inspect`` and
``python -m bench``. One set of flags, help texts and checks, so a cap means the same on every command line; each
command gives its own defaults (the demo's caps are smaller, so its small model gets several buckets to show).

``add_bucket_arguments(parser, defaults)`` adds the flags; ``bucket_options(args)`` reads them back as the
``graphddp.ddp.BucketOptions`` that ``graphddp.DDP`` and the tools' option classes take.
"""

from __future__ import annotations

import argparse
import math

from ..options import AUTO, BucketOptions

CAP_FLAGS = ("--bucket-cap-mb", "--first-bucket-cap-mb", "--last-bucket-cap-mb")
"""The flags of the three caps, in ``BucketOptions``' order (each one's value lands in the field of its name)."""

_CAP_HELP = {
    "--bucket-cap-mb": "cap of the buckets in the middle of backward",
    "--first-bucket-cap-mb": "cap of the first bucket, small so the first all-reduce starts early in backward",
    "--last-bucket-cap-mb": "cap of the last bucket, small so little is left to all-reduce after backward",
}


def cap_mb(text: str) -> float | str:
    """A cap's value on the command line: a finite number of MiB >= 0 (0: a one-byte cap, as PyTorch's DDP takes
    it), or ``auto`` (argparse names the flag of a bad one: ``argument --bucket-cap-mb: ...``, exit status 2)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MiB or {AUTO}, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be a finite number of MiB >= 0 or {AUTO}, got {text!r}")
    return value


def channel_count(text: str) -> int | str:
    """``--channels``: a whole number of process groups >= 1, or auto (argparse names the flag of a bad one)."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of process groups >= 1 or {AUTO}, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (1: every bucket on the DDP's own group), got {text!r}")
    return value


def add_bucket_arguments(parser: argparse.ArgumentParser, defaults: BucketOptions, *, note: str | None = None) -> None:
    """The caps, ``--no-bucket-ramps``, ``--no-sparse-embedding-grads`` and ``--channels``, in a group of their own; ``defaults``
    gives each flag's default, ``note`` what the command does with them (the group's description)."""
    group = parser.add_argument_group("buckets", note)
    for flag in CAP_FLAGS:
        field = _field(flag)
        group.add_argument(
            flag, dest=field, type=cap_mb, default=getattr(defaults, field), metavar="MiB|auto",
            help=f"{_CAP_HELP[flag]}, in MiB, or {AUTO}: chosen from the step cost model (Note [Automatic caps]) "
            "(default: %(default)s)",
        )  # fmt: skip
    group.add_argument(
        "--no-bucket-ramps", dest="bucket_ramps", action="store_false", default=defaults.bucket_ramps,
        help="PyTorch's bucket layout: no caps doubling from the first bucket's up and halving down to the last's "
        "(Note [Bucket ramps])",
    )  # fmt: skip
    group.add_argument(
        "--sparse-embedding-grads", dest="sparse_embedding_grads", type=_rows_choice, default=defaults.sparse_embedding_grads,
        metavar="auto|on|off",
        help="embedding tables' gradients reduced as the rows a batch touched: on, off, or auto: where the step cost "
        "model says they pay on the link (Note [Row-sparse gradients]) (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--no-sparse-embedding-grads", dest="sparse_embedding_grads", action="store_const", const=False,
        default=defaults.sparse_embedding_grads,
        help="every bucket all-reduced dense: no row-sparse buckets, no parts (--sparse-embedding-grads off)",
    )  # fmt: skip
    group.add_argument(
        "--channels", type=channel_count, default=defaults.channels, metavar="K",
        help="process groups the buckets are reduced on in turn, up to K all-reduces in flight (Note [Channels]) "
        "(default: %(default)s)",
    )  # fmt: skip


def bucket_options(args: argparse.Namespace) -> BucketOptions:
    """The options ``add_bucket_arguments`` parsed (checked again by ``BucketOptions`` itself)."""
    return BucketOptions(
        **{_field(flag): getattr(args, _field(flag)) for flag in CAP_FLAGS},
        bucket_ramps=args.bucket_ramps,
        sparse_embedding_grads=args.sparse_embedding_grads,
        channels=args.channels,
    )


def _rows_choice(text: str) -> bool | str:
    """``--sparse-embedding-grads``: ``auto``, ``on`` or ``off``."""
    choices = {AUTO: AUTO, "on": True, "off": False}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return choices[text]


def _field(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
