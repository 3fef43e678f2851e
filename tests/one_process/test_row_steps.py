"""Note [Steps by rows]: a parameter's rows stepped block by block, then finished with the rows no block stepped,
leave the parameter and the optimizer's state exactly as one ``optimizer.step()`` over it: every optimizer
``step_in_backward`` accepts, from the first step (no state yet) on, blocks in any order, gradients held in
``.grad`` or not."""

from __future__ import annotations

import copy

import pytest
import torch

from graphddp.runtime import row_steps
from graphddp.runtime.optimizer_overlap import SUPPORTED, StepPerBucket

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),  # no state at all
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True}),  # one vectorised CPU kernel: equal up to the last bit (EXACT)
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01}),  # mu_product: a scalar each block starts from
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Rprop, {"lr": 0.01}),
]


def _exact(options: dict) -> dict:
    """Tolerances of the comparison: none, but for a fused optimizer, whose vectorised kernel rounds the elements
    past a whole vector apart, so a row block starting elsewhere may differ in an element's last bit."""
    return {} if options.get("fused") else {"rtol": 0, "atol": 0}


def test_every_supported_optimizer_is_covered() -> None:
    assert {cls for cls, _ in OPTIMIZERS} == set(SUPPORTED)


def _state_of(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict]:
    return [dict(opt.state[p]) for p in params]


