"""What ``sparse_embedding_grads="auto"`` measures at construction (``RowsRule.measure``, Note [Row-sparse
gradients], "When rows pay"): the link where the DDP reduces a table rows could apply to, gloo's CPU per byte where
that table is tied; nothing for tables the DDP does not reduce (``parameters_to_ignore``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import tied_gpt

import graphddp.runtime.rows_rule as rows_rule
from graphddp.passes import LinkModel
from graphddp.runtime.rows_rule import RowsRule

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

LINK = LinkModel.of_rate(1e9)


@pytest.mark.parametrize(("ignored", "expected"), [
    ((), ["link", "cpu"]),  # the tied token table: the link, and gloo's CPU for its part
    (("wte.weight",), ["link"]),  # the position table is still tried as rows: the link only
    (("wte.weight", "wpe.weight"), []),  # no table reduced: nothing measured
])  # fmt: skip
def test_only_the_tables_the_ddp_reduces_are_measured_for(monkeypatch: pytest.MonkeyPatch, ignored: tuple[str, ...], expected: list[str]) -> None:
    measured: list[str] = []

    def link_of(group: object, device: object = None) -> LinkModel:
        measured.append("link")
        return LINK

    def cpu_cost_of_communication(group: object, link: object = None) -> float:
        measured.append("cpu")
        return 1e-9

    monkeypatch.setattr(rows_rule, "link_of", link_of)
    monkeypatch.setattr(rows_rule, "cpu_cost_of_communication", cpu_cost_of_communication)
    rule = RowsRule.measure(
        "auto", tied_gpt(), dist.group.WORLD, torch.device("cpu"), applies=True, auto_caps=None, ignored=frozenset(ignored)
    )
    assert measured == expected
    assert (rule.link, rule.cpu_seconds_per_byte) == ((LINK, 1e-9) if "cpu" in expected else (LINK, 0.0) if expected else (None, 0.0))


def test_the_ddp_hands_its_ignored_parameters_to_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphddp

    given: dict[str, object] = {}
    measure = RowsRule.measure.__func__  # type: ignore[attr-defined]

    def recording(cls: type, *args: object, **kwargs: object) -> RowsRule:
        given.update(kwargs)
        return measure(cls, *args, **kwargs)

    monkeypatch.setattr(RowsRule, "measure", classmethod(recording))
    model = tied_gpt()
    model._ddp_params_and_buffers_to_ignore = ["wpe.weight"]
    graphddp.DDP(model)
    assert given["ignored"] == frozenset({"wpe.weight"})


@pytest.mark.parametrize(("ignored", "cpu_group", "automatic_caps", "charged"), [
    ((), True, False, True),  # a tied table's part on a CPU group: charged
    ((), False, False, False),  # not on a GPU group
    (("wte.weight",), True, False, False),  # the tied table not reduced: nothing tied left
    (("wte.weight",), True, True, True),  # automatic caps measure it for every choice
])  # fmt: skip
def test_one_function_says_whether_gloo_cpu_is_charged(ignored: tuple[str, ...], cpu_group: bool, automatic_caps: bool, charged: bool) -> None:
    # RowsRule.measure and graphddp inspect both ask charges_gloo_cpu (one rule, one place).
    got = rows_rule.charges_gloo_cpu(tied_gpt(), frozenset(ignored), cpu_group=cpu_group, automatic_caps=automatic_caps)
    assert got is charged
