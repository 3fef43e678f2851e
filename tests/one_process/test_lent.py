"""``graphddp.runtime.launch_context``: a tensor lent to a collective is seen given back, and the backward's Python
context is out of the thread-local state only while a collective is issued (Note [A collective holds no Python
object])."""

from __future__ import annotations

import contextvars
import datetime
import logging
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from reduce_rows import reduce_rows

from graphddp.runtime.launch_context import given_back, lend, no_backward_context, settle, still_held
from graphddp.runtime.reductions import AveragingReduction


@pytest.fixture(scope="module")
def group() -> dist.ProcessGroup:
    """A gloo group of one, of this process only (not the default group): its ``Work`` holds what it was given."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))


def lent_to(group: dist.ProcessGroup, alias: torch.Tensor) -> dist.Work:
    work = group.allreduce([alias])
    work.wait()
    return work


def test_a_lent_tensor_is_held_while_its_collective_is(group: dist.ProcessGroup) -> None:
    buffer = torch.zeros(8)
    views = [buffer[:4], buffer[4:]]  # other views of the tensor do not count: only the alias is looked at
    alias = lend(buffer)
    assert alias.data_ptr() == buffer.data_ptr() and not still_held(alias)
    work = lent_to(group, alias)
    assert still_held(alias)
    del work
    assert given_back(alias, "a test tensor") and not still_held(alias) and len(views) == 2


def late_holder(box: list[object], waiting_in: str) -> tuple[threading.Thread, threading.Event]:
    """A thread that drops what ``box`` holds once the calling thread is inside ``waiting_in`` (so that the wait
    is exercised, not skipped), as a gloo worker that clears a completed collective late; the event is set just
    before it drops it."""
    main, dropped = threading.get_ident(), threading.Event()

    def late_worker() -> None:
        deadline = time.monotonic() + 10
        while sys._current_frames()[main].f_code.co_name != waiting_in and time.monotonic() < deadline:
            time.sleep(0.001)
        dropped.set()
        box.clear()

    thread = threading.Thread(target=late_worker)
    thread.start()
    return thread, dropped


def test_given_back_waits_for_the_late_holder(group: dist.ProcessGroup) -> None:
    alias = lend(torch.zeros(8))
    box: list[object] = [lent_to(group, alias)]
    thread, dropped = late_holder(box, "given_back")
    assert given_back(alias, "a test tensor")
    assert dropped.is_set()
    thread.join(10)


def test_a_buckets_all_reduce_is_let_go_once_the_late_holder_is_done(group: dist.ProcessGroup, caplog) -> None:  # type: ignore[no-untyped-def]
    """``AveragedInFlight.let_go`` waits for the collective to give back what it was given, and what it was given
    is an alias of its own: the buffer's views (a bucket has one per parameter) do not keep it waiting."""
    buffer = torch.zeros(8)
    views = [buffer[:4], buffer[4:]]
    in_flight = AveragingReduction(group).start(None, buffer, False)  # type: ignore[arg-type]  # no bucket needed
    assert in_flight.wait() is buffer
    box: list[object] = [in_flight.future]  # a holder of what the collective was given, as the late worker is
    thread, dropped = late_holder(box, "let_go")
    with caplog.at_level(logging.WARNING, logger="graphddp.runtime.launch_context"):
        in_flight.let_go()
    assert dropped.is_set(), "let_go returned before the collective gave its tensor back"
    assert caplog.text == "" and len(views) == 2
    thread.join(10)


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py: reduce_rows sends on the default group
def test_a_row_sparse_tables_collectives_are_let_go_once_the_late_holder_is_done(caplog) -> None:  # type: ignore[no-untyped-def]
    """The mask's and the rows' all-reduces are lent their tensors too: ``RowSparseInFlight.let_go`` returns only
    once a late holder of the rows' collective let it go."""
    table = torch.zeros(8, 3)
    table[[1, 6]] = 1.0
    _, in_flight = reduce_rows(table)
    assert in_flight.outcome is not None and in_flight.outcome[0] == "rows"
    box: list[object] = [in_flight.future]  # holds what the rows' collective was given
    thread, dropped = late_holder(box, "given_back")
    with caplog.at_level(logging.WARNING, logger="graphddp.runtime.launch_context"):
        in_flight.let_go()
    assert dropped.is_set(), "let_go returned before the rows' collective gave its tensor back"
    assert caplog.text == ""
    thread.join(10)


