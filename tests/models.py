"""The models the tests train, and their data: one registry, so a case names a model and gets its batches and loss.

Three families, told apart by name:

* regression models (``mlp``, ``branchy``, ...): ``x [B, IN] -> [B, OUT]``, MSE against ``y [B, OUT]``;
* token models (``gpt``, ``gpt_untied``, ``broken``, ``bag``): an embedding table of ``vocab`` rows, looked up
  with random token ids (Note [Row-sparse gradients]); the model returns its loss;
* models reading data-dependent values (``scalars_*``, ...): ``x [B, IN]`` and integer codes ``[B]``, the
  mean square of the output as the loss;
* ``hf:gpt2``, ``hf:bert``: Hugging Face models built from tiny configs (``transformers``, the test extra);
* ``w:<workload>[:<size>]``: a graphddp workload (``graphddp.tools.workloads``; size ``tiny`` unless given).

Batches come from seeded generators, so any rank can rebuild any other rank's batch without communication.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphddp.tools.workloads import GPT, GPTConfig, build_workload

IN, OUT = 12, 6
VOCAB = 512  # 4 x 16 tokens per rank: at most 192 of 512 rows on 3 ranks, so the table is row-sparse


# -- regression models -------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Three linear layers; several models below keep these layers and write a forward of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Wide(nn.Module):
    """A 16 KiB weight between two small ones: with 4 KiB caps it alone is sent in pieces (Note [Gradient
    pieces]): 4 blocks of 64 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.big, self.c = nn.Linear(8, 16), nn.Linear(16, 256), nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.big(torch.relu(self.a(x)))))


class Branchy(nn.Module):
    """``shared`` is used on some ranks only (``use_shared`` False on rank 1); ``dead`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, 32)
        self.shared = nn.Linear(32, 32)
        self.dead = nn.Linear(32, 32)
        self.head = nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor, use_shared: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        if use_shared:
            h = F.relu(self.shared(h))
        return self.head(h)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before BatchNorm: its gradient is zero up to rounding, and Adam would amplify the rounding.
        self.fc1, self.bn, self.fc2 = nn.Linear(IN, 32, bias=False), nn.BatchNorm1d(32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class MixedDtypes(nn.Module):
    """A float64 layer followed by float32 layers: buckets must be split by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 32).double()
        self.fc2, self.fc3 = nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x.double())).float()
        return self.fc3(F.relu(self.fc2(h)))


class Unordered(nn.Module):
    """Registered a, b, c but run c, a, b: the reverse registration order is not the ready order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, OUT), nn.Linear(IN, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(F.relu(self.c(x)))))


class InPlace(MLP):
    """In-place ops inside the captured graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x), inplace=True)
        h = self.fc2(h)
        h.mul_(0.5).add_(1.0)
        return self.fc3(F.relu_(h))


class Checkpointed(MLP):
    """``torch.utils.checkpoint`` inside the model: a higher-order op in the captured graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = F.relu(self.fc1(x))
        h = checkpoint(lambda t: F.relu(self.fc2(t)), h, use_reentrant=False)
        return self.fc3(h)


class GraphBreaks(MLP):
    """Three captured graphs: one without parameters, two with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0
        torch._dynamo.graph_break()
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        torch._dynamo.graph_break()
        return self.fc3(h)


class NoGradMiddle(MLP):
    """``fc2`` is first used inside ``torch.no_grad()``: a cut there would leave a compiled segment without grad."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        with torch.no_grad():
            scale = torch.sigmoid(self.fc2(h)) * 2
        return self.fc3(torch.relu(self.fc2(h)) * scale)


class Swapped(nn.Module):
    """Square layers whose order depends on the rank: same parameters, different graphs, different plans."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor, a_first: bool = True) -> torch.Tensor:
        return self.b(F.relu(self.a(x))) if a_first else self.a(F.relu(self.b(x)))


class AutocastInside(nn.Module):
    """``torch.autocast`` around the hidden layers inside forward: cuts fall inside the region."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return self.head(h.float())


class CheckpointKinds(nn.Module):
    """The middle layer under activation checkpointing of ``kind``: ``reentrant`` (``use_reentrant=True``),
    ``selective`` (selective activation checkpointing: matmuls saved, the rest recomputed)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        h = F.relu(self.fc1(x))
        if self.kind == "reentrant":
            h = checkpoint(self._middle, h, use_reentrant=True)
        else:
            policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
            h = checkpoint(self._middle, h, use_reentrant=False, context_fn=policy)
        return self.fc3(h)

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(h)) * 2


