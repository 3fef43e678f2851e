"""Built-in workloads: a small GPT, an MLP and a ResNet-style CNN, each with a batch maker.

One place for the models that the demo, ``graphddp inspect gpt|mlp|cnn``, the tests and the benchmark train, so
that they all exercise the same shapes:

* ``gpt``: a nanoGPT-style decoder whose ``lm_head`` weight is *tied* to the token embedding, so one parameter
  receives gradients from two places (the case a DDP bucket plan must count once);
* ``mlp``: a plain Linear+ReLU stack, the simplest graph to look at;
* ``cnn``: residual blocks with BatchNorm, i.e. modules with buffers that change in the forward pass.

``build_workload(name, size=...)`` returns a ``Workload``: the model, initialised deterministically from ``seed``,
and ``make_batch(generator)``, which draws one random batch (inputs *and* targets) from the generator it is given,
so that ``model(*workload.make_batch(g))`` is a scalar loss and the caller decides what is deterministic.

Sizes: ``tiny`` for unit tests (forward+backward in a few ms), ``small`` for the demo (about 1M parameters,
well under 0.1 s a step on 2 CPU cores) and ``bench`` for the benchmark (0.1-1 s a step on 2 CPU cores; the GPT
has about 23M parameters).

This module depends on torch and the standard library only; it does not import ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CNN",
    "GPT",
    "MLP",
    "SIZES",
    "WORKLOADS",
    "GPTConfig",
    "Workload",
    "build_workload",
    "count_parameters",
]

WORKLOADS = ("gpt", "mlp", "cnn")
SIZES = ("tiny", "small", "bench")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass, but `n_layer=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------------------
# GPT


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a ``GPT``."""

    vocab_size: int
    """Number of token ids; the logits have this last dimension."""
    block_size: int
    """Longest sequence the position embedding covers; inputs may be shorter, never longer."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches (train mode only)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have a bias (``lm_head`` never has one: its weight is tied)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(f"dropout must be a float, got {type(self.dropout).__name__} {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be a bool, got {type(self.bias).__name__} {self.bias!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # One fused Linear for q, k and v: one matmul instead of three.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence length, n_embd
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        # [B, T, C] -> [B, n_head, T, head_size]: heads become a batch dimension.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # is_causal=True builds the mask inside the kernel: no [T, T] buffer to register or slice.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, n_head, T, head_size] -> [B, T, C]
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # [B, T, C] -> [B, T, 4C] -> [B, T, C]


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LayerNorm: the residual stream itself is never normalised, which keeps deep stacks trainable.
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """A small GPT-style decoder; ``lm_head.weight`` is the very same Parameter as ``wte.weight``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter, two uses, so its gradient is the sum of both contributions.
        # named_parameters() lists it once, as "wte.weight".
        self.lm_head.weight = self.wte.weight
        self.apply(_init_gpt_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape  # idx: LongTensor [B, T]
        # A check on a shape, not on tensor values: torch.compile turns it into a guard, not a graph break.
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C] + [T, C] -> [B, T, C]
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


def _init_gpt_weights(module: nn.Module) -> None:
    # GPT-2 style init; LayerNorm keeps its default (weight 1, bias 0).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# ---------------------------------------------------------------------------------------------------------------------
# MLP


class MLP(nn.Module):
    """Linear+ReLU stack: ``sizes=(64, 128, 128, 10)`` maps 64 features to 10 class logits through two hidden layers."""

    def __init__(self, *, sizes: Sequence[int]) -> None:
        super().__init__()
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__} {sizes!r}")
        if len(sizes) < 2:
            raise ValueError(f"sizes needs at least an input and an output width, got {tuple(sizes)!r}")
        for i, width in enumerate(sizes):
            _check_int(f"sizes[{i}]", width, minimum=1)
        self.sizes = tuple(sizes)
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(self.sizes) - 2:  # no ReLU on the logits
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.net(x)  # [B, sizes[0]] -> [B, sizes[-1]]
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)  # targets: LongTensor [B] of class indices


