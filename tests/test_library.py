"""The torch.library registration composes: opcheck on the four custom ops, torch.compile of a
function calling the public ops (the ops stay in the graph as single nodes and the result
matches eager), and plain eager calls skipping the custom op's dispatch only where nothing can
tell. All in one 2-rank gloo world (spawning a world costs seconds)."""

import importlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fluxtp
from fluxtp.testing import run_on_ranks


def _tp_block(x_shard, w_up, w_down):
    """A sequence-parallel MLP: column-parallel up, row-parallel down, plus an all-reduce."""
    h = F.relu(fluxtp.all_gather_matmul(x_shard, w_up))  # [m*W, n]
    out = fluxtp.matmul_reduce_scatter(h, w_down)  # [m, K]
    total = fluxtp.matmul_all_reduce(h, w_down)  # [m*W, K]
    return out, fluxtp.all_reduce(total)


def _library_body(rank, world, out_path):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.library import opcheck

    group_name = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    x_rows = torch.randn(4 * world, 8)
    checks = [
        (torch.ops.fluxtp.all_gather_matmul.default, (x, w, b, group_name, "nccl", True)),
        (torch.ops.fluxtp.matmul_reduce_scatter.default, (x_rows, w, b, group_name, "nccl")),
        (torch.ops.fluxtp.matmul_all_reduce.default, (x, w, None, group_name, "nccl")),
        (torch.ops.fluxtp.all_reduce.default, (x, group_name, "nccl")),
    ]
    report = {"opcheck": []}
    for op, args in checks:
        # Every rank runs the same checks in the same order, so their collectives pair up.
        results = opcheck(op, args)
        report["opcheck"].append([str(op), results])

    x_shard, w_up, w_down = torch.randn(8, 16), torch.randn(12, 16), torch.randn(16, 12)
    eager = _tp_block(x_shard, w_up, w_down)
    # aot_eager, recording the graphs dynamo hands it (one compilation: they cost seconds each).
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_tp_block, fullgraph=False, backend=backend)(x_shard, w_up, w_down)
    for got, expected in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, expected)
    report["graph_targets"] = sorted(
        {str(n.target) for gm in backend.graphs for n in gm.graph.nodes if n.op == "call_function"}
    )
    report["custom_op_calls"] = _custom_op_calls(world)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _custom_op_calls(world):
    """Per scenario, how many public-op calls went through the torch.library op (each module's
    op wrapped in a counter); eager plain calls go direct, and give the custom op's exact result."""
    ops = fluxtp.OPS + ("all_reduce",)
    modules = {op: importlib.import_module(f"fluxtp.ops.{op}") for op in ops}
    originals = {op: getattr(modules[op], f"_{op}_op") for op in ops}
    calls = {"n": 0}

    def counting(original):
        def call(*args):
            calls["n"] += 1
            return original(*args)

        return call

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    x_rows = torch.randn(4 * world, 8)

    def every_op(weight):
        return [
            fluxtp.all_gather_matmul(x, weight, return_gathered=True)[0],
            fluxtp.matmul_reduce_scatter(x_rows, weight),
            fluxtp.matmul_all_reduce(x, weight),
            fluxtp.all_reduce(x),
        ]

    def count(fn):
        calls["n"] = 0
        fn()
        return calls["n"]

    for op in ops:
        setattr(modules[op], f"_{op}_op", counting(originals[op]))
    try:
        counts = {"plain": count(lambda: every_op(w))}
        name = dist.group.WORLD.group_name
        via_op = [
            torch.ops.fluxtp.all_gather_matmul.default(x, w, None, name, "nccl", False)[0],
            torch.ops.fluxtp.matmul_reduce_scatter.default(x_rows, w, None, name, "nccl"),
            torch.ops.fluxtp.matmul_all_reduce.default(x, w, None, name, "nccl"),
            torch.ops.fluxtp.all_reduce.default(x, name, "nccl"),
        ]
        counts["plain_equals_custom_op"] = all(map(torch.equal, every_op(w), via_op))
        w_param = torch.nn.Parameter(w.clone())
        with torch.no_grad():
            counts["no_grad_parameter"] = count(lambda: every_op(w_param))
        counts["requires_grad"] = count(lambda: every_op(w_param))
        try:
            fluxtp.all_gather_matmul(x, w_param).sum().backward()
            counts["backward_error"] = None
            # sum(y) = sum over rows of x_gathered @ w^T: its weight gradient is the column sums of x_gathered.
            gathered = fluxtp.all_gather_matmul(x, w, return_gathered=True)[1]
            counts["weight_grad_ok"] = torch.allclose(w_param.grad, gathered.sum(0).expand_as(w))
        except RuntimeError as error:
            counts["backward_error"] = str(error)
        with _PassThrough():
            counts["dispatch_mode"] = count(lambda: every_op(w))
    finally:
        for op in ops:
            setattr(modules[op], f"_{op}_op", originals[op])
    return counts


@pytest.fixture(scope="module")
def library_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("library") / "report.json"
    run_on_ranks(_library_body, 2, str(out), backend="gloo")
    return json.loads(out.read_text())


def test_opcheck_passes_for_every_op(library_report):
    ops = {name for name, _ in library_report["opcheck"]}
    assert ops == {f"fluxtp.{op}.default" for op in fluxtp.OPS + ("all_reduce",)}
    for name, results in library_report["opcheck"]:
        assert results, f"opcheck of {name} ran no check"
        for check, outcome in results.items():
            assert outcome == "SUCCESS", f"opcheck {check} of {name}: {outcome}"


def test_torch_compile_keeps_the_custom_ops_in_the_graph(library_report):
    # Same result as eager is asserted on the ranks; here: dynamo traced the public functions
    # down to the custom ops instead of breaking the graph around each call.
    targets = library_report["graph_targets"]
    for op in fluxtp.OPS + ("all_reduce",):
        assert f"fluxtp.{op}.default" in targets, f"{op} is not in any compiled graph: {targets}"


def test_plain_eager_calls_skip_the_custom_op_dispatch(library_report):
    """Plain eager calls (no grad to record, no dispatch mode) call the backend directly, with the
    custom op's exact result; autograd and dispatch modes still see the custom op, whose
    registered backward computes the gradient."""
    calls = library_report["custom_op_calls"]
    assert calls["plain"] == 0 and calls["no_grad_parameter"] == 0, calls
    assert calls["plain_equals_custom_op"], calls
    # requires_grad: the weight of the three GEMM ops (all_reduce's input needs none, so it goes direct).
    assert calls["requires_grad"] == 3 and calls["dispatch_mode"] == 4, calls
    assert calls["backward_error"] is None and calls["weight_grad_ok"], calls
