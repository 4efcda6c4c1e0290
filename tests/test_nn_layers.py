"""ColumnParallelLinear and RowParallelLinear against the unsharded nn.Linear, forward and
backward (output, input gradient, weight and bias gradients), on gloo worlds of 2 and 3.

Every rank builds the same full layer and the same full inputs from one seed, runs the
sharded layer on its slice, and compares each result with the float64 computation of the
whole layer, sliced the same way. All cases of a world run inside one spawn (each spawn pays
the torch import).
"""

import random

import pytest
import torch
from torch import nn

from fluxtp.nn import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from fluxtp.testing import run_on_ranks
from tests._cases import recording_return_gathered, rel_error

# Normwise relative error against float64, ||out - ref|| / ||ref||. Each compared value is one
# sum over at most K=48 (forward, input gradient) or M=36 (weight gradient) products computed in
# a different order than the reference (split over ranks, other blocking): the error is a few
# K*u at worst and typically sqrt(K)*u. float32 (u = 6e-8): 48*u = 2.9e-6, allow 1e-5.
# float64 (u = 1.1e-16): 48*u = 5e-15, allow 1e-12 (still far below any real bug).
# bfloat16 (GPU tests; u = 2^-8, fp32 accumulation): outputs are rounded once, but reduced
# values (row output, column input gradient, row bias gradient) also round each rank's partial
# before the sum, and partials can exceed their sum: 4u, as for the ops (tests/_cases.py).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 4 * 2**-8}


def _close(name, out, ref, dtype):
    assert out is not None, f"{name}: no gradient"
    out = out.cpu()
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{name}: dtype {out.dtype}, expected {dtype}"
    err = rel_error(out, ref)
    assert err <= TOLERANCE[dtype], f"{name}: rel err {err:.2e} > {TOLERANCE[dtype]:.0e}"


def _reference(x, linear, grad_out):
    """The whole layer in float64: output and the gradients of sum(output * grad_out)."""
    x64 = x.detach().double().requires_grad_(x.requires_grad)
    ref = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(linear.weight)
        if linear.bias is not None:
            ref.bias.copy_(linear.bias)
    y = ref(x64)
    y.backward(grad_out.double())
    return (
        y.detach(),
        (x64.grad if x.requires_grad else None),
        ref.weight.grad,
        (ref.bias.grad if ref.bias is not None else None),
    )


def check_column(rank, world, seed, lead, k, n, dtype, bias, save_memory, x_grad=True, device="cpu", backend="auto"):
    """lead: leading dims of the *full* input (first one W*d0); rank r holds block r of dim 0.
    Inputs are drawn on the CPU (the same on every rank), the layer runs on `device`."""
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias, dtype=dtype)
    if bias:  # nn.Linear's bias would do, but a fresh draw keeps it away from the weight's scale
        nn.init.normal_(linear.bias)
    x = torch.randn(*lead, k, dtype=dtype, requires_grad=x_grad)
    grad_y = torch.randn(*lead, n, dtype=dtype)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x, linear, grad_y)

    layer = ColumnParallelLinear.from_linear(linear.to(device), save_memory=save_memory, backend=backend)
    rows = lead[0] // world
    n_local = n // world
    cols = slice(rank * n_local, (rank + 1) * n_local)
    x_shard = x.detach()[rank * rows : (rank + 1) * rows].to(device).requires_grad_(x_grad)
    y = layer(x_shard)
    tag = f"column {backend} W={world} {dtype} lead={lead} k={k} n={n} bias={bias} save_memory={save_memory}"
    _close(f"{tag} output", y, y_ref[..., cols], dtype)
    y.backward(grad_y[..., cols].to(device))
    if x_grad:
        _close(f"{tag} input grad", x_shard.grad, gx_ref[rank * rows : (rank + 1) * rows], dtype)
    _close(f"{tag} weight grad", layer.weight.grad, gw_ref[cols], dtype)
    if bias:
        _close(f"{tag} bias grad", layer.bias.grad, gb_ref[cols], dtype)


def check_row(rank, world, seed, lead, k, n, dtype, bias, x_grad=True, device="cpu", backend="auto"):
    """lead: leading dims of the full input (all rows on every rank, first one divisible by W)."""
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias, dtype=dtype)
    if bias:
        nn.init.normal_(linear.bias)
    x = torch.randn(*lead, k, dtype=dtype, requires_grad=x_grad)
    grad_out = torch.randn(*lead, n, dtype=dtype)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(x, linear, grad_out)

    layer = RowParallelLinear.from_linear(linear.to(device), backend=backend)
    rows = lead[0] // world
    k_local = k // world
    cols = slice(rank * k_local, (rank + 1) * k_local)
    x_local = x.detach()[..., cols].contiguous().to(device).requires_grad_(x_grad)
    out = layer(x_local)
    tag = f"row {backend} W={world} {dtype} lead={lead} k={k} n={n} bias={bias}"
    _close(f"{tag} output", out, y_ref[rank * rows : (rank + 1) * rows], dtype)
    out.backward(grad_out[rank * rows : (rank + 1) * rows].to(device))
    if x_grad:
        _close(f"{tag} input grad", x_local.grad, gx_ref[..., cols], dtype)
    _close(f"{tag} weight grad", layer.weight.grad, gw_ref[:, cols], dtype)
    if bias:
        # Whole on every rank: the full gradient, summed over every rank's rows.
        _close(f"{tag} bias grad", layer.bias.grad, gb_ref, dtype)


