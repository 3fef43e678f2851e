"""The per-forward placement check (``graphddp.runtime.placement``): it finds what it found before, and when nothing
changed it makes no call per parameter (Note [Placement checked without a loop])."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from graphddp.runtime.placement import GUARD_STATES, MISSES_BEFORE_GIVING_UP, Placement


def stack(layers: int) -> nn.Module:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    model[0].bias.requires_grad_(False)  # one frozen parameter, not wrapped
    return model


def wrap(model: nn.Module) -> Placement:
    wrapped = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Placement(model, wrapped, frozenset())


def calls_of(fn: Callable[[], Any]) -> int:
    """Python and C calls made from Python bytecode while ``fn`` runs (C calls made by C, as ``map`` makes them,
    are not seen: that is the point)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.fixture
def no_tensor_guards(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A torch whose Dynamo has no ``TensorGuards`` of the signature graphddp builds."""
    real_import = builtins.__import__

    def refuse(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch._C._dynamo.guards":
            raise ImportError("no TensorGuards here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    yield


def test_an_unchanged_forward_makes_as_many_calls_with_ten_or_a_thousand_parameters() -> None:
    small, large = wrap(stack(5)), wrap(stack(500))
    assert calls_of(lambda: small.check(0)) == calls_of(lambda: large.check(0))


def test_without_tensor_guards_the_check_is_the_loop_and_still_finds_a_change(no_tensor_guards: None) -> None:
    model = stack(50)
    checked = wrap(model)
    checked.check(0)  # nothing changed
    assert calls_of(lambda: checked.check(0)) > 100  # a call per parameter: the loop
    model[3].weight.data = model[3].weight.data.double()
    with pytest.raises(RuntimeError, match=r"'3.weight' is now torch.float64 on cpu, but was torch.float32"):
        checked.check(0)


def replaced(model: nn.Module) -> str:
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    return "'2.weight' was replaced by another tensor"


def recast(model: nn.Module) -> str:
    model[1].bias.data = model[1].bias.data.double()
    return "'1.bias' is now torch.float64"


def reshaped(model: nn.Module) -> str:
    model[4].weight.data = model[4].weight.data.reshape(2, 8)
    return r"'4.weight' changed shape from \[4, 4\] to \[2, 8\]"


def unfrozen(model: nn.Module) -> str:
    model[0].bias.requires_grad_(True)
    return "'0.bias' was frozen when wrapped and now requires a gradient"


def added(model: nn.Module) -> str:
    model[3].scale = nn.Parameter(torch.ones(4))
    return "'3.scale' was added after wrapping"


def swapped(model: nn.Module) -> str:
    torch.utils.swap_tensors(model[5].bias, nn.Parameter(torch.zeros(4, dtype=torch.float64)))  # the same object
    return "'5.bias' is now torch.float64"


@pytest.mark.parametrize("change", [replaced, recast, reshaped, unfrozen, added, swapped])
@pytest.mark.parametrize("guards", [True, False], ids=["guarded", "loop-only"])
def test_each_change_raises_naming_the_parameter(change: Callable[[nn.Module], str], guards: bool, request: pytest.FixtureRequest) -> None:
    if not guards:
        request.getfixturevalue("no_tensor_guards")
    model = stack(6)
    checked = wrap(model)
    assert checked.guarded is guards
    for _ in range(3):
        checked.check(0)
    message = change(model)
    with pytest.raises(RuntimeError, match=rf"\[rank 1\] graphddp.DDP: the module's parameters changed after it was wrapped: {message}"):
        checked.check(1)


def test_a_state_the_loop_accepts_is_remembered_and_checked_without_the_loop_again() -> None:
    """Autocast changes what the guard compares, not what the loop does: the first forward under it takes the loop,
    the next ones do not, and going back and forth stays on the fast path."""
    model = stack(50)
    checked = wrap(model)
    unchanged = calls_of(lambda: checked.check(0))
    without_the_loop = unchanged + GUARD_STATES  # at most one more guard asked per state kept
    with torch.autocast("cpu"):
        assert calls_of(lambda: checked.check(0)) > unchanged + 100  # new to the guards: the loop ran
        assert calls_of(lambda: checked.check(0)) <= without_the_loop
    assert calls_of(lambda: checked.check(0)) <= without_the_loop  # the first state's guard, kept
    model[1].weight.requires_grad_(False)  # a wrapped parameter frozen: not an error, a new state
    checked.check(0)
    assert calls_of(lambda: checked.check(0)) <= without_the_loop


@pytest.mark.parametrize(("states_after", "kept"), [(GUARD_STATES - 1, True), (GUARD_STATES, False)])
def test_the_least_recently_seen_state_is_dropped_beyond_guard_states(states_after: int, kept: bool) -> None:
    """The wrapped state, then ``states_after`` others (one more parameter frozen each time), then back to the
    wrapped state: checked without the loop while at most ``GUARD_STATES`` states were seen."""
    model = stack(60)
    checked = wrap(model)
    unchanged = calls_of(lambda: checked.check(0))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params[:states_after]:
        p.requires_grad_(False)
        checked.check(0)
    for p in params[:states_after]:
        p.requires_grad_(True)
    back = calls_of(lambda: checked.check(0))
    if kept:
        assert back <= unchanged + 2 * GUARD_STATES, (back, unchanged)  # the guards asked, no loop
    else:
        assert back > unchanged + 100, (back, unchanged)  # the loop: a call or more per parameter


def test_states_that_never_repeat_leave_the_check_to_the_loop() -> None:
    """A cycle of more states than are kept would build a guard every forward: after ``MISSES_BEFORE_GIVING_UP``
    the loop alone checks, and still finds a change."""
    model = stack(GUARD_STATES + 3)
    checked = wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    cycle = params[: GUARD_STATES + 1]  # freezing one of these at a time: GUARD_STATES + 1 states, in turn
    for k in range(MISSES_BEFORE_GIVING_UP + 2):
        frozen = cycle[k % len(cycle)]
        frozen.requires_grad_(False)
        checked.check(0)
        frozen.requires_grad_(True)
    assert not checked.guarded
    params[-1].data = params[-1].data.double()
    with pytest.raises(RuntimeError, match="is now torch.float64"):
        checked.check(0)


def test_a_few_states_in_turn_keep_the_guards() -> None:
    model = stack(GUARD_STATES + 3)
    checked = wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for k in range(4 * MISSES_BEFORE_GIVING_UP):
        frozen = params[k % (GUARD_STATES - 1)]  # with the wrapped state, GUARD_STATES states
        frozen.requires_grad_(False)
        checked.check(0)
        frozen.requires_grad_(True)
        checked.check(0)
    assert checked.guarded


def test_re_registering_a_parameter_keeps_one_guard_per_state() -> None:
    """``m.w = m.w`` at every forward (a re-tie) takes the loop each time, but keeps no second guard of the same
    state: the autocast state, seen once, is still kept after many of them."""
    model = stack(40)
    checked = wrap(model)
    with torch.autocast("cpu"):
        checked.check(0)
    for _ in range(2 * GUARD_STATES):
        model[1].weight = model[1].weight
        checked.check(0)
    unchanged = calls_of(lambda: checked.check(0))
    with torch.autocast("cpu"):
        assert calls_of(lambda: checked.check(0)) <= unchanged + GUARD_STATES


def test_a_sparse_or_nested_parameter_is_checked_by_the_loop() -> None:
    """``TensorGuards`` reads strides in C++; a CSR tensor's throw there ends the process, past any ``except``."""
    model = stack(3)
    model.table = nn.Parameter(torch.eye(4).to_sparse_csr(), requires_grad=False)  # frozen: guarded as well
    checked = wrap(model)
    assert not checked.guarded
    checked.check(0)
    model[2].weight.data = model[2].weight.data.double()
    with pytest.raises(RuntimeError, match="'2.weight' is now torch.float64"):
        checked.check(0)
