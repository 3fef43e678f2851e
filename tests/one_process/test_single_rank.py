"""graphddp.DDP in one process (gloo, world size 1): the API surface and bad input, no spawned ranks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import IN, MLP, Branchy
from torch import nn
from training import Case, batch_for, loss_for

import graphddp
from graphddp.runtime.trace import EventLog

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def step(ddp: nn.Module, case: Case | None = None, seed: int = 0) -> torch.Tensor:
    case = case or Case()
    x, y = batch_for(case, seed, 0, 0)
    loss = loss_for(ddp, case, (x, y), rank=0)
    loss.backward()
    return loss


def test_gradients_equal_local_training_at_world_size_one() -> None:
    torch.manual_seed(0)
    local, wrapped = MLP(), MLP()
    wrapped.load_state_dict(local.state_dict())
    ddp = graphddp.DDP(wrapped, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    assert len(ddp.bucket_plan.buckets) > 1
    step(local)
    step(ddp)
    for (name, a), b in zip(local.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_state_dict_has_the_module_prefix_and_torch_can_strip_it() -> None:
    ddp = graphddp.DDP(MLP())
    state = ddp.state_dict()
    assert set(state) == {f"module.{k}" for k in ddp.module.state_dict()}
    nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")
    plain = MLP()
    plain.load_state_dict(state)
    for a, b in zip(plain.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(a, b)
    assert graphddp.DistributedDataParallel is graphddp.DDP


def test_construction_logs_one_info_line_and_the_table_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="graphddp"):
        graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "[rank 0]" in infos[0].getMessage() and "buckets" in infos[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="graphddp"):
        graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    tables = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "bucket plan" in r.getMessage()]
    assert tables and "fc3.bias" in tables[0] and "bytes" in tables[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": "not a module"}, TypeError, "wraps an nn.Module"),
        ({"bucket_cap_mb": -0.5}, ValueError, "bucket_cap_mb must be a finite number of MiB >= 0 .*, got -0.5"),
        ({"first_bucket_cap_mb": -1}, ValueError, "first_bucket_cap_mb must be a finite number of MiB >= 0"),
        ({"last_bucket_cap_mb": float("nan")}, ValueError, "last_bucket_cap_mb must be a finite number of MiB >= 0"),
        ({"bucket_ramps": "no"}, TypeError, "bucket_ramps must be True or False"),
        ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be True or False"),
        ({"device_ids": [0]}, ValueError, "device_ids and output_device must be None for a module on the CPU"),
        ({"output_device": 1}, ValueError, "device_ids and output_device must be None for a module on the CPU"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, error: type, match: str) -> None:
    kwargs = {"module": MLP(), **kwargs}
    with pytest.raises(error, match=match):
        graphddp.DDP(**kwargs)


def test_a_module_without_trainable_parameters_is_refused() -> None:
    frozen = MLP().requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter that requires a gradient"):
        graphddp.DDP(frozen)
    with pytest.raises(ValueError, match="already wrapped"):
        graphddp.DDP(graphddp.DDP(MLP()))


def test_frozen_parameters_are_left_out_of_the_buckets() -> None:
    model = MLP()
    model.fc1.requires_grad_(False)
    ddp = graphddp.DDP(model)
    assert set(ddp.bucket_plan.param_names) == {"fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"}
    step(ddp)
    assert model.fc1.weight.grad is None and model.fc2.weight.grad is not None


def test_register_comm_hook_validates_its_arguments() -> None:
    ddp = graphddp.DDP(MLP())
    with pytest.raises(TypeError, match="Communication hook must be callable"):
        ddp.register_comm_hook(None, 42)
    with pytest.raises(TypeError, match="exactly two arguments"):
        ddp.register_comm_hook(None, lambda bucket: bucket)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    assert ddp._get_ddp_logging_data()["has_error"] == 1  # PyTorch's logger keeps the last error too
    ddp.register_comm_hook(None, allreduce_hook)
    assert ddp._get_ddp_logging_data()["comm_hook"] == "allreduce_hook"
    with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook can only be called once"):
        ddp.register_comm_hook(None, allreduce_hook)
    logged = ddp._get_ddp_logging_data()
    assert logged["has_error"] == 1 and logged["error"] == "register_comm_hook or register_builtin_comm_hook can only be called once."
    step(ddp)  # torch's hook runs on our buckets


def badly_annotated_bucket(state: object, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]: ...


def badly_annotated_return(state: object, bucket: dist.GradBucket) -> torch.Tensor: ...


def well_annotated(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def test_comm_hook_annotations_are_checked_as_pytorch_checks_them() -> None:
    ddp = graphddp.DDP(MLP())
    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
        ddp.register_comm_hook(None, badly_annotated_bucket)
    with pytest.raises(ValueError, match=r"return annotation should be torch.futures.Future\[torch.Tensor\]"):
        ddp.register_comm_hook(None, badly_annotated_return)
    ddp.register_comm_hook(None, well_annotated)  # string annotations (future import) are evaluated first
    step(ddp)


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks_by_name(kind: str) -> None:
    ddp = graphddp.DDP(MLP())
    ddp.register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind))
    with pytest.raises(RuntimeError, match="can only be called once"):
        ddp.register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    step(ddp)
    assert all(p.grad is not None for p in ddp.parameters())


def test_a_hook_that_returns_no_future_is_a_clear_error() -> None:
    ddp = graphddp.DDP(MLP())
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(RuntimeError, match="communication hook's callback must return a torch.futures.Future object"):
        step(ddp)


def test_a_hook_result_of_the_wrong_shape_is_a_clear_error() -> None:
    def halves(state, bucket):  # type: ignore[no-untyped-def]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer()[: bucket.buffer().numel() // 2])
        return fut

    ddp = graphddp.DDP(MLP())
    ddp.register_comm_hook(None, halves)
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(\d+,\) for bucket 0, expected"):
        step(ddp)


def test_forward_twice_before_backward_and_eval_forwards_are_fine() -> None:
    ddp = graphddp.DDP(MLP())
    x, _ = batch_for(Case(), 0, 0, 0)
    ddp(x)
    with torch.no_grad():
        ddp(x)
    step(ddp)
    assert all(p.grad is not None for p in ddp.parameters())


def test_no_sync_skips_the_reducer() -> None:
    ddp = graphddp.DDP(MLP())
    ddp.reducer.events = log = EventLog()
    with ddp.no_sync():
        step(ddp)
    assert log.of_kind("launch") == []
    step(ddp)
    assert len(log.of_kind("launch")) == len(ddp.bucket_plan.buckets)


def test_require_forward_param_sync_follows_the_forwards_as_pytorchs() -> None:
    """PyTorch's flag that the next forward broadcasts buffers (accelerate's ``trigger_sync_in_backward`` reads
    and sets it): True after construction and after a synchronising forward, False after one under ``no_sync``."""
    seen = {}
    for name, ddp in (("graphddp", graphddp.DDP(MLP())), ("torch", nn.parallel.DistributedDataParallel(MLP()))):
        flags = [ddp.require_forward_param_sync]
        with ddp.no_sync():
            step(ddp)
        flags.append(ddp.require_forward_param_sync)
        step(ddp)
        flags.append(ddp.require_forward_param_sync)
        seen[name] = flags
    assert seen["graphddp"] == seen["torch"] == [True, False, True]


def test_device_attributes_and_an_empty_device_ids_list_as_pytorchs() -> None:
    ours, theirs = graphddp.DDP(MLP(), device_ids=[]), nn.parallel.DistributedDataParallel(MLP(), device_ids=[])
    for name in ("device_type", "output_device", "is_multi_device_module", "device_ids"):
        assert getattr(ours, name) == getattr(theirs, name), name
    with pytest.raises(ValueError, match="device_ids and output_device arguments only work with"):
        nn.parallel.DistributedDataParallel(MLP(), output_device=1)  # PyTorch refuses what graphddp refuses above


def test_broadcast_buffers_can_be_assigned_as_on_pytorchs() -> None:
    ddp = graphddp.DDP(MLP())
    ddp.broadcast_buffers = False
    assert ddp.broadcast_buffers is False and ddp.options.broadcast_buffers is False and not ddp.will_sync_module_buffers()


def test_missing_gradient_without_the_flag_raises_at_the_next_forward() -> None:
    ddp = graphddp.DDP(Branchy())  # `dead` never takes part
    step(ddp, Case(model="branchy"))  # backward itself completes (no hang)
    with pytest.raises(RuntimeError, match=r"no gradient for 'dead.weight'.*find_unused_parameters=True"):
        step(ddp, Case(model="branchy"))
    step(ddp, Case(model="branchy"))  # the error is reported once; the user may go on


def test_find_unused_keeps_grads_of_unused_parameters_untouched() -> None:
    ddp = graphddp.DDP(Branchy(), find_unused_parameters=True)
    step(ddp, Case(model="branchy"))
    assert ddp.module.dead.weight.grad is None
    assert ddp.module.shared.weight.grad is not None


def test_autograd_grad_before_backward_does_not_end_the_iteration() -> None:
    """A gradient penalty: autograd.grad on the output first, then the real backward, which must be reduced."""
    ddp = graphddp.DDP(MLP())
    for step_index in range(2):
        x, y = batch_for(Case(), step_index, 0, 0)
        x.requires_grad_(True)
        out = ddp(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (F.mse_loss(out, y) + gx.pow(2).mean()).backward()
    assert all(p.grad is not None for p in ddp.parameters())


def test_dataclass_outputs_are_searched_for_unused_parameters() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = MLP()

        def forward(self, x: torch.Tensor) -> Output:
            return Output(self.inner(x))

    ddp = graphddp.DDP(Wrapped(), find_unused_parameters=True)
    x, y = batch_for(Case(), 0, 0, 0)
    F.mse_loss(ddp(x).logits, y).backward()
    assert all(p.grad is not None for p in ddp.parameters())


def test_compiled_forward_twice_without_backward() -> None:
    torch._dynamo.reset()
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    model = graphddp.compile(ddp, "aot_eager")
    x, y = batch_for(Case(), 0, 0, 0)
    model(x)
    model(x)  # the plan is adopted here, while nothing is in flight
    F.mse_loss(model(x), y).backward()
    assert ddp.bucket_plan.source == "graph" and all(p.grad is not None for p in ddp.parameters())
    torch._dynamo.reset()


def test_pytorch_style_option_attributes_and_broadcast_buffers_none() -> None:
    ddp = graphddp.DDP(MLP(), broadcast_buffers=None, find_unused_parameters=True)
    assert ddp.broadcast_buffers is True and ddp.find_unused_parameters is True
    assert ddp.static_graph is False and ddp.gradient_as_bucket_view is False


def test_compiled_autograd_with_a_parameter_without_gradient_says_what_to_do() -> None:
    from training import compiled_backward

    ddp = graphddp.DDP(Branchy())  # `dead` never gets a gradient
    x, y = batch_for(Case(), 0, 0, 0)
    with compiled_backward():
        F.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="ran under compiled autograd and ended before every bucket was complete"):
        ddp(x)
    torch._dynamo.reset()



# -- PyTorch's constructor -------------------------------------------------------------------------------------------
def test_the_constructor_takes_pytorchs_arguments_in_pytorchs_order_then_graphddps_keyword_only() -> None:
    import inspect

    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    ours = inspect.signature(graphddp.DDP.__init__).parameters
    assert list(ours)[: len(theirs)] == theirs
    assert all(p.kind is p.KEYWORD_ONLY for name, p in ours.items() if name not in theirs)


def test_delayed_all_reduce_arguments_go_together_and_name_module_parameters() -> None:
    model = MLP()
    fc3 = list(model.fc3.named_parameters(prefix="fc3"))
    with pytest.raises(ValueError, match="need to be set at the same time"):  # PyTorch's words
        graphddp.DDP(model, delay_all_reduce_named_params=fc3)
    with pytest.raises(ValueError, match="names 'fc9.weight', which is not that parameter"):
        graphddp.DDP(model, delay_all_reduce_named_params=[("fc9.weight", model.fc3.weight)], param_to_hook_all_reduce=model.fc1.weight)
    with pytest.raises(ValueError, match="param_to_hook_all_reduce must be a parameter of the module"):
        graphddp.DDP(model, delay_all_reduce_named_params=fc3, param_to_hook_all_reduce=torch.nn.Parameter(torch.ones(1)))
    ddp = graphddp.DDP(model, delay_all_reduce_named_params=fc3, param_to_hook_all_reduce=model.fc1.weight)
    assert {"fc3.weight", "fc3.bias"} <= ddp.parameters_to_ignore  # as PyTorch: out of the buckets


def test_bucket_cap_mb_list_caps_each_bucket_in_ready_order_the_last_repeating() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)])  # 12 x 4224 bytes
    kib = 1 / 1024
    ddp = graphddp.DDP(model, bucket_cap_mb_list=[5 * kib, 9 * kib, 13 * kib], first_bucket_cap_mb=0.5)
    caps = [b.cap_bytes for b in ddp.bucket_plan.buckets]
    assert caps == [5120, 9216, 13312, 13312], caps  # the list wins over bucket_cap_mb and first/last caps
    assert ddp.bucket_plan.caps.sequence == (5120, 9216, 13312)
    # Cut as PyTorch's DDP cuts by its list: a bucket closes once it holds its cap or more.
    names = [n for n, _ in model.named_parameters()][::-1]  # the initial plan's order: reverse registration
    params = dict(model.named_parameters())
    pytorchs, _ = dist._compute_bucket_assignment_by_size([params[n] for n in names], list(caps[:3]), [False] * len(names))
    assert [list(b.names) for b in ddp.bucket_plan.buckets] == [[names[i] for i in b] for b in sorted(pytorchs, key=min)]


def test_a_zero_cap_is_a_bucket_per_gradient_as_pytorchs() -> None:
    model = MLP()
    ddp = graphddp.DDP(model, bucket_cap_mb=0, first_bucket_cap_mb=0, last_bucket_cap_mb=0, bucket_ramps=False)
    assert [len(b.names) for b in ddp.bucket_plan.buckets] == [1] * len(list(model.parameters()))
    listed = graphddp.DDP(MLP(), bucket_cap_mb_list=[0])
    assert len(listed.bucket_plan.buckets) == len(list(model.parameters()))
    ddp(torch.randn(4, IN)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "value, error, message",
    [
        ([1, -1], ValueError, "finite numbers of MiB >= 0, got -1"),
        ([1, "2"], TypeError, "entries must be numbers of MiB, got str"),
        (4, ValueError, "must be a non-empty list of MiB, got 4"),
    ],
)
def test_a_bad_bucket_cap_mb_list_is_refused_naming_it(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        graphddp.DDP(MLP(), bucket_cap_mb_list=value)


def test_a_mixed_precision_config_must_name_floating_dtypes() -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    with pytest.raises(TypeError, match="must be a torch.nn.parallel.distributed._MixedPrecision"):
        graphddp.DDP(MLP(), mixed_precision=object())
    with pytest.raises(TypeError, match="mixed_precision.param_dtype must be a floating dtype"):
        graphddp.DDP(MLP(), mixed_precision=_MixedPrecision(param_dtype=torch.int8))


def test_buffer_sync_follows_pytorchs_rules_and_warnings() -> None:
    with pytest.warns(FutureWarning, match="`broadcast_buffers` is deprecated"):
        ddp = graphddp.DDP(MLP(), broadcast_buffers=False)
    assert ddp.forward_sync_buffers is False and ddp.will_sync_module_buffers() is False
    ddp = graphddp.DDP(MLP(), forward_sync_buffers=False)
    assert ddp.forward_sync_buffers is False
    ddp.forward_sync_buffers = True
    assert ddp.broadcast_buffers is True
    with pytest.warns(FutureWarning, match="check_reduction"):
        graphddp.DDP(MLP(), check_reduction=True)


def test_positional_arguments_land_where_pytorch_puts_them() -> None:
    # module, device_ids, output_device, dim, broadcast_buffers, init_sync, process_group, bucket_cap_mb
    with pytest.warns(FutureWarning):
        ddp = graphddp.DDP(MLP(), None, None, 0, True, False, None, 0.5)
    assert ddp.bucket_bytes_cap == 512 * 1024 and ddp.dim == 0


def test_a_one_dimensional_device_mesh_gives_the_group() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    ddp = graphddp.DDP(MLP(), device_mesh=mesh)
    assert ddp.process_group is mesh.get_group(0) and ddp.device_mesh is mesh
    with pytest.raises(RuntimeError, match="Cannot specify both process_group and device_mesh"):
        graphddp.DDP(MLP(), process_group=dist.group.WORLD, device_mesh=mesh)


def test_sync_batchnorm_on_a_cpu_module_is_rejected_as_pytorch_does() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SyncBatchNorm(4))
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        graphddp.DDP(model)


def test_distributed_checkpoint_state_dicts_carry_no_module_prefix_and_move_between_wrappers() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    ours, theirs, bare = graphddp.DDP(MLP()), torch.nn.parallel.DistributedDataParallel(MLP()), MLP()
    state = get_model_state_dict(ours)
    assert sorted(state) == sorted(bare.state_dict()) == sorted(get_model_state_dict(theirs))
    for target in (theirs, bare):  # graphddp -> torch's DDP, graphddp -> the bare model
        set_model_state_dict(target, dict(state))  # it renames keys in the dict it is given
        torch.testing.assert_close(get_model_state_dict(target), state)
    with torch.no_grad():
        bare.fc1.weight.add_(1.0)
    set_model_state_dict(ours, get_model_state_dict(bare))  # and back into graphddp
    torch.testing.assert_close(ours.module.fc1.weight, bare.fc1.weight)


def test_set_static_graph_and_logging_data_as_frameworks_call_them() -> None:
    ddp = graphddp.DDP(Branchy(), find_unused_parameters=True)
    ddp._set_static_graph()
    assert ddp.static_graph and ddp._get_ddp_logging_data()["static_graph"] == 1
    with pytest.warns(UserWarning, match="no need to set it again"):
        ddp._set_static_graph()
    for seed in range(2):
        step(ddp, Case(model="branchy"), seed)
    data = ddp._get_ddp_logging_data()
    assert data["iteration"] == 1 and data["can_set_static_graph"] == 1  # published at the 2nd forward, as PyTorch and data["world_size"] == 1
    assert data["backend_name"] == "gloo" and data["module_name"] == "Branchy"
    late = graphddp.DDP(MLP())
    step(late)
    assert late._get_ddp_logging_data()["has_error"] == 0
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):  # PyTorch's words
        late._set_static_graph()
    logged = late._get_ddp_logging_data()
    assert logged["has_error"] == 1 and "should be called before training loop starts" in logged["error"]


def test_a_meta_device_module_is_refused_before_anything_is_planned() -> None:
    with pytest.raises(RuntimeError, match="on the meta device .* Materialise them first .*then wrap the module"):
        graphddp.DDP(torch.nn.Linear(4, 4, device="meta"))


def test_logging_data_samples_runtime_statistics_as_pytorch_does() -> None:
    ddp = graphddp.DDP(MLP())
    ddp._set_ddp_runtime_logging_sample_rate(4)
    seen = []
    for _ in range(14):
        ddp(torch.randn(4, 12)).sum().backward()
        seen.append(ddp._get_ddp_logging_data().get("iteration"))
    # Published at the forward of iterations 1..10 and every 4th after (12), each the previous iteration's figures.
    assert seen == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 12, 12], seen
    data = ddp._get_ddp_logging_data()
    assert data["backward_compute_time"] >= data["backward_compute_comm_overlap_time"] and data["avg_forward_compute_time"] >= 1
    assert data["backward_comm_time_end"] >= data["backward_comm_time_start"] >= data["backward_compute_time_start"]
    assert data["dtypes"] == "float" and data["num_parameter_tensors"] == len(list(ddp.parameters()))
    with pytest.raises(ValueError, match="sample rate should be >= 1"):
        ddp._set_ddp_runtime_logging_sample_rate(0)


def test_an_output_that_is_a_parameter_gets_no_hook_from_the_backward_watch() -> None:
    """Note [Abandoned backward]: each forward watches its backward through a hook on an output autograd computed,
    never on a leaf. A parameter returned as the first output would otherwise keep one more hook every forward."""

    class ReturnsItsScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.fc = nn.Parameter(torch.ones(1)), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.scale, self.fc(x) * self.scale

    model = ReturnsItsScale()
    ddp = graphddp.DDP(model)
    for _ in range(3):
        scale, y = ddp(torch.randn(2, 4))
        (y.sum() + scale.sum()).backward()
    assert not model.scale._backward_hooks, model.scale._backward_hooks


def test_a_builtin_hook_without_state_is_traced_only_on_the_default_group() -> None:
    """PyTorch's built-in hooks reduce over WORLD when their state is None: in-graph, on a DDP of another group,
    the traced all-reduce would use the DDP's group instead, so such a hook keeps the split (the Reducer runs it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

    from graphddp.runtime.reductions import CommHook, in_graph_wire

    other = dist.new_group([0])
    assert in_graph_wire(CommHook(None, allreduce_hook, custom=True), dist.group.WORLD) is None
    assert in_graph_wire(CommHook(None, fp16_compress_hook, custom=True), dist.group.WORLD) is torch.float16
    assert in_graph_wire(CommHook(None, allreduce_hook, custom=True), other) is False
    assert in_graph_wire(CommHook(other, allreduce_hook, custom=True), other) is None
    # What the automatic caps predict a bucket is sent in (Note [Automatic caps]): the hook's wire where known.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    assert CommHook(None, bf16_compress_hook, custom=True).wire_dtype is torch.bfloat16
    assert CommHook(other, fp16_compress_hook, custom=True).wire_dtype is torch.float16  # another group: still fp16
    assert CommHook(None, allreduce_hook, custom=True).wire_dtype is None
    assert CommHook(None, lambda state, bucket: None, custom=True).wire_dtype is None  # the user's: not known
    assert CommHook.averaging(dist.group.WORLD).wire_dtype is None


