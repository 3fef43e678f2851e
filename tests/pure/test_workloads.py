"""Built-in workloads: shapes, losses, gradients, deterministic init, validation. No processes, a few seconds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphddp.tools.workloads import (
    CNN,
    GPT,
    MLP,
    SIZES,
    WORKLOADS,
    GPTConfig,
    Workload,
    build_workload,
    count_parameters,
)


def _batch(workload: Workload, seed: int = 0) -> tuple:
    return workload.make_batch(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", WORKLOADS)
def test_tiny_loss_and_gradients(name):
    w = build_workload(name, size="tiny")
    assert isinstance(w, Workload) and w.name == name and w.size == "tiny" and w.description
    loss = w.model(*_batch(w))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in w.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: {pname} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name}: {pname} has a non-finite gradient"


@pytest.mark.parametrize("name", WORKLOADS)
def test_logits_without_targets(name):
    w = build_workload(name, size="tiny")
    inputs, targets = _batch(w)
    logits = w.model(inputs)
    if name == "gpt":
        assert logits.shape == (*inputs.shape, w.model.config.vocab_size)
    else:
        assert logits.shape[0] == w.batch_size and logits.dim() == 2
        assert int(targets.max()) < logits.shape[1]


def test_gpt_batch_targets_are_next_tokens():
    w = build_workload("gpt", size="tiny", batch_size=3)
    idx, targets = _batch(w)
    assert idx.shape == targets.shape == (3, w.model.config.block_size)
    assert idx.dtype == targets.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])


def test_make_batch_is_driven_by_the_generator():
    w = build_workload("mlp", size="tiny")
    a, b, c = _batch(w, 1), _batch(w, 1), _batch(w, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_gpt_lm_head_is_tied():
    model = build_workload("gpt", size="tiny").model
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.bias is None
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert count_parameters(model) < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


def test_gpt_compiles_as_one_graph():
    torch._dynamo.reset()
    w = build_workload("gpt", size="tiny")
    batch = _batch(w)
    compiled = torch.compile(w.model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*batch), w.model(*batch))
    torch._dynamo.reset()


@pytest.mark.parametrize("name", WORKLOADS)
def test_init_is_deterministic_in_the_seed(name):
    a = build_workload(name, size="tiny", seed=3).model.state_dict()
    b = build_workload(name, size="tiny", seed=3).model.state_dict()
    c = build_workload(name, size="tiny", seed=4).model.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_global_rng_state_is_unchanged():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_workload("gpt", size="tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_size_override():
    assert build_workload("cnn", size="tiny", batch_size=5).batch_size == 5
    w = build_workload("cnn", size="tiny", batch_size=5)
    x, y = _batch(w)
    assert x.shape == (5, 3, 32, 32) and y.shape == (5,)


def test_bad_arguments():
    with pytest.raises(ValueError, match="gpt, mlp, cnn"):
        build_workload("resnet")
    with pytest.raises(ValueError, match="tiny, small, bench"):
        build_workload("gpt", size="huge")
    with pytest.raises(ValueError):
        build_workload("mlp", size="tiny", batch_size=0)
    with pytest.raises(TypeError):
        build_workload("mlp", size="tiny", batch_size=2.0)
    with pytest.raises(TypeError):
        build_workload("mlp", size="tiny", seed="0")


def test_config_validation():
    ok = dict(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    GPTConfig(**ok)
    with pytest.raises(TypeError):
        GPTConfig(16, 8, 1, 2, 8)  # keyword-only
    with pytest.raises(ValueError):
        GPTConfig(**{**ok, "n_embd": 9})  # not a multiple of n_head
    with pytest.raises(ValueError):
        GPTConfig(**{**ok, "n_layer": 0})
    with pytest.raises(TypeError):
        GPTConfig(**{**ok, "vocab_size": 16.0})
    with pytest.raises(ValueError):
        GPTConfig(**{**ok, "dropout": 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPTConfig(**ok).n_layer = 2
    with pytest.raises(ValueError):
        GPT(GPTConfig(**ok))(torch.zeros(1, 9, dtype=torch.long))  # longer than block_size
    with pytest.raises(ValueError):
        MLP(sizes=(4,))
    with pytest.raises(TypeError):
        MLP(sizes=(4, 2.5))
    with pytest.raises(ValueError):
        CNN(blocks_per_stage=())
    with pytest.raises(ValueError):
        CNN(width=0)


def test_gpt_without_bias():
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, bias=False))
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters())
    model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()


def test_bench_gpt_parameter_count():
    # Built on the meta device: shapes only, no memory, no init cost.
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512))
    assert 20_000_000 <= count_parameters(model) <= 50_000_000
    assert count_parameters(build_workload("gpt", size="bench").model) == count_parameters(model)


def test_sizes_order_by_parameter_count():
    assert SIZES == ("tiny", "small", "bench")
    for name in ("gpt", "mlp"):
        counts = [count_parameters(build_workload(name, size=s).model) for s in SIZES]
        assert counts == sorted(counts), (name, counts)
    assert count_parameters(build_workload("cnn", size="tiny").model) <= 100_000