def test_settle_waits_drops_and_sees_each_tensor_given_back(group: dist.ProcessGroup, caplog) -> None:  # type: ignore[no-untyped-def]
    """``settle`` (in-graph blocks, delayed parameters): the ``Work`` list is emptied, so the collectives are dropped
    there, and it returns only once a late holder of one of them let it go."""
    aliases = [lend(torch.zeros(8)), lend(torch.ones(4))]
    works = [group.allreduce([alias]) for alias in aliases]
    box: list[object] = [works[1]]  # a late holder of the second collective itself
    thread, dropped = late_holder(box, "given_back")
    with caplog.at_level(logging.WARNING, logger="graphddp.runtime.launch_context"):
        settle(works, aliases, "a test tensor")
    assert works == [] and dropped.is_set(), "settle returned before the collective gave its tensor back"
    assert caplog.text == "" and not any(still_held(alias) for alias in aliases)
    thread.join(10)


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py: the blocks are sent on the default group
def test_a_big_gradients_blocks_are_given_back_once_waited(caplog) -> None:  # type: ignore[no-untyped-def]
    """In-graph blocks (Note [Blocks written in place]): ``wait_blocks_`` returns only once a late holder of a
    block's collective let it go; the blocks hold their reduced values."""
    from graphddp.runtime import in_graph_blocks

    gradient, rows, by, group = torch.zeros(4, 3), torch.ones(2, 5), torch.ones(5, 3), dist.group.WORLD.group_name
    torch.ops.graphddp.reduce_block_(gradient, rows, by, 0, 1.0, group, True)  # rows 0-1
    torch.ops.graphddp.reduce_block_(gradient, rows, by, 6, 1.0, group, False)  # rows 2-3
    box: list[object] = [in_graph_blocks._pending[gradient.untyped_storage().data_ptr()][0][1]]  # block 2's Work
    thread, dropped = late_holder(box, "given_back")
    with caplog.at_level(logging.WARNING, logger="graphddp.runtime.launch_context"):
        torch.ops.graphddp.wait_blocks_(gradient, [], [], -1, -1)
    assert dropped.is_set(), "wait_blocks_ returned before the block's collective gave it back"
    assert caplog.text == ""
    torch.testing.assert_close(gradient, torch.full((4, 3), 5.0))  # ones(2, 5) @ ones(5, 3), summed over one rank
    thread.join(10)


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py: the delayed all-reduce goes on the default group
def test_the_delayed_parameters_all_reduce_is_lent_an_alias_and_settled_by_the_engine_callback(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from graphddp.runtime import delayed

    settled: list[tuple[list[object], list[torch.Tensor]]] = []

    def recording_settle(works, lent, what):  # type: ignore[no-untyped-def]
        settled.append((works, list(lent)))
        delayed_settle(works, lent, what)

    delayed_settle = delayed.settle
    monkeypatch.setattr(delayed, "settle", recording_settle)
    first, hooked = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    reduction = delayed.DelayedAllReduce([first], hooked, group=dist.group.WORLD, rank=0)
    reduction.before_forward(grad_enabled=True, synchronising=True)
    ((first * 2).sum() + (hooked * 3).sum()).backward()
    ((works, (alias,)),) = settled
    assert works == [], "the Work was not dropped in settle"
    assert alias is not reduction.buffer and alias.data_ptr() == reduction.buffer.data_ptr() and not still_held(alias)
    torch.testing.assert_close(first.grad, torch.full((3,), 2.0))  # averaged over one rank: the gradient itself


def test_given_back_gives_up_with_a_warning(group: dist.ProcessGroup, caplog) -> None:  # type: ignore[no-untyped-def]
    alias = lend(torch.zeros(8))
    work = lent_to(group, alias)  # kept: never given back
    with caplog.at_level(logging.WARNING, logger="graphddp.runtime.launch_context"):
        assert not given_back(alias, "a test tensor", limit_s=0.05)
    assert "a test tensor is still held by its collective" in caplog.text
    assert still_held(alias) and work.is_completed()


def test_no_backward_context_takes_the_context_out_and_puts_it_back() -> None:
    context = contextvars.copy_context()
    torch._C._stash_obj_in_tls("context", context)
    try:
        with no_backward_context():
            assert not torch._C._is_key_in_tls("context")
        assert torch._C._get_obj_in_tls("context") is context
        try:
            with no_backward_context():
                raise KeyError("inside")
        except KeyError:
            pass
        assert torch._C._get_obj_in_tls("context") is context  # back after an exception too
    finally:
        torch._C._remove_obj_from_tls("context")
    with no_backward_context():  # outside backward: nothing to take out
        assert not torch._C._is_key_in_tls("context")
    assert not torch._C._is_key_in_tls("context")
