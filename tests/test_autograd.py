"""Gradients of the four functional ops against a float64 single-process reference, for gloo
worlds of 1, 2 and 3, eager and under torch.compile(fullgraph=True) without a graph break or a
Dynamo warning (fluxtp.ops._autograd states the convention: sharded outputs feed each rank's own
loss, summed over ranks; replicated outputs feed one loss, the same on every rank).

The reference simulates every rank in one process on the global tensors (the same draw on
every rank), differentiated by torch's autograd; each rank's gradients must match their part of it.
"""

import json
import random
import warnings

import pytest
import torch
import torch.distributed as dist

import fluxtp
from fluxtp.testing import run_on_ranks

F64 = torch.float64
TOL = 1e-10


def _draw(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def _leaf(t):
    return t.clone().requires_grad_(True)


def _close(got, want, what):
    assert got is not None, f"{what}: no gradient"
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err < TOL, f"{what}: relative error {err:.2e}"


def _all_gather_matmul(rank, world, g, run, gathered_loss):
    m, n, k = 3, 4, 5
    x, w, b = _draw(g, world * m, k), _draw(g, world * n, k), _draw(g, world * n)
    cot, cot_x = _draw(g, world, world * m, n), _draw(g, world, world * m, k)
    rows, feats = slice(rank * m, (rank + 1) * m), slice(rank * n, (rank + 1) * n)
    xs, ws, bs = _leaf(x[rows]), _leaf(w[feats]), _leaf(b[feats])

    def loss_of(x_shard, weight, bias):
        y, gathered = fluxtp.all_gather_matmul(x_shard, weight, bias=bias, return_gathered=True)
        loss = (y * cot[rank]).sum()
        return loss + (gathered * cot_x[rank]).sum() if gathered_loss else loss

    run(loss_of, xs, ws, bs).backward()
    xr, wr, br = _leaf(x), _leaf(w), _leaf(b)
    total = 0
    for r in range(world):
        f = slice(r * n, (r + 1) * n)
        total = total + ((xr @ wr[f].T + br[f]) * cot[r]).sum()
        if gathered_loss:
            total = total + (xr * cot_x[r]).sum()
    total.backward()
    _close(xs.grad, xr.grad[rows], "all_gather_matmul x")
    _close(ws.grad, wr.grad[feats], "all_gather_matmul weight")
    _close(bs.grad, br.grad[feats], "all_gather_matmul bias")


def _matmul_reduce_scatter(rank, world, g, run):
    m, n, k = 2, 4, 3
    x, w, b = _draw(g, world * m, world * k), _draw(g, n, world * k), _draw(g, world, n)
    cot = _draw(g, world, m, n)
    cols = slice(rank * k, (rank + 1) * k)
    xs, ws, bs = _leaf(x[:, cols]), _leaf(w[:, cols]), _leaf(b[rank])
    run(lambda x_, w_, b_: (fluxtp.matmul_reduce_scatter(x_, w_, bias=b_) * cot[rank]).sum(), xs, ws, bs).backward()
    xr, wr, br = _leaf(x), _leaf(w), _leaf(b)
    partial = xr @ wr.T
    total = sum(((partial[r * m : (r + 1) * m] + br[r]) * cot[r]).sum() for r in range(world))
    total.backward()
    _close(xs.grad, xr.grad[:, cols], "matmul_reduce_scatter x")
    _close(ws.grad, wr.grad[:, cols], "matmul_reduce_scatter weight")
    _close(bs.grad, br.grad[rank], "matmul_reduce_scatter bias")


def _matmul_all_reduce(rank, world, g, run):
    """A replicated output feeding one loss (the same on every rank), as a row-parallel linear
    without sequence parallelism: its gradient is already the whole loss's on every rank."""
    m, n, k = 3, 4, 2
    x, w, b = _draw(g, m, world * k), _draw(g, n, world * k), _draw(g, n)
    cot = _draw(g, m, n)
    cols = slice(rank * k, (rank + 1) * k)
    xs, ws, bs = _leaf(x[:, cols]), _leaf(w[:, cols]), _leaf(b)
    run(lambda x_, w_, b_: (fluxtp.matmul_all_reduce(x_, w_, bias=b_) * cot).sum(), xs, ws, bs).backward()
    xr, wr, br = _leaf(x), _leaf(w), _leaf(b)
    ((xr @ wr.T + br) * cot).sum().backward()
    _close(xs.grad, xr.grad[:, cols], "matmul_all_reduce x")
    _close(ws.grad, wr.grad[:, cols], "matmul_all_reduce weight")
    _close(bs.grad, br.grad, "matmul_all_reduce bias")


def _all_reduce(rank, world, g, run):
    x, cot = _draw(g, world, 3, 5), _draw(g, 3, 5)
    xs = _leaf(x[rank])
    run(lambda x_, w_, b_: (fluxtp.all_reduce(x_) * cot).sum(), xs, None, None).backward()
    xr = _leaf(x)
    (xr.sum(0) * cot).sum().backward()
    _close(xs.grad, xr.grad[rank], "all_reduce x")


def _every_op(rank, world, seed, run):
    g = torch.Generator().manual_seed(seed)  # the same global draws on every rank
    _all_gather_matmul(rank, world, g, run, gathered_loss=False)
    _all_gather_matmul(rank, world, g, run, gathered_loss=True)
    _matmul_reduce_scatter(rank, world, g, run)
    _matmul_all_reduce(rank, world, g, run)
    _all_reduce(rank, world, g, run)


def _eager(loss_of, *args):
    return loss_of(*args)


def _gradients_body(rank, world, seed):
    _every_op(rank, world, seed, _eager)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gradients_match_the_float64_reference(world):
    run_on_ranks(_gradients_body, world, random.randrange(1 << 30), backend="gloo")


def _compiled_body(rank, world, seed, out_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    def run(loss_of, *args):
        return torch.compile(loss_of, fullgraph=True, backend=backend, dynamic=False)(*args)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _every_op(rank, world, seed, run)
    report = {
        "graph_breaks": dict(counters["graph_break"]),
        "dynamo_warnings": [str(w.message) for w in caught if "dynamo" in (w.filename + str(w.message)).lower()],
        "graphs": len(compiled_graphs),
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("world", [2])
def test_compiled_with_fullgraph_forward_and_backward(world, tmp_path):
    """Each functional op inside torch.compile(fullgraph=True): one graph, no break, no Dynamo
    warning, and the gradients of the eager test (fullgraph raises on any graph break)."""
    out = tmp_path / "report.json"
    run_on_ranks(_compiled_body, world, random.randrange(1 << 30), str(out), backend="gloo", timeout_s=600)
    report = json.loads(out.read_text())
    assert report["graph_breaks"] == {} and report["dynamo_warnings"] == [], report
    assert report["graphs"] == 5, report  # one per compiled loss: two all-gather variants and three ops


def _plans_body(rank, world, seed):
    """Backward calls go through the planned ops too: a second step builds no new plan."""
    import importlib

    ag_module = importlib.import_module("fluxtp.ops.all_gather_matmul")  # fluxtp.ops.X is the function
    rs_module = importlib.import_module("fluxtp.ops.matmul_reduce_scatter")
    del seed
    x, w = torch.randn(4, 6, dtype=F64, requires_grad=True), torch.randn(5, 6, dtype=F64, requires_grad=True)
    for step in range(3):
        fluxtp.all_gather_matmul(x, w).sum().backward()
        if step == 0:
            sizes = (len(ag_module._plans), len(rs_module._plans))
    assert (len(ag_module._plans), len(rs_module._plans)) == sizes and sizes[1] >= 1, sizes
    dist.barrier()


def test_backward_steps_reuse_their_plans():
    run_on_ranks(_plans_body, 2, 0, backend="gloo")
