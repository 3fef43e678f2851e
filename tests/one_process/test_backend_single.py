"""graphddp.backend in one process: what it refuses, what it warns about, and how it splits."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from training import Case, batch_for

import graphddp

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def loss(model, step: int = 0) -> torch.Tensor:
    x, y = batch_for(Case(), step, 0, 0)
    return F.mse_loss(model(x), y)


def test_a_plain_module_is_split_with_a_warning_that_nothing_is_reduced() -> None:
    backend = graphddp.backend("aot_eager")
    model = torch.compile(MLP(), backend=backend)
    with pytest.warns(UserWarning, match="no Reducer is attached"):
        loss(model).backward()
    (split,) = backend.splits
    assert split.num_segments == len(split.plan.buckets) == 1  # default 25 MiB / 1 MiB caps: one bucket


def test_pytorch_ddp_is_refused_with_a_pointer_to_graphddp() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(MLP())
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    with pytest.raises(Exception, match="wrap it in graphddp.DDP|Wrap the model in graphddp.DDP"):
        loss(model)


def test_graphddp_compile_refuses_anything_but_graphddp_ddp() -> None:
    with pytest.raises(TypeError, match="expects a graphddp.DDP module"):
        graphddp.compile(MLP())
    with pytest.raises(TypeError, match="backend name or a compiler function"):
        graphddp.backend(42)  # type: ignore[arg-type]


def test_compiled_gradients_equal_eager_and_the_plan_is_adopted_at_world_size_one() -> None:
    torch.manual_seed(0)
    eager, compiled_module = MLP(), MLP()
    compiled_module.load_state_dict(eager.state_dict())
    ddp = graphddp.DDP(compiled_module, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    backend = graphddp.backend("aot_eager")
    model = graphddp.compile(ddp, backend, fullgraph=True)
    loss(model).backward()
    loss(eager).backward()
    for a, b in zip(eager.parameters(), compiled_module.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert ddp.bucket_plan.source == "registration"  # adopted at the next forward, never mid-iteration
    loss(model, 1).backward()
    assert ddp.bucket_plan.source == "graph"
    assert ddp.bucket_plan.fingerprint == backend.splits[0].plan.fingerprint


def test_a_custom_compiler_function_compiles_every_segment() -> None:
    seen = []

    def inner(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(len(example_inputs))
        return gm.forward

    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    loss(torch.compile(ddp, backend=graphddp.backend(inner))).backward()
    assert len(seen) == graphddp_segments(ddp) == 3


def graphddp_segments(ddp: graphddp.DDP) -> int:
    return len(ddp.reducer.plans.graph_plans.graphs[next(iter(ddp.reducer.plans.graph_plans.graphs))].buckets)


def test_a_no_grad_region_is_never_cut_so_every_gradient_survives_compilation() -> None:
    from models import build_model

    eager, compiled_module = build_model("no_grad_middle"), build_model("no_grad_middle")
    ddp = graphddp.DDP(compiled_module, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6, find_unused_parameters=True)
    backend = graphddp.backend("aot_eager")
    loss(torch.compile(ddp, backend=backend)).backward()
    loss(eager).backward()
    assert backend.splits[0].num_segments > 1
    for (name, a), b in zip(eager.named_parameters(), compiled_module.parameters()):
        assert b.grad is not None, f"{name} lost its gradient"
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    assert torch.is_grad_enabled()


# -- the split without asking for it (Note [Split without asking] in graphddp/compiler/dynamo_hook.py) ----------------------
def counting_compiler(seen: list[int]):
    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(len(example_inputs))
        return gm.forward

    return compiler


@pytest.mark.parametrize("how", ["backend_name", "callable", "module_compile", "named_graphddp"])
def test_plain_torch_compile_splits_at_the_buckets_whatever_backend_the_user_names(how: str) -> None:
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    seen: list[int] = []
    if how == "backend_name":
        model = torch.compile(ddp, backend="aot_eager")
    elif how == "callable":
        model = torch.compile(ddp, backend=counting_compiler(seen))
    elif how == "module_compile":
        ddp.compile(backend="aot_eager")
        model = ddp
    else:
        model = torch.compile(ddp, backend="graphddp", options={"inner": "aot_eager"})
    for step in range(2):
        loss(model, step).backward()
    (split,) = ddp.reducer.splits
    assert split.num_segments == len(split.plan.buckets) == 3
    assert ddp.bucket_plan.source == "graph" and ddp.bucket_plan.fingerprint == split.plan.fingerprint
    if how == "callable":
        assert len(seen) == 3  # the user's function compiled each segment, not the whole graph


def test_optimize_ddp_off_compiles_the_graph_whole_as_for_pytorch_ddp() -> None:
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    seen: list[int] = []
    with torch._dynamo.config.patch(optimize_ddp=False):
        loss(torch.compile(ddp, backend=counting_compiler(seen))).backward()
    assert seen and not ddp.reducer.splits


def test_graphddp_compile_passes_mode_and_options_to_the_inner_compiler() -> None:
    calls: list[dict] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object) -> object:
        calls.append(kwargs)
        return gm.forward

    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    model = graphddp.compile(ddp, inner, mode="max-autotune-no-cudagraphs", options={"x": 1}, dynamic=False, fullgraph=True)
    loss(model).backward()
    assert calls == [{"mode": "max-autotune-no-cudagraphs", "options": {"x": 1}}] * 3
    calls.clear()
    torch._dynamo.reset()
    loss(torch.compile(ddp, backend=graphddp.backend(inner), mode="max-autotune-no-cudagraphs"), 1).backward()
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}] * 3


def test_flex_attention_forward_compiles_and_matches_eager() -> None:
    # Flex attention has no backward on CPU (AOTAutograd cannot trace one), so, as in PyTorch's compiled-DDP test
    # of it, the forward only: under no_grad nothing is planned and the graph is compiled whole.
    from models import build_model

    eager = build_model("flex_attention")
    ddp = graphddp.DDP(build_model("flex_attention"), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    model = torch.compile(ddp, backend="aot_eager")
    x, _ = batch_for(Case(), 0, 0, 0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x))
    assert ddp.reducer.splits == []


# -- where users look: the profiler and torch's structured trace ------------------------------------------------------
def test_buckets_and_segments_appear_as_labelled_profiler_ranges() -> None:
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    model = graphddp.compile(ddp, "aot_eager", reduction="split")
    loss(model).backward()  # compile outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss(model, 1).backward()
    names = {e.name for e in prof.events()}
    segments = ddp.reducer.splits[0].num_segments
    assert {f"graphddp: all-reduce bucket {k}" for k in range(len(ddp.bucket_plan.buckets))} <= names
    assert {f"graphddp: wait for bucket {k}" for k in range(len(ddp.bucket_plan.buckets))} <= names
    assert {f"graphddp: segment {s} backward" for s in range(segments)} <= names
    assert {f"graphddp: segment {s} forward" for s in range(segments)} <= names


def test_launches_are_labelled_under_a_profiler_of_all_threads_started_on_another_thread() -> None:
    """``torch.distributed.debug``'s on-demand profiler records every thread from a thread of its own: this
    thread's profiler state is off, the process-wide flag on, and ``record_function`` ranges are recorded here."""
    from torch._C._profiler import _ExperimentalConfig

    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    loss(ddp).backward()
    started, stop, profiles = threading.Event(), threading.Event(), []

    def profile_all_threads() -> None:
        config = _ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
            started.set()
            stop.wait(30)
        profiles.append(prof)

    thread = threading.Thread(target=profile_all_threads)
    thread.start()
    try:
        assert started.wait(30)
        loss(ddp, 1).backward()
    finally:
        stop.set()
        thread.join(30)
    names = {e.name for e in profiles[0].events()}
    assert {f"graphddp: all-reduce bucket {k}" for k in range(len(ddp.bucket_plan.buckets))} <= names


