"""``bench.as_ready``: the floor that sends each bucket as its gradients become ready (one process, gloo of one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bench.as_ready import AsReady, BareDDP, bucket_layout, ready_order
from bench.overhead import OverheadOptions, build_model


def test_the_two_layouts_cut_the_bench_gpt_as_the_two_ddps_do() -> None:
    # bench.overhead's GPT at a 1 MiB cap, ramps off as the bench runs graphddp: both close a bucket once it holds
    # the cap or more (a block and some), so both send the same 10 buckets (13 before session 32, when graphddp's
    # planner never let a bucket exceed its cap).
    model = build_model(OverheadOptions())
    order = [p for p in reversed(list(model.parameters())) if p.requires_grad]
    ours, pytorchs = bucket_layout(model, order, "graphddp", 1.0), bucket_layout(model, order, "torch", 1.0)
    assert len(pytorchs) == 10
    assert [[id(p) for p in b] for b in ours] == [[id(p) for p in b] for b in pytorchs]
    assert [p for bucket in ours for p in bucket] == order  # every parameter once, in ready order
    assert max(sum(p.numel() * 4 for p in b) for b in ours) > 1024 * 1024  # over the cap by its last gradient
    with pytest.raises(ValueError, match="graphddp, torch"):
        bucket_layout(model, order, "megatron", 1.0)


def test_each_bucket_is_sent_once_its_last_gradient_is_in_and_in_bucket_order(monkeypatch, one_rank_group) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)  # [B, 4]
    order = ready_order(model, lambda: model(x).sum().backward())
    layers = [model[4], model[2], model[0]]  # the last layer's gradients first
    assert [{id(p) for p in order[2 * k : 2 * k + 2]} for k in range(3)] == [{id(p) for p in m.parameters()} for m in layers]
    model.zero_grad(set_to_none=True)
    buckets = [order[:2], order[2:4], order[4:]]  # one layer's weight and bias each
    events: list[tuple[str, int]] = []
    names = {id(p): k for k, b in enumerate(buckets) for p in b}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(("gradient", names[id(p)])))
    as_ready = AsReady(buckets)  # its hooks come after the recorder's: a bucket's last gradient is recorded first
    sent = dist.all_reduce

    def sending(buf: torch.Tensor, **kwargs):
        events.append(("send", next(k for k, b in enumerate(as_ready.buffers) if b is buf)))
        return sent(buf, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", sending)
    def backward(count):
        model(x).sum().backward()
        events.append(("returned", -1))

    assert as_ready.step(backward) is None
    assert events[-1] == ("returned", -1) and as_ready.waited  # waited for inside backward, before it returned
    assert [e for e in events if e[0] == "send"] == [("send", 0), ("send", 1), ("send", 2)]
    for k in range(3):  # sent right after its second gradient, before the next bucket's first
        last = max(i for i, e in enumerate(events) if e == ("gradient", k))
        assert events[last + 1] == ("send", k), events
    assert [b.numel() for b in as_ready.buffers] == [2 * 4 + 2, 4 * 4 + 4, 4 * 4 + 4]
    events.clear()
    as_ready.step(lambda count: model(x).sum().backward())  # every step sends afresh
    assert [e for e in events if e[0] == "send"] == [("send", 0), ("send", 1), ("send", 2)]


def test_bare_ddp_copies_each_bucket_in_before_it_is_sent_and_back_after_its_wait(monkeypatch, one_rank_group) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)  # [B, 4]
    order = ready_order(model, lambda: model(x).sum().backward())
    expected = [p.grad.clone() for p in order]  # the step's own gradients
    model.zero_grad(set_to_none=False)  # zeros, accumulated into in place: each .grad keeps its tensor
    grads = [p.grad for p in order]
    bare = BareDDP([order[:2], order[2:]])
    sent = dist.all_reduce
    seen: list[torch.Tensor] = []

    def sending(buf: torch.Tensor, **kwargs):
        seen.append(buf.clone())  # what the bucket held when sent: its gradients, copied in and scaled by 1 / 1
        buf.fill_(1.0)  # what comes back differs from what went out: the result must be copied back
        return sent(buf, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", sending)
    bare.step(lambda count: model(x).sum().backward())
    torch.testing.assert_close(seen[0], torch.cat([g.reshape(-1) for g in expected[:2]]))
    torch.testing.assert_close(seen[1], torch.cat([g.reshape(-1) for g in expected[2:]]))
    assert all(p.grad is g for p, g in zip(order, grads))  # copied back into .grad, not re-pointed at the buffer
    assert all(bool((p.grad == 1.0).all()) for p in order)  # the all-reduce's result