class Cond(nn.Module):
    """``torch.cond`` on the data picks one of two layers; both branches hold parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.left, self.right, self.fc3 = (
            nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, OUT)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = torch.cond(h.sum() > 0, lambda t: F.relu(self.left(t)), lambda t: torch.tanh(self.right(t)), (h,))
        return self.fc3(h)


class MutatesBuffers(nn.Module):
    """Buffers updated in forward (a step counter and a running mean), as in normalisation layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        with torch.no_grad():
            self.calls += 1
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.fc3(F.relu(self.fc2(h - self.mean)))


class FlexAttention(nn.Module):
    """One attention layer through ``flex_attention`` with a causal score modification."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qkv, self.out = nn.Linear(IN, 32), nn.Linear(32, 96), nn.Linear(32, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        h = F.relu(self.inp(x)).view(1, x.shape[0], 2, 16).transpose(1, 2)  # [1, heads 2, B as tokens, 16]
        q, k, v = self.qkv(h.transpose(1, 2).reshape(1, x.shape[0], 32)).view(1, x.shape[0], 3, 2, 16).unbind(2)
        causal = lambda score, b, head, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf"))  # noqa: E731
        a = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=causal)
        return self.out(a.transpose(1, 2).reshape(x.shape[0], 32))


REGRESSION = {
    "mlp": MLP,
    "branchy": Branchy,
    "bn": WithBatchNorm,
    "mixed": MixedDtypes,
    "unordered": Unordered,
    "inplace": InPlace,
    "checkpointed": Checkpointed,
    "graph_breaks": GraphBreaks,
    "no_grad_middle": NoGradMiddle,
    "swapped": Swapped,
    "autocast": AutocastInside,
    "checkpoint_reentrant": functools.partial(CheckpointKinds, "reentrant"),
    "checkpoint_selective": functools.partial(CheckpointKinds, "selective"),
    "cond": Cond,
    "mutates_buffers": MutatesBuffers,
    "flex_attention": FlexAttention,
}


# -- data-dependent values (unbacked symbols under capture_scalar_outputs) -----------------------------------------
class ScalarsDirect(MLP):
    """``.item()`` read at the start, used directly in the last segment."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        u = codes[0].item()
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return self.fc3(h) * u


class ScalarsThroughAnOp(ScalarsDirect):
    """An ``.item()`` used through arithmetic, in a middle segment."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        k = codes.sum().item() * 2 + 1
        h = F.relu(self.fc1(x))
        return self.fc3(F.relu(self.fc2(h)) * k)


class ScalarsMany(ScalarsDirect):
    """``.tolist()``: many data-dependent values, used in every segment."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        v = codes.tolist()
        h = F.relu(self.fc1(x)) * v[0]
        h = F.relu(self.fc2(h)) * v[1] + v[2]
        return self.fc3(h) * v[3] - v[4]


class DataDependentRows(ScalarsDirect):
    """``nonzero()``: a data-dependent number of rows flows through later segments."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(codes > 0).squeeze(1)
        h = F.relu(self.fc1(x)).index_select(0, rows)  # [u0, 32]
        return self.fc3(F.relu(self.fc2(h))).sum(0) / (h.shape[0] + 1)


class SizeFromItem(ScalarsDirect):
    """A size read with ``.item()`` at the start, used to build a tensor in a segment that does not bind it."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        n = codes.abs().max().item()
        torch._check_is_size(n)
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return self.fc3(torch.cat([h, h.new_ones(n, 32)])).mean(0)


SCALARS = {
    "scalars_direct": ScalarsDirect,
    "scalars_through_an_op": ScalarsThroughAnOp,
    "scalars_many": ScalarsMany,
    "data_dependent_rows": DataDependentRows,
    "size_from_item": SizeFromItem,
}


# -- token models (embedding tables) -----------------------------------------------------------------------------
def tied_gpt(vocab: int = VOCAB) -> GPT:
    torch.manual_seed(0)
    # No biases: the attention key bias's gradient is zero up to rounding, which Adam would amplify into noise.
    return GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False))


class Bag(nn.Module):
    """An untied embedding table (the mean of the looked-up rows) and a linear head."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(idx).mean(1)), target)  # idx [B, 8] -> [B, 16] -> [B, 8]


class GatedBag(Bag):
    """Bag whose looked-up rows are gated by a layer computed before the lookup: in backward the table's gradient is
    complete before the gate's, so its rows are reduced in the middle of backward, not last."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__(vocab)
        self.gate = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate(idx.float() / idx.shape[1]))  # [B, 8] -> [B, 16], before the lookup
        return F.cross_entropy(self.head(self.emb(idx).mean(1) * gate), target)