# ---------------------------------------------------------------------------------------------------------------------
# CNN


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus a shortcut, then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        # Convolutions feeding a BatchNorm need no bias: BN subtracts the mean right away.
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            # The identity cannot be added when the shape changes: project with a strided 1x1 conv.
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # [B, C_in, H, W] -> [B, C_out, H/s, W/s]
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CNN(nn.Module):
    """ResNet-style classifier for 3x32x32 images.

    Stage ``i`` has ``blocks_per_stage[i]`` BasicBlocks of ``width * 2**i`` channels; every stage but the first
    halves the resolution in its first block.
    """

    def __init__(self, *, width: int = 16, blocks_per_stage: Sequence[int] = (1, 1, 1), num_classes: int = 10) -> None:
        super().__init__()
        _check_int("width", width, minimum=1)
        _check_int("num_classes", num_classes, minimum=1)
        if isinstance(blocks_per_stage, (str, bytes)) or not isinstance(blocks_per_stage, Sequence):
            raise TypeError(f"blocks_per_stage must be a sequence of ints, got {blocks_per_stage!r}")
        if not blocks_per_stage:
            raise ValueError("blocks_per_stage needs at least one stage")
        for i, n in enumerate(blocks_per_stage):
            _check_int(f"blocks_per_stage[{i}]", n, minimum=1)
        self.width = width
        self.blocks_per_stage = tuple(blocks_per_stage)
        self.num_classes = num_classes

        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        channels = width
        for i, n_blocks in enumerate(self.blocks_per_stage):
            out_channels = width * 2**i
            blocks = [BasicBlock(channels, out_channels, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(out_channels, out_channels, stride=1) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stages(self.stem(x))  # [B, 3, 32, 32] -> [B, width * 2**(stages-1), 32 / 2**(stages-1), ...]
        logits = self.fc(torch.flatten(self.pool(x), 1))  # [B, C, 1, 1] -> [B, C] -> [B, num_classes]
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)  # targets: LongTensor [B] of class indices


# ---------------------------------------------------------------------------------------------------------------------
# Registry


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and a way to draw batches for it: ``model(*make_batch(generator))`` is a scalar loss."""

    name: str
    """One of ``WORKLOADS``."""
    model: nn.Module
    """The model, on CPU, in train mode, initialised from the seed given to ``build_workload``."""
    make_batch: Callable[[torch.Generator], tuple]
    """Draws one batch (inputs then targets) from the generator, on the generator's device."""
    description: str
    """One human-readable line: architecture, batch, parameter count."""
    size: str = "small"
    """One of ``SIZES``."""
    batch_size: int = 0
    """Number of samples (sequences for gpt) per batch."""


# Per workload and size: the model's options and the default batch size.
# "small" stays well under 0.1 s and "bench" within 0.1-1 s a forward+backward on 2 CPU cores.
_GPT_SIZES = {
    "tiny": (GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 4),
    "small": (GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128), 8),
    "bench": (GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512), 4),
}
_MLP_SIZES = {
    "tiny": ({"sizes": (32, 64, 64, 10)}, 16),
    "small": ({"sizes": (256, 1024, 1024, 10)}, 64),
    "bench": ({"sizes": (1024, 4096, 4096, 4096, 10)}, 256),
}
_CNN_SIZES = {
    "tiny": ({"width": 8, "blocks_per_stage": (1, 1), "num_classes": 10}, 4),
    "small": ({"width": 32, "blocks_per_stage": (1, 1, 1, 1), "num_classes": 10}, 8),
    "bench": ({"width": 32, "blocks_per_stage": (2, 2, 2, 2), "num_classes": 10}, 32),
}


def _gpt_batch(generator: torch.Generator, *, batch_size: int, block_size: int, vocab_size: int) -> tuple:
    # Learnable synthetic text: each row counts from a random start by a random stride (mod vocab), so the
    # next token follows from the previous two and the demo's loss visibly falls. Targets are the inputs
    # shifted by one (next-token prediction).
    device = generator.device
    start = torch.randint(vocab_size, (batch_size, 1), generator=generator, device=device)
    stride = torch.randint(1, 8, (batch_size, 1), generator=generator, device=device)
    seq = (start + stride * torch.arange(block_size + 1, device=device)) % vocab_size  # [B, T + 1]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # idx [B, T], targets [B, T]


