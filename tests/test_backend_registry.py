"""fluxtp.backends.register: a module registered under a name is a backend like the built-in
ones (the public ops and fluxtp.nn's layers take its name, "auto" never picks it), and a bad
registration fails at once with a message naming what is wrong."""

import types

import pytest
import torch

import fluxtp
from fluxtp import backends
from fluxtp.nn import ColumnParallelLinear, RowParallelLinear, set_backend
from fluxtp.testing import run_on_ranks


def _toy_module(name: str) -> types.ModuleType:
    """A backend that gathers through the reference and counts its calls in `calls`."""
    from fluxtp.backends import reference

    module = types.ModuleType(name)
    module.calls = []
    module.unsupported_reason = lambda op, x, weight, info, **details: None

    def all_gather_matmul(x_shard, weight, bias, info, return_gathered):
        module.calls.append("all_gather_matmul")
        return reference.all_gather_matmul(x_shard, weight, bias, info, return_gathered)

    def matmul_reduce_scatter(x, weight, bias, info):
        module.calls.append("matmul_reduce_scatter")
        return reference.matmul_reduce_scatter(x, weight, bias, info)

    def gather_rows(x_shard, info):
        module.calls.append("gather_rows")
        return reference.gather_rows(x_shard, info)

    def all_reduce_sum(t, info, async_op=False):
        module.calls.append("all_reduce_sum")
        return reference.all_reduce_sum(t, info, async_op)

    for fn in (all_gather_matmul, matmul_reduce_scatter, gather_rows, all_reduce_sum):
        setattr(module, fn.__name__, fn)
    return module


def test_register_refuses_reserved_and_taken_names():
    for name in ("nccl", "torch", "fused", "auto", ""):
        with pytest.raises(ValueError, match="cannot register a backend as"):
            backends.register(name, _toy_module("toy"))
    with pytest.raises(TypeError, match="a backend name must be a str"):
        backends.register(3, _toy_module("toy"))
    toy = _toy_module("toy_taken")
    backends.register("toy_taken", toy)
    backends.register("toy_taken", toy)  # the same module again: nothing changes
    with pytest.raises(ValueError, match="'toy_taken' is already registered as module toy_taken"):
        backends.register("toy_taken", _toy_module("another"))
    assert backends.registered().count("toy_taken") == 1


def test_register_refuses_what_is_not_a_backend_module():
    no_check = types.ModuleType("no_check")
    no_check.all_gather_matmul = lambda *args: None
    with pytest.raises(TypeError, match=r"module no_check has no unsupported_reason\(op, x, weight, info"):
        backends.register("toy_no_check", no_check)
    with pytest.raises(TypeError, match="must be a module or its import path, got dict"):
        backends.register("toy_dict", {"unsupported_reason": lambda *a: None})
    with pytest.raises(TypeError, match="module math has no unsupported_reason"):
        backends.register("toy_math", "math")  # an import path: imported, then checked
    with pytest.raises(ModuleNotFoundError):
        backends.register("toy_missing", "fluxtp.no_such_backend")
    assert not {"toy_no_check", "toy_dict", "toy_math", "toy_missing"} & set(backends.registered())


def test_a_registered_name_is_a_valid_backend_and_auto_never_picks_it():
    backends.register("toy_valid", _toy_module("toy_valid"))
    ColumnParallelLinear(8, 8, backend="toy_valid")  # world of one: constructed, nothing called
    with pytest.raises(ValueError, match="backend must be one of .*'toy_valid', got 'toy_unknown'"):
        RowParallelLinear(8, 8, backend="toy_unknown")
    assert "toy_valid" not in backends.AUTO_ORDER


def _registered_rank(rank, world):
    toy = _toy_module("toy_ranks")
    backends.register("toy_ranks", toy)
    generator = torch.Generator().manual_seed(0)
    x_shard, weight = torch.randn(4, 16, generator=generator), torch.randn(6, 16, generator=generator)
    # The public op reaches the registered module, and computes what the reference does.
    y = fluxtp.all_gather_matmul(x_shard, weight, backend="toy_ranks")
    assert toy.calls == ["all_gather_matmul"]
    assert torch.equal(y, fluxtp.all_gather_matmul(x_shard, weight, backend="nccl"))
    # An op the module lacks: the reason names the backend and the op.
    with pytest.raises(ValueError, match="backend 'toy_ranks' does not implement matmul_all_reduce"):
        fluxtp.matmul_all_reduce(x_shard, weight, backend="toy_ranks")

    # Layers with a bias and a re-gather, trained: every collective of their forward and
    # backward runs through the backend that set_backend gave them.
    column = ColumnParallelLinear(16, 8, save_memory=True, backend="nccl")
    row = RowParallelLinear(8, 16, backend="nccl")
    layers = torch.nn.ModuleList([column, row])
    set_backend(layers, "toy_ranks")
    assert column.backend == row.backend == "toy_ranks"
    toy.calls.clear()
    x = x_shard.clone().requires_grad_()
    row(column(x)).square().sum().backward()
    forward = ["all_gather_matmul", "matmul_reduce_scatter"]
    backward = ["all_gather_matmul", "gather_rows", "all_reduce_sum", "matmul_reduce_scatter"]
    assert sorted(toy.calls) == sorted(forward + backward), toy.calls
    # The same layers on the reference: the same gradients, to the bit.
    grads = [p.grad for p in (x, *layers.parameters())]
    set_backend(layers, "nccl")
    x.grad = None
    layers.zero_grad(set_to_none=True)
    row(column(x)).square().sum().backward()
    for grad, p in zip(grads, (x, *layers.parameters())):
        assert torch.equal(grad, p.grad)


def test_a_registered_backend_runs_the_public_ops_and_every_collective_of_the_layers():
    run_on_ranks(_registered_rank, 2, backend="gloo", timeout_s=120)


@pytest.mark.parametrize("name", backends.BUILT_IN)
def test_every_built_in_backend_implements_every_op_as_the_reference_does(name):
    # unsupported_reason refuses an op the backend module does not define, even where its plan
    # covers it: the fused FP8 ops were once unreachable on real ranks that way.
    import inspect

    from tests._cases import ALL_OPS

    module, reference = backends._module(name), backends._module("nccl")
    for op in (*ALL_OPS, *backends.SCALED_OPS):
        assert callable(getattr(module, op, None)), f"backend {name!r} has no {op}"
        ours, theirs = inspect.signature(getattr(module, op)), inspect.signature(getattr(reference, op))
        assert list(ours.parameters) == list(theirs.parameters), f"{name}.{op}{ours} differs from the reference's {theirs}"