class SparseBags(nn.Module):
    """Bag with ``torch.sparse`` gradients: an ``nn.Embedding`` and an ``nn.EmbeddingBag``, both ``sparse=True``."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16, sparse=True)
        self.bag = nn.EmbeddingBag(vocab, 16, mode="sum", sparse=True)
        self.head = nn.Linear(32, 8)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(idx).mean(1), self.bag(idx)], dim=1)  # idx [B, 8] -> [B, 32]
        return F.cross_entropy(self.head(x), target)


class BrokenGPT(GPT):
    """The tied GPT with a graph break between the blocks and the output layer: lookup and lm_head in two graphs."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        torch._dynamo.graph_break()
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


def untied_gpt(vocab: int) -> GPT:
    module = tied_gpt(vocab)
    module.lm_head.weight = nn.Parameter(module.wte.weight.detach().clone())  # the output layer's own weight
    return module


def broken_gpt(vocab: int) -> GPT:
    module = tied_gpt(vocab)
    module.__class__ = BrokenGPT  # same parameters, a graph break before the output layer
    return module


TOKENS = {
    "gpt": tied_gpt,
    "gpt_untied": untied_gpt,
    "broken": broken_gpt,
    "bag": Bag,
    "gated_bag": GatedBag,
    "sparse_bags": SparseBags,
}


def tokens(model: str, g: torch.Generator, batch: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """The bags: ids ``[B, 8]`` and classes ``[B]``; the GPTs: ids and next-token targets ``[B, 16]``."""
    if "bag" in model:
        return torch.randint(0, vocab, (batch, 8), generator=g), torch.randint(0, 8, (batch,), generator=g)
    return torch.randint(0, vocab, (batch, 16), generator=g), torch.randint(0, vocab, (batch, 16), generator=g)


# -- Hugging Face models built from configs (transformers, the test extra) --------------------------------------------
def hugging_face(name: str) -> nn.Module:
    """A tiny GPT-2 or BERT (masked LM) from its config, dropout off; both tie the output layer to the table."""
    import transformers

    torch.manual_seed(0)
    if name == "hf:gpt2":
        config = transformers.GPT2Config(
            vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


# -- one interface over the three families --------------------------------------------------------------------------
@functools.cache
def _workload(spec: str):
    name, _, size = spec[2:].partition(":")
    return build_workload(name, size=size or "tiny", seed=0)


def build_model(name: str, *, vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    """A fresh model (the same initial weights on every rank for the same arguments)."""
    if name.startswith("w:"):
        workload = _workload(name)
        return build_workload(workload.name, size=workload.size, seed=seed).model
    if name in TOKENS:
        return TOKENS[name](vocab)
    if name.startswith("hf:"):
        return hugging_face(name)
    torch.manual_seed(seed)
    return {**REGRESSION, **SCALARS}[name]()


def default_batch(name: str) -> int:
    if name.startswith("w:"):
        return _workload(name).batch_size
    return 4 if name in TOKENS or name.startswith("hf:") else 8


def make_batch(name: str, g: torch.Generator, size: int, *, vocab: int = VOCAB) -> tuple[torch.Tensor, ...]:
    if name.startswith("w:"):
        assert size == default_batch(name), "a workload draws batches of its own size"
        return _workload(name).make_batch(g)
    if name in TOKENS:
        return tokens(name, g, size, vocab)
    if name.startswith("hf:"):  # token ids [B, 16] of the tiny configs' 256-row vocabulary
        return (torch.randint(0, 256, (size, 16), generator=g),)
    if name in SCALARS:  # inputs, and small integer codes in [-3, 3] the model reads as data
        return torch.randn(size, IN, generator=g), torch.randint(-3, 4, (size,), generator=g)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def compute_loss(name: str, model: nn.Module, batch: tuple[torch.Tensor, ...], rank: int) -> torch.Tensor:
    """The scalar loss of ``batch`` on ``rank`` (``branchy`` skips its shared layer on rank 1)."""
    if name.startswith("w:") or name in TOKENS:
        return model(*batch)
    if name in SCALARS:
        return model(*batch).square().mean()
    if name.startswith("hf:"):
        return model(input_ids=batch[0], labels=batch[0]).loss
    x, y = batch
    kwargs: dict[str, Any] = {"use_shared": rank != 1} if name == "branchy" else {}
    return F.mse_loss(model(x, **kwargs), y)