@pytest.mark.parametrize("options", [{}, {"static_graph": True}, {"find_unused_parameters": True}])
def test_lightnings_manual_optimization_calls_on_the_reducer_change_nothing(options: dict) -> None:
    """Lightning's ``prepare_for_backward`` (lightning/pytorch/overrides/distributed.py) after the DDP's forward,
    and its ``post_backward``'s ``_delay_all_reduce`` for a static graph: the gradients stay the local ones (one
    rank), every bucket launched once."""
    torch.manual_seed(0)
    ddp, local = graphddp.DDP(MLP(), **options), MLP()
    local.load_state_dict(ddp.module.state_dict())
    for seed in range(3):
        ddp.reducer.events = log = EventLog()
        x, y = batch_for(Case(), seed, 0, 0)
        loss = F.mse_loss(ddp(x), y)
        args = [loss] if ddp.find_unused_parameters and not ddp.static_graph else []
        assert ddp.reducer._rebuild_buckets() is False
        ddp.reducer.prepare_for_backward(args)
        loss.backward()
        ddp.reducer._delay_all_reduce()
        F.mse_loss(local(x), y).backward()
        for p, q in zip(ddp.parameters(), local.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        assert len(log.of_kind("launch")) == len(ddp.bucket_plan.buckets)
        ddp.zero_grad(), local.zero_grad()


def test_accelerates_trigger_sync_in_backward_synchronises_a_no_sync_forward() -> None:
    """accelerate's ``trigger_sync_in_backward``: a forward under ``no_sync``, then ``prepare_for_backward([])``
    with the sync flags set, so its backward goes through the Reducer."""
    ddp = graphddp.DDP(MLP())
    ddp.reducer.events = log = EventLog()
    with ddp.no_sync():
        loss = F.mse_loss(ddp(batch_for(Case(), 0, 0, 0)[0]), batch_for(Case(), 0, 0, 0)[1])
    ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])
    loss.backward()
    assert len(log.of_kind("launch")) == len(ddp.bucket_plan.buckets)