def _sending_alone(ddp: graphddp.DDP) -> graphddp.DDP:
    """One rank sends only where a comm hook asks (graphddp's own averaging: the average of one gradient is itself,
    ``local_average``); PyTorch's allreduce_hook is traced in-graph like graphddp's averaging."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def test_one_rank_reduces_nothing_in_graph_under_graphddps_averaging() -> None:
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    model = torch.compile(ddp, backend="aot_eager")
    loss(model).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss(model, 1).backward()
    assert ddp.reducer.compile_target.gate.open  # in-graph, as at any world size
    assert not any("all_reduce" in e.name for e in prof.events())  # as the Reducer's LocalReduction: nothing sent


def test_in_graph_reduction_shows_one_functional_all_reduce_per_bucket_in_the_profile() -> None:
    ddp = _sending_alone(graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001))
    model = torch.compile(ddp, backend="aot_eager")  # "auto": in-graph, from the second step on
    loss(model).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss(model, 1).backward()
    names = [e.name for e in prof.events()]
    assert ddp.reducer.compile_target.gate.open
    collectives = sum(b.in_graph_collectives for b in ddp.bucket_plan.buckets)  # fc2.weight in 2 blocks
    buckets = len(ddp.bucket_plan.buckets)
    # aot_eager runs the backward op by op: each all-reduce in the tensor it was gathered in (reduce_in_place);
    # fc2.weight's second block is written into the gradient and sent from there (Note [Blocks written in place]).
    assert names.count("_c10d_functional::all_reduce_") == buckets > 1
    assert names.count("graphddp::reduce_block_") == collectives - buckets == 1
    assert "_c10d_functional::all_reduce" not in names
    assert not any(n.startswith("graphddp: all-reduce bucket") for n in names)  # the Reducer sent nothing


class _Records(__import__("logging").Handler):
    def __init__(self) -> None:
        super().__init__(0)
        self.names: list[str] = []

    def emit(self, record) -> None:  # type: ignore[no-untyped-def]
        metadata = getattr(record, "metadata", {}) or {}
        self.names.append(str(metadata.get("artifact", {}).get("name", "")))


def test_the_split_and_the_plan_go_to_torchs_structured_trace() -> None:
    import logging

    trace_log = logging.getLogger("torch.__trace")
    records, level = _Records(), trace_log.level
    trace_log.addHandler(records)
    trace_log.setLevel(logging.DEBUG)
    try:
        ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
        model = torch.compile(ddp, backend="aot_eager")
        loss(model).backward()
        loss(model, 1).backward()  # the graph's plan is adopted here
    finally:
        trace_log.removeHandler(records)
        trace_log.setLevel(level)
    assert any(name.startswith("graphddp_split_graph") for name in records.names), records.names
    assert records.names.count("graphddp_bucket_plan") >= 2  # construction, then the graph's plan


def test_the_dump_shows_the_in_graph_variant_with_its_all_reduces_and_sunk_waits(tmp_path) -> None:
    ddp = _sending_alone(graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001))
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager", debug_dir=str(tmp_path)))
    loss(model).backward()
    (folder,) = (tmp_path / "rank0").glob("graph*_in_graph")  # graphs are numbered across the process
    backward = (folder / "aot" / "in_graph.backward.py").read_text()
    buckets = ddp.reducer.compile_target.splits[0].plan.buckets
    collectives = sum(b.in_graph_collectives for b in buckets)
    # One functional all-reduce per bucket; a big gradient's later blocks are sent from where their matmul wrote
    # them, and waited for together (Note [Blocks written in place]).
    assert backward.count("_c10d_functional.all_reduce.default") == len(buckets) > 1
    assert backward.count("graphddp.reduce_block_.default") == collectives - len(buckets) > 0
    assert backward.count("_c10d_functional.wait_tensor.default") == len(buckets)
    assert backward.rindex("aten.mm.default") < backward.index("wait_tensor"), "every wait after the last matmul"
    # The last layer's bucket goes out before its input gradient is computed (launch_collectives_early).
    assert backward.index("all_reduce.default") < backward.index("aten.mm.default(tangents_1"), backward
    assert (tmp_path / "rank0" / folder.name.removesuffix("_in_graph") / "plan.json").exists()  # the split's, as before


def test_a_graph_with_a_tied_tables_parts_runs_split_where_it_could_not_be_compiled_again() -> None:
    # A variant sending a tied table's parts must be compiled again without them once the table gives up rows,
    # from the graph's inputs as Dynamo traced them: a graph compiled after the give-up (a rank recompiling alone)
    # is planned without the parts. Where those inputs are unknown (here: no ``example_value``, as in a graph not
    # traced by Dynamo), the graph runs split, or its ranks would send different buckets.
    from graphddp.compiler.backend import _fake_inputs

    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    backend = graphddp.backend("aot_eager")
    target, plan = ddp.reducer.compile_target, ddp.bucket_plan
    assert _fake_inputs(torch.fx.symbolic_trace(MLP()), torch.zeros(1)) is None
    assert backend.choose_reduction(plan, True, target).strategy == "in_graph"
    choice = backend.choose_reduction(plan, True, target, compiles_again=False)
    assert choice.strategy == "split" and "could not be compiled again" in choice.reason


def test_each_segments_backward_compiles_with_no_other_graphs_donated_buffers() -> None:
    """Note [Several AOT graphs in one frame]: three segments share Dynamo's TracingContext; each backward,
    compiled lazily, must not read the last compiled segment's donated-buffer list (Inductor would overwrite
    tensors another segment's backward still needs)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_donated_idxs

    seen: list[tuple[int, list[int] | None]] = []  # (backward inputs, the donated list it would be told)

    def backward_compiler(gm: torch.fx.GraphModule, inputs: list) -> object:
        seen.append((sum(n.op == "placeholder" for n in gm.graph.nodes), get_donated_idxs()))
        return make_boxed_func(gm.forward)

    class ThreeLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(32, 32) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 32] -> []
            h = torch.relu(self.b(torch.relu(self.a(x))))
            return (self.c(torch.tanh(h) ** 2) * torch.sigmoid(h)).sum()

    inner = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
    ddp = graphddp.DDP(ThreeLayers(), bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)
    compiled = torch.compile(ddp, backend=graphddp.backend(inner, reduction="split"))
    compiled(torch.randn(4, 32)).backward()
    assert len(seen) == 3, seen  # one backward per segment
    assert all(not donated for _, donated in seen), seen


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 8] -> []
        return self.b(torch.relu(self.a(x))).sum()