def check_shared_gather(rank, world, seed, lead, k, ns, biases, dtype, save_memory, device="cpu", backend="auto"):
    """column_parallel_linears: several column layers of one input (one all-gather) against
    the unsharded linears, with the loss sum_i sum(y_i * G_i) so every input gradient counts."""
    torch.manual_seed(seed)
    linears = [nn.Linear(k, n, bias=b, dtype=dtype) for n, b in zip(ns, biases)]
    for linear in linears:
        if linear.bias is not None:
            nn.init.normal_(linear.bias)
    x = torch.randn(*lead, k, dtype=dtype)
    grad_ys = [torch.randn(*lead, n, dtype=dtype) for n in ns]
    x64 = x.double().clone().requires_grad_()  # a copy: for float64, .double() is x itself
    refs = [nn.Linear(k, n, bias=b, dtype=torch.float64) for n, b in zip(ns, biases)]
    for ref, linear in zip(refs, linears):
        ref.load_state_dict({name: t.double() for name, t in linear.state_dict().items()})
    y_refs = [ref(x64) for ref in refs]
    torch.autograd.backward(y_refs, [g.double() for g in grad_ys])

    layers = [
        ColumnParallelLinear.from_linear(lin.to(device), save_memory=save_memory, backend=backend) for lin in linears
    ]
    rows = lead[0] // world
    x_shard = x[rank * rows : (rank + 1) * rows].to(device).requires_grad_()
    ys = column_parallel_linears(x_shard, layers)
    tag = f"shared gather {backend} W={world} {dtype} lead={lead} ns={ns} save_memory={save_memory}"
    col_slices = [slice(rank * (n // world), (rank + 1) * (n // world)) for n in ns]
    for i, (y, y_ref, cols) in enumerate(zip(ys, y_refs, col_slices)):
        _close(f"{tag} output {i}", y, y_ref.detach()[..., cols], dtype)
    torch.autograd.backward(ys, [g[..., cols].to(device) for g, cols in zip(grad_ys, col_slices)])
    _close(f"{tag} input grad", x_shard.grad, x64.grad[rank * rows : (rank + 1) * rows], dtype)
    for i, (layer, ref, cols) in enumerate(zip(layers, refs, col_slices)):
        _close(f"{tag} weight grad {i}", layer.weight.grad, ref.weight.grad[cols], dtype)
        if ref.bias is not None:
            _close(f"{tag} bias grad {i}", layer.bias.grad, ref.bias.grad[cols], dtype)


def check_errors(world):
    with pytest.raises(ValueError, match="out_features=7 must be divisible"):
        ColumnParallelLinear(8, 7)
    with pytest.raises(ValueError, match="in_features=7 must be divisible"):
        RowParallelLinear(7, 8)
    column = ColumnParallelLinear(8, 2 * world)
    with pytest.raises(ValueError, match=r"x_shard must be \[rows, 8\]"):
        column(torch.randn(4, 6))
    row = RowParallelLinear(2 * world, 8)
    with pytest.raises(ValueError, match="first dim 1 must be divisible"):
        row(torch.randn(1, 4 * world, 2))
    with pytest.raises(ValueError, match="backend must be one of"):
        ColumnParallelLinear(8, 8, backend="nope")
    with pytest.raises(ValueError, match="same in_features, group, backend and save_memory"):
        column_parallel_linears(torch.randn(4, 8), [column, ColumnParallelLinear(8, 2 * world, save_memory=True)])


def _layers_body(rank, world, seed):
    case = 0
    for dtype in (torch.float32, torch.float64):
        # 2-D [tokens, features] and 3-D [batch, seq, features]; odd sizes where allowed.
        for lead in ((5 * world,), (2 * world, 3), (world, 1)):
            for bias in (True, False):
                s = seed + 100 * case
                k, n = 16 * world - 4 * (case % 2), 4 * world * (1 + case % 3)
                for save_memory in (False, True):
                    check_column(rank, world, s, lead, k, n, dtype, bias, save_memory)
                check_row(rank, world, s + 1, lead, 4 * world * (1 + case % 3), 16 * world - 3, dtype, bias)
                case += 1
    # Only the weight gradient asked for (e.g. the first layer of a model): other backward paths.
    check_column(rank, world, seed + 7, (3 * world, 2), 12, 2 * world, torch.float64, True, True, x_grad=False)
    check_column(rank, world, seed + 8, (3 * world, 2), 12, 2 * world, torch.float64, True, False, x_grad=False)
    check_row(rank, world, seed + 9, (3 * world, 2), 2 * world, 12, torch.float64, True, x_grad=False)
    # q/k/v-like: three layers of one input (different widths, biases on some), one all-gather.
    for i, (dtype, lead) in enumerate([(torch.float64, (4 * world,)), (torch.float32, (2 * world, 3))]):
        for save_memory in (False, True):
            ns = (4 * world, 2 * world, 2 * world)
            check_shared_gather(rank, world, seed + 20 + i, lead, 12, ns, (True, False, True), dtype, save_memory)
    check_errors(world)


@pytest.mark.parametrize("world", [2, 3])
def test_layers_match_unsharded_linear(world):
    run_on_ranks(_layers_body, world, random.randrange(1 << 30), backend="gloo")


def test_world_of_one_is_nn_linear():
    """Without torch.distributed the layers are plain linears (same checks, one rank)."""
    seed = random.randrange(1 << 30)
    for save_memory in (False, True):
        check_column(0, 1, seed, (6, 2), 10, 6, torch.float64, True, save_memory)
    check_row(0, 1, seed + 1, (6, 2), 10, 6, torch.float64, True)


def _gathered_rows_asked_body(rank, world, seed):
    """Which all-gathers of the layers ask for the gathered rows: only those whose rows a second
    linear or the backward's weight gradient reads; the rest take the op's cheaper path. The
    results do not change (outputs bitwise; gradients of the other ways bitwise too: save_memory
    re-gathers the FP8 rows the keeping way kept)."""
    from fluxtp.nn import _fp8, linear as linear_module

    places = ((linear_module, "all_gather_matmul"), (_fp8, "all_gather_scaled_matmul"))
    with recording_return_gathered(*places) as asked:
        torch.manual_seed(seed)
        k, n, rows = 16, 8 * world, 6
        x = torch.randn(rows, k)

        def run(layer, grad, x_grad=False):
            """(output, asked, input grad, weight grad) of one forward (and backward when grad)."""
            asked.clear()
            x_shard = x.clone().requires_grad_(x_grad)
            with torch.set_grad_enabled(grad):
                y = layer(x_shard)
                if grad:
                    y.square().sum().backward()
            grads = (x_shard.grad, layer.weight.grad)
            layer.zero_grad(set_to_none=True)
            return y.detach(), list(asked), *grads

        for fp8 in (False, True):
            full = nn.Linear(k, n)
            column = ColumnParallelLinear.from_linear(full, fp8=fp8)
            y, ask, gx, gw = run(column, grad=True, x_grad=True)
            assert ask == [True], (fp8, ask)
            y_nograd, ask, _, _ = run(column, grad=False)
            assert ask == [False] and torch.equal(y_nograd, y), (fp8, ask)
            saving = ColumnParallelLinear.from_linear(full, fp8=fp8, save_memory=True)
            y_saving, ask, gx_saving, gw_saving = run(saving, grad=True, x_grad=True)
            assert ask == [False] and torch.equal(y_saving, y) and torch.equal(gx_saving, gx), (fp8, ask)
            assert torch.equal(gw_saving, gw), f"fp8={fp8}: save_memory's re-gathered weight gradient differs"
            column.weight.requires_grad_(False)
            y_frozen, ask, gx_frozen, _ = run(column, grad=True, x_grad=True)
            assert ask == [False] and torch.equal(y_frozen, y) and torch.equal(gx_frozen, gx), (fp8, ask)
            column.weight.requires_grad_(True)
            pair = [column, ColumnParallelLinear.from_linear(nn.Linear(k, n), fp8=fp8)]
            asked.clear()
            with torch.no_grad():
                column_parallel_linears(x, pair)
            assert asked == [True], (fp8, asked)  # the second layer reads the gathered rows
            row = RowParallelLinear.from_linear(nn.Linear(n, k), fp8=fp8)
            x_row = torch.randn(rows * world, n // world)
            for weight_grad in (True, False):
                row.weight.requires_grad_(weight_grad)
                asked.clear()
                row(x_row.clone().requires_grad_(True)).square().sum().backward()
                assert asked == [weight_grad], (fp8, weight_grad, asked)


def test_layers_ask_for_the_gathered_rows_only_where_something_reads_them():
    run_on_ranks(_gathered_rows_asked_body, 2, random.randrange(1 << 30), backend="gloo")
