"""``channels=k`` (Note [Channels]): buckets reduced on k process groups in turn, eager and compiled in-graph, with
PyTorch's DDP's gradients; the groups take the DDP's timeout, ranks that ask for different counts raise, and
nothing is left behind once the DDP is freed."""

from __future__ import annotations

import collections
import contextlib
import copy
import datetime
import gc
import os
import pathlib
import re
import shutil
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import IN, MLP, OUT
from ranks import run_on_ranks
from training import CAPS

import graphddp
from graphddp.passes import StepInputs, choose_channels
from graphddp.runtime.calibration import link_of
from graphddp.runtime.channels import group_timeout
from graphddp.runtime.comm import ModelMismatchError


@contextlib.contextmanager
def allreduces_by_group():
    """Every ``ProcessGroup.allreduce`` issued meanwhile (graphddp's buckets call it directly, ``dist.all_reduce``
    through it), counted by group name; the groups seen, by name."""
    calls: collections.Counter[str] = collections.Counter()
    groups: dict[str, dist.ProcessGroup] = {}
    saved = vars(dist.ProcessGroup)["allreduce"]  # pybind's method object: restored as it was, or it breaks
    original = dist.ProcessGroup.allreduce

    def counting(group, *args, **kwargs):
        calls[group.group_name] += 1
        groups[group.group_name] = group
        return original(group, *args, **kwargs)

    dist.ProcessGroup.allreduce = counting
    try:
        yield calls, groups
    finally:
        dist.ProcessGroup.allreduce = saved


SMALL = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005, "last_bucket_cap_mb": 0.0005}
"""Caps small enough that the MLP's six gradients take several buckets per channel."""


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, IN, generator=g), torch.randn(6, OUT, generator=g)


def train_on_channels(rank: int, world: int, channels: int, compiled: bool) -> dict[str, int]:
    """Five SGD steps of graphddp.DDP(channels=...) beside PyTorch's DDP, parameters compared after each, and with
    one process trained on every rank's batch at the end; returns the all-reduces of the last backward per channel
    (by position: 0 is the DDP's own group)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    single = copy.deepcopy(model)  # the reference without DDP: each step on the concatenation of the ranks' batches
    stack = contextlib.ExitStack()
    calls, groups = stack.enter_context(allreduces_by_group())  # before the DDP: its buckets bind the method
    ddp = graphddp.DDP(model, channels=channels, **SMALL)
    dump = tempfile.mkdtemp(prefix=f"channels-{rank}-")
    run = torch.compile(ddp, backend=graphddp.backend("aot_eager", reduction="in_graph", debug_dir=dump)) if compiled else ddp
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, ref, single)]
    for step in range(5):
        x, y = batch(step, rank)
        calls.clear()
        F.mse_loss(run(x), y).backward()
        stack.close() if step == 4 else None
        F.mse_loss(ref(x), y).backward()
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        F.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()  # [world * 6, IN]: the mean of the ranks' means
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    torch.testing.assert_close(dict(ddp.module.named_parameters()), dict(single.named_parameters()))
    main = dist.group.WORLD.group_name
    assert main in groups, "the DDP's own group carries channel 0"
    others = sorted((name for name in groups if name != main), key=lambda n: int(n) if n.isdigit() else n)
    assert all(group_timeout(groups[n]) == group_timeout(dist.group.WORLD) for n in others)
    if compiled:  # the all-reduces are ops of the compiled backward: count them there, by the group each names
        calls.clear()
        for backward in pathlib.Path(dump).rglob("in_graph.backward.py"):
            code = backward.read_text()
            calls.update(re.findall(r"_c10d_functional\.all_reduce\.default\([^)]*'([^']+)'\)", code))
            # a big gradient's later blocks, sent from the gradient itself (Note [Blocks written in place])
            calls.update(re.findall(r"graphddp\.reduce_block_\.default\([^)]*'([^']+)', (?:True|False)\)", code))
        groups.update({name: dist.distributed_c10d._resolve_process_group(name) for name in calls})
    shutil.rmtree(dump)
    buckets = len(ddp.bucket_plan.buckets)
    by_channel: collections.Counter[int] = collections.Counter()
    for b in ddp.bucket_plan.buckets:  # in-graph, a big weight's blocks each go on its bucket's channel
        by_channel[b.index % channels] += b.in_graph_collectives if compiled else 1
    return {"buckets": buckets, "main": calls[main], **{f"channel {k}": calls[n] for k, n in enumerate(others, 1)},
            "expected": dict(by_channel)}  # fmt: skip


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "in_graph"])
def test_buckets_go_round_robin_on_the_channels_with_pytorchs_gradients(compiled: bool) -> None:
    for record in run_on_ranks(train_on_channels, 2, 3, compiled):
        expected = record["expected"]
        assert record["buckets"] >= 3, record  # a bucket on every channel at least
        # Channels 1 and 2 carry their buckets' all-reduces and nothing else; the DDP's group carries bucket 0, 3, ...
        assert record["channel 1"] == expected[1] and record["channel 2"] == expected[2], record
        assert record["main"] >= expected[0], record


def auto_channels(rank: int, world: int) -> tuple[int, int]:
    """channels="auto": (the channels the DDP made, what the step cost model picks for its buckets on the link it
    measured), after three steps equal to PyTorch's DDP's."""
    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = graphddp.DDP(model, channels="auto", **SMALL)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref)]
    for step in range(3):
        x, y = batch(step, rank)
        for m, opt in zip((ddp, ref), opts):
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    sizes = tuple(b.nbytes for b in ddp.bucket_plan.buckets)
    all_ready = StepInputs(segment_backward_s=(0.0,), bucket_bytes=sizes, completed_by=(0,) * len(sizes))
    picked, _ = choose_channels(all_ready, link_of(dist.group.WORLD), world)  # cached: the link the DDP measured
    return len(ddp.reducer.compile_target.channel_names), picked


@pytest.mark.slow
def test_auto_channels_are_what_the_model_picks_for_the_measured_link() -> None:
    results = run_on_ranks(auto_channels, 2)
    assert results[0] == results[1] and results[0][0] == results[0][1] and results[0][0] in (1, 2, 4), results


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "in_graph"])
def test_three_ranks_on_two_channels_match_pytorch(compiled: bool) -> None:
    for record in run_on_ranks(train_on_channels, 3, 2, compiled):
        assert record["channel 1"] == record["expected"][1], record


def resources() -> tuple[int, int, int, int]:
    """(process groups torch.distributed knows, threads, open descriptors, Python threads) of this process."""
    return (
        len(dist.distributed_c10d._world.pg_map),
        len(os.listdir("/proc/self/task")),
        len(os.listdir("/proc/self/fd")),
        threading.active_count(),
    )


def built_and_freed(rank: int, world: int, compiled: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """Resources before a DDP on 4 channels, while it trains (compiled: reducing in-graph, where the functional
    collectives name the channels' groups), and once it is freed; and the steps that ran in-graph."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    warm = graphddp.DDP(MLP(), **CAPS)  # what the first DDP of a process loads for good (Dynamo, hooks, Inductor)
    warm_run = torch.compile(warm, backend=graphddp.backend("aot_eager")) if compiled else warm
    for step in range(3):
        F.mse_loss(warm_run(batch(step, rank)[0]), batch(step, rank)[1]).backward()
    del warm, warm_run
    torch._dynamo.reset()
    gc.collect()
    before = resources()
    ddp = graphddp.DDP(MLP(), channels=4, **CAPS)
    run = torch.compile(ddp, backend=graphddp.backend("aot_eager", reduction="in_graph")) if compiled else ddp
    for step in range(3):
        x, y = batch(step, rank)
        F.mse_loss(run(x), y).backward()
    during = resources()
    in_graph = ddp.reducer.compile_target.gate.in_graph_forwards
    del ddp, run
    torch._dynamo.reset()  # compiled code keeps its module alive until Dynamo lets go of it, as for any module
    gc.collect()
    return before, during, resources(), in_graph


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "in_graph"])
def test_nothing_is_left_behind_once_the_ddp_is_freed(compiled: bool) -> None:
    for before, during, after, in_graph in run_on_ranks(built_and_freed, 2, compiled):
        assert during[0] == before[0] + 3, (before, during)  # three groups of its own
        assert during[1] > before[1] and during[2] > before[2], (before, during)  # gloo's threads and sockets
        assert after == before, (before, during, after)
        assert (in_graph > 0) == compiled, in_graph