def test_the_compiled_module_called_outside_the_wrapper_runs_no_in_graph_reduction() -> None:
    """``DDP(torch.compile(model))``: ``ddp.module(x)`` runs the same compiled code as ``ddp(x)``; outside the
    wrapper's forward it must not run the in-graph variant (its backward would all-reduce: on one rank only, a
    hang), as PyTorch's DDP reduces nothing there."""

    ddp = graphddp.DDP(torch.compile(TwoLayers(), backend=graphddp.backend("aot_eager")))
    x = torch.randn(4, 8)
    for _ in range(3):
        ddp(x).backward()
    gate = ddp.reducer.compile_target.gate
    runs = gate.in_graph_forwards
    assert runs > 0  # the wrapper's forwards reduce in-graph by now
    ddp.module(x).backward()  # a local backward: its gradients accumulate, reduced nowhere
    assert gate.in_graph_forwards == runs
    ddp(x).backward()
    assert gate.in_graph_forwards == runs + 1  # and the wrapper's next forward in-graph again


def test_a_second_ddp_of_the_same_class_never_runs_the_first_ones_in_graph_variant() -> None:
    """Dynamo reuses a graph across instances of one class (its cache is by code): the second DDP's forward runs
    the graph compiled for the first, whose in-graph variant reduces on the first DDP's group and gate. It must
    run split, through the second DDP's own hooks."""

    backend = graphddp.backend("aot_eager")
    first, second = graphddp.DDP(TwoLayers()), graphddp.DDP(TwoLayers())
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.compile(first, backend=backend)(x).backward()
    runs = first.reducer.compile_target.gate.in_graph_forwards
    assert runs > 0
    eager = TwoLayers()
    eager.load_state_dict(second.module.state_dict())
    torch.compile(second, backend=backend)(x).backward()
    eager(x).backward()
    assert first.reducer.compile_target.gate.in_graph_forwards == runs
    for ours, reference in zip(second.module.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, reference.grad)