def _mlp_batch(generator: torch.Generator, *, batch_size: int, in_features: int, num_classes: int) -> tuple:
    x = torch.randn(batch_size, in_features, generator=generator, device=generator.device)  # [B, in_features]
    y = torch.randint(num_classes, (batch_size,), generator=generator, device=generator.device)  # [B]
    return x, y


def _cnn_batch(generator: torch.Generator, *, batch_size: int, num_classes: int) -> tuple:
    x = torch.randn(batch_size, 3, 32, 32, generator=generator, device=generator.device)  # [B, 3, 32, 32]
    y = torch.randint(num_classes, (batch_size,), generator=generator, device=generator.device)  # [B]
    return x, y


def _build_gpt(size: str, batch_size: int | None) -> tuple[nn.Module, Callable, int, str]:
    config, default_batch = _GPT_SIZES[size]
    batch_size = default_batch if batch_size is None else batch_size
    make_batch = functools.partial(
        _gpt_batch, batch_size=batch_size, block_size=config.block_size, vocab_size=config.vocab_size
    )
    text = (
        f"GPT: {config.n_layer} layers, {config.n_head} heads, n_embd {config.n_embd}, vocab {config.vocab_size}, "
        f"tied lm_head; batch {batch_size}x{config.block_size} tokens"
    )
    return GPT(config), make_batch, batch_size, text


def _build_mlp(size: str, batch_size: int | None) -> tuple[nn.Module, Callable, int, str]:
    options, default_batch = _MLP_SIZES[size]
    batch_size = default_batch if batch_size is None else batch_size
    sizes = options["sizes"]
    make_batch = functools.partial(_mlp_batch, batch_size=batch_size, in_features=sizes[0], num_classes=sizes[-1])
    text = f"MLP: widths {'-'.join(map(str, sizes))}, ReLU; batch {batch_size}"
    return MLP(**options), make_batch, batch_size, text


def _build_cnn(size: str, batch_size: int | None) -> tuple[nn.Module, Callable, int, str]:
    options, default_batch = _CNN_SIZES[size]
    batch_size = default_batch if batch_size is None else batch_size
    make_batch = functools.partial(_cnn_batch, batch_size=batch_size, num_classes=options["num_classes"])
    text = (
        f"CNN: ResNet-style, width {options['width']}, blocks per stage {options['blocks_per_stage']}, BatchNorm, "
        f"{options['num_classes']} classes; batch {batch_size}x3x32x32"
    )
    return CNN(**options), make_batch, batch_size, text


_BUILDERS = {"gpt": _build_gpt, "mlp": _build_mlp, "cnn": _build_cnn}


def build_workload(name: str, *, size: str = "small", batch_size: int | None = None, seed: int = 0) -> Workload:
    """Build the workload ``name`` (one of ``WORKLOADS``) at ``size`` (one of ``SIZES``).

    The parameters depend on ``seed`` only: the same seed gives the same model on every rank, and the global RNG
    state is left as it was. ``batch_size`` overrides the size's default batch size.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if not isinstance(size, str):
        raise TypeError(f"size must be a str, got {type(size).__name__} {size!r}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if batch_size is not None:
        _check_int("batch_size", batch_size, minimum=1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")

    # fork_rng restores the CPU RNG on exit; devices=[] because the model is built on CPU (and touching CUDA RNGs
    # would initialise CUDA for nothing).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, make_batch, batch_size, text = _BUILDERS[name](size, batch_size)
    model.train()
    description = f"{name} ({size}): {text}; {_format_count(count_parameters(model))} parameters"
    return Workload(name, model, make_batch, description, size=size, batch_size=batch_size)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; a Parameter shared by several modules (tied weights) counts once."""
    seen: set[int] = set()
    total = 0
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _format_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.1f}k"
    return str(n)