def different_counts(rank: int, world: int) -> str:
    with pytest.raises(ModelMismatchError) as caught:  # before any group is made: nothing hangs
        graphddp.DDP(MLP(), channels=2 if rank == 0 else 1)
    return str(caught.value)


def test_ranks_that_ask_for_different_channels_raise_on_every_rank() -> None:
    for message in run_on_ranks(different_counts, 2):
        assert "channels=2" in message and "channels=1" in message, message


def on_a_group_with_its_own_timeout(rank: int, world: int) -> bool:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=77))
    x, y = batch(0, rank)
    with allreduces_by_group() as (_, groups):  # before the DDP: its buckets bind the method
        ddp = graphddp.DDP(MLP(), process_group=group, channels=2, **CAPS)
        F.mse_loss(ddp(x), y).backward()
    channel = [g for name, g in groups.items() if name != group.group_name]
    assert len(channel) == 1 and group_timeout(channel[0]) == datetime.timedelta(seconds=77), groups
    del ddp
    gc.collect()
    dist.destroy_process_group(group)
    return True


def test_the_channels_take_the_ddps_timeout() -> None:
    assert run_on_ranks(on_a_group_with_its_own_timeout, 2) == [True, True]


def on_part_of_the_ranks(rank: int, world: int) -> str:
    group = dist.new_group([0, 1])
    message = "not a member"
    if rank in (0, 1):
        with pytest.raises(ValueError) as caught:
            graphddp.DDP(MLP(), process_group=group, channels=2)
        message = str(caught.value)
    dist.barrier()
    dist.destroy_process_group(group)
    return message


@pytest.mark.slow
def test_a_group_of_part_of_the_ranks_is_refused_with_what_to_do() -> None:
    messages = run_on_ranks(on_part_of_the_ranks, 3)
    assert messages[2] == "not a member"
    for message in messages[:2]:
        assert "2 of the 3 ranks" in message and "channels=1" in message, message