def test_a_wrapped_compiled_module_runs_in_the_ddps_recompile_region_unless_isolated_by_its_user() -> None:
    """Note [Split without asking], "One recompile region per DDP": the compile wrapper of a module wrapped by the
    DDP (``DDP(torch.compile(model))``, or a compiled submodule) sets its region as it runs, inside the DDP's; one
    in Dynamo's default region is lent the DDP's for its forward and given back after, one the user isolated keeps
    its own."""

    seen: dict[str, int] = {}

    def region_seen(name: str, module: torch.nn.Module) -> None:  # the region the wrapper sets while it runs
        module.register_forward_pre_hook(lambda m, args: seen.__setitem__(name, torch._C._dynamo.eval_frame.get_eval_frame_isolate_recompiles_id()))

    whole, shared, isolated = TwoLayers(), TwoLayers(), TwoLayers()
    region_seen("whole", whole)
    region_seen("submodule", shared.a)
    region_seen("isolated", isolated)
    shared.a = torch.compile(shared.a, backend="aot_eager")  # a compiled submodule, default region
    isolated = torch.compile(isolated, backend="aot_eager", isolate_recompiles=True)
    own = isolated.dynamo_ctx._isolate_recompiles_id
    ddps = [graphddp.DDP(torch.compile(whole, backend="aot_eager")), graphddp.DDP(shared), graphddp.DDP(isolated)]
    x = torch.randn(4, 8)
    for ddp in ddps:
        ddp(x).backward()
    assert seen["whole"] != seen["submodule"] and -1 not in (seen["whole"], seen["submodule"]), seen  # one per DDP
    assert seen["isolated"] == own
    assert ddps[0].module.dynamo_ctx._isolate_recompiles_id == shared.a.dynamo_ctx._isolate_recompiles_id == -1  # given back


def test_a_compiled_module_wrapped_by_a_second_ddp_runs_that_ddps_graphs() -> None:
    """The same compiled module wrapped again, without ``torch._dynamo.reset()``: the second DDP's forward compiles
    graphs of its own (its gate counts its in-graph forwards), and the first DDP's still run the first one's."""

    compiled = torch.compile(TwoLayers(), backend=graphddp.backend("aot_eager"))
    first = graphddp.DDP(compiled)
    x = torch.randn(4, 8)
    for _ in range(3):
        first(x).backward()
    runs = first.reducer.compile_target.gate.in_graph_forwards
    assert runs > 0
    second = graphddp.DDP(compiled)
    for _ in range(3):
        second(x).backward()
    assert second.reducer.compile_target.gate.in_graph_forwards > 0
    assert first.reducer.compile_target.gate.in_graph_forwards == runs
    first(x).backward()
    assert first.reducer.compile_target.gate.in_graph_forwards == runs + 1