@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("held", [False, True], ids=["grad-none", "grad-held"])
@pytest.mark.parametrize("chunk", [None, 40], ids=["whole-blocks", "2-row-chunks"])
def test_rows_stepped_in_blocks_equal_one_step(cls: type, options: dict, held: bool, chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:  # the weight's 20-byte rows stepped two at a time on the CPU (CPU_CHUNK_BYTES)
        monkeypatch.setattr(row_steps, "CPU_CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(12, 5)), torch.nn.Parameter(torch.randn(5))
    ref = [copy.deepcopy(weight), copy.deepcopy(bias)]
    mine, theirs = cls([weight, bias], **options), cls(ref, **options)
    stepper = StepPerBucket(mine, [weight, bias])
    for step in range(4):
        g_weight, g_bias = torch.randn(12, 5), torch.randn(5)
        before = [torch.randn(12, 5), torch.randn(5)] if held else [None, None]
        for p, h in zip([weight, bias], before):
            p.grad = h
        # The blocks as wait_blocks_ steps them (sent last first here), then the step node with the first rows.
        for start, stop in [(8, 12), (4, 8)] if step % 2 else [(4, 8), (8, 12)]:
            stepper.step_rows(weight, start, g_weight[start:stop])
        stepper.step_with([weight, bias], [g_weight, g_bias])
        for p, h, g in zip(ref, before, [g_weight, g_bias]):
            p.grad = g if h is None else h + g
        theirs.step()
        assert weight.grad is before[0] and bias.grad is before[1]  # .grad as it was: autograd adds the average
        assert len(mine.state) == len(theirs.state)  # no stand-in's state left behind, no empty entry made
        for p, q in zip([weight, bias], ref):
            torch.testing.assert_close(p, q, **_exact(options))
        for mine_state, their_state in zip(_state_of(mine, [weight, bias]), _state_of(theirs, ref)):
            assert mine_state.keys() == their_state.keys()
            for key, value in their_state.items():
                torch.testing.assert_close(mine_state[key], value, **_exact(options))
    assert not stepper.rows.is_open(weight)


def test_a_state_dict_loaded_between_steps_is_the_one_the_rows_use() -> None:
    """``load_state_dict`` puts a new ``state`` dict in the optimizer: the blocks slice that one."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 3))
    ref = copy.deepcopy(weight)
    mine, theirs = torch.optim.Adam([weight], lr=0.1), torch.optim.Adam([ref], lr=0.1)
    stepper = StepPerBucket(mine, [weight])
    for step in range(3):
        if step == 2:  # a checkpoint reloaded
            mine.load_state_dict(copy.deepcopy(mine.state_dict()))
        grad = torch.randn(6, 3)
        stepper.step_rows(weight, 3, grad[3:])
        stepper.step_with([weight], [grad])
        ref.grad = grad
        theirs.step()
        torch.testing.assert_close(weight, ref, rtol=0, atol=0)
        torch.testing.assert_close(mine.state[weight]["step"], theirs.state[ref]["step"], rtol=0, atol=0)
    assert list(mine.state) == [weight]
    mine.state_dict()  # every state entry is a parameter of a group


def test_a_parameter_the_optimizer_does_not_hold_is_left_alone() -> None:
    frozen_out, stepped = torch.nn.Parameter(torch.ones(4, 2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([stepped], lr=1.0)
    stepper = StepPerBucket(opt, [frozen_out, stepped])
    stepper.step_rows(frozen_out, 2, torch.ones(2, 2))
    stepper.step_with([frozen_out, stepped], [torch.ones(4, 2), torch.ones(2)])
    torch.testing.assert_close(frozen_out.detach(), torch.ones(4, 2))
    assert list(opt.state) == [stepped]
    opt.state_dict()


def test_rows_a_backward_left_half_stepped_are_forgotten_at_the_next_forward(caplog: pytest.LogCaptureFixture) -> None:
    """A backward abandoned after some blocks: its stepped rows stay stepped, the next backward starts afresh."""
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    stepper = StepPerBucket(torch.optim.SGD([weight], lr=1.0), [weight])
    stepper.step_rows(weight, 2, torch.ones(2, 2))  # abandoned after this block
    stepper.rows.forget()  # the next DDP forward
    assert "stepped in part by a backward that stopped" in caplog.text and not stepper.rows.is_open(weight)
    stepper.step_rows(weight, 0, torch.ones(2, 2))
    stepper.step_with([weight], [torch.ones(4, 2)])
    torch.testing.assert_close(weight.detach(), torch.tensor([[-1.0, -1.0]] * 2 + [[-2.0, -2.0]] * 2))
    assert not stepper.rows.is_open(weight)


@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_a_big_cpu_parameter_stepped_whole_goes_in_chunks_with_one_steps_result(
    cls: type, options: dict, transposed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Reducer's per-bucket steps (``bucket_final``, ``.grad`` final): a parameter over ``CPU_CHUNK_BYTES``
    stepped a chunk of rows per ``optimizer.step()`` call (the Note's last paragraph); a transposed one, whose rows
    are not contiguous, whole (fused CPU AdamW steps a strided view of rows wrongly)."""
    monkeypatch.setattr(row_steps, "CPU_CHUNK_BYTES", 60)  # 3 of the weight's 20-byte rows per call
    torch.manual_seed(0)
    values = torch.randn(5, 12).t() if transposed else torch.randn(12, 5)  # [12, 5]
    weight, bias = torch.nn.Parameter(values), torch.nn.Parameter(torch.randn(5))
    ref = [copy.deepcopy(weight), copy.deepcopy(bias)]
    mine, theirs = cls([weight, bias], **options), cls(ref, **options)
    stepper = StepPerBucket(mine, [weight, bias])
    calls = []
    mine.register_step_post_hook(lambda opt, args, kwargs: calls.append([p.shape for g in opt.param_groups for p in g["params"]]))
    for _ in range(3):
        calls.clear()
        for p, q in zip([weight, bias], ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        assert weight.is_contiguous() is not transposed
        stepper.bucket_final(0, [0, 1], [weight, bias], _NoEvents())
        theirs.step()
        chunks = [[(12, 5), (5,)]] if transposed else [[(3, 5)]] * 4 + [[(5,)]]  # four chunks, then the bias
        assert calls == chunks, calls
        for p, q in zip([weight, bias], ref):
            torch.testing.assert_close(p, q, **_exact(options))
        for p, q in zip([weight, bias], ref):
            assert mine.state.get(p, {}).keys() == theirs.state.get(q, {}).keys()
            for key, value in theirs.state.get(q, {}).items():
                torch.testing.assert_close(mine.state[p][key], value, **_exact(options))


class _NoEvents:
    def record(self, *args: object) -> None:
        pass