def test_a_lazy_module_is_refused_in_pytorchs_words() -> None:
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters can't be used with `DistributedDataParallel`"):
        graphddp.DDP(nn.Sequential(nn.LazyLinear(4), nn.ReLU()))


def test_caps_as_a_config_gives_them_numpy_numbers_and_an_empty_list_are_pytorchs() -> None:
    np = pytest.importorskip("numpy")
    by_numpy = graphddp.DDP(MLP(), bucket_cap_mb=np.float32(0.5), first_bucket_cap_mb=np.int64(1))
    assert by_numpy.bucket_plan.caps == graphddp.DDP(MLP(), bucket_cap_mb=0.5, first_bucket_cap_mb=1).bucket_plan.caps
    assert graphddp.DDP(MLP(), bucket_cap_mb_list=[]).bucket_plan.caps == graphddp.DDP(MLP()).bucket_plan.caps  # no list


def test_an_ignored_parameter_elsewhere_does_not_count_for_the_modules_device() -> None:
    # PyTorch's DDP takes the device from the parameters it synchronises; an ignored one may live elsewhere.
    model = MLP()
    model.register_parameter("elsewhere", nn.Parameter(torch.zeros(3, device="meta")))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["elsewhere"])
    ddp = graphddp.DDP(model)
    assert ddp.device == torch.device("cpu") and "elsewhere" not in {p.name for b in ddp.bucket_plan.buckets for p in b.params}
