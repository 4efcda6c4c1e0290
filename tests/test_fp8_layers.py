"""FP8 layers (fp8=True) on gloo worlds of 1-3 against an unsharded FP8 emulation in float64, and a
short training run against the same model without FP8.

The emulation (below) is written from the recipe in fluxtp/nn/_fp8.py, on the whole tensors in
one process: each GEMM's two operands quantized row-wise along its reduction dim, with the
quantization groups tensor parallelism gives (a rank quantizes what it holds: the column layer's
output gradient per rank's output features, the row layer's input and weight per rank's input
features), the product taken in float64 on the dequantized values. The layer's operands are the
same FP8 values, so what the comparison measures is float32 accumulation and the sums over ranks.
"""

import random

import pytest
import torch
from torch import nn

from fluxtp import fp8
from fluxtp.nn import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from fluxtp.testing import run_on_ranks
from tests._fp8_cases import rel_error

# float32 layers: every compared value is a float32 sum of K exact products of FP8 values (and
# float32 sums over ranks), rounded once to float32: well below 1e-5 normwise.
TOL = 1e-5


def q(t):
    """quantize_rows, dequantized in float64: the value the FP8 GEMMs multiply."""
    t_q, s = fp8.quantize_rows(t)
    return t_q.double() * s.double()


def scaled(a, b):
    """a @ b^T with both operands quantized row-wise (along their common last dim)."""
    return q(a) @ q(b).T


def _close(what, out, ref):
    assert out is not None, f"{what}: no result"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = rel_error(out, ref)
    assert err <= TOL, f"{what}: rel err {err:.2e} > {TOL:.0e}"


def check_column(rank, world, seed, t, k, ns, bias, save_memory):
    """column_parallel_linears of len(ns) layers (one all-gather); full x [t, k], layer i [ns[i], k]."""
    torch.manual_seed(seed)
    linears = [nn.Linear(k, n, bias=bias) for n in ns]
    x = torch.randn(t, k) * 2.0 ** torch.randint(-3, 4, (t, 1))
    grads = [torch.randn(t, n) for n in ns]
    rows = slice(rank * t // world, (rank + 1) * t // world)
    layers = [ColumnParallelLinear.from_linear(lin, fp8=True, save_memory=save_memory, backend="nccl") for lin in linears]
    x_shard = x[rows].clone().requires_grad_(True)
    ys = column_parallel_linears(x_shard, layers)
    torch.autograd.backward(ys, [g[:, _cols(rank, world, g.shape[1])] for g in grads])
    what = f"column W={world} t={t} k={k} ns={ns} bias={bias} save_memory={save_memory}"
    # Forward: x rows whole on every rank; each weight's rows whole.
    for i, (lin, layer, y) in enumerate(zip(linears, layers, ys)):
        cols = _cols(rank, world, ns[i])
        ref = scaled(x, lin.weight.detach()[cols]) + (lin.bias.detach()[cols].double() if bias else 0)
        _close(f"{what} layer {i} output", y, ref)
    # Input gradient: one reduce-scatter of [G_0 | G_1 | ..] @ [W_0; W_1; ..], each rank's G and
    # W^T quantized over its own output features.
    grad_x = torch.zeros(t, k, dtype=torch.float64)
    for r in range(world):
        g_r = torch.cat([g[:, _cols(r, world, g.shape[1])] for g in grads], dim=1)
        w_r = torch.cat([lin.weight.detach()[_cols(r, world, lin.out_features)] for lin in linears], dim=0)
        grad_x += scaled(g_r, w_r.t())
    _close(f"{what} input grad", x_shard.grad, grad_x[rows])
    # Weight gradient: G^T and x^T quantized along the tokens; x is the gathered FP8 rows (kept, or
    # re-gathered with save_memory), dequantized (exact).
    x_used = fp8.dequantize(*fp8.quantize_rows(x))
    for i, (layer, g) in enumerate(zip(layers, grads)):
        g_r = g[:, _cols(rank, world, ns[i])]
        _close(f"{what} layer {i} weight grad", layer.weight.grad, scaled(g_r.t(), x_used.t()))
        if bias:
            _close(f"{what} layer {i} bias grad", layer.bias.grad, g_r.double().sum(0))


def _cols(rank, world, n):
    return slice(rank * n // world, (rank + 1) * n // world)


def check_row(rank, world, seed, t, k, n, bias):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(t, k) * 2.0 ** torch.randint(-3, 4, (t, 1))
    grad = torch.randn(t, n)
    layer = RowParallelLinear.from_linear(lin, fp8=True, backend="nccl")
    ks, rows = _cols(rank, world, k), slice(rank * t // world, (rank + 1) * t // world)
    x_k = x[:, ks].clone().requires_grad_(True)
    out = layer(x_k)
    out.backward(grad[rows])
    what = f"row W={world} t={t} k={k} n={n} bias={bias}"
    w = lin.weight.detach()
    ref = sum(scaled(x[:, _cols(r, world, k)], w[:, _cols(r, world, k)]) for r in range(world))
    _close(f"{what} output", out, ref[rows] + (lin.bias.detach().double() if bias else 0))
    _close(f"{what} input grad", x_k.grad, scaled(grad, w[:, ks].t()))  # G rows whole, W^T over all N
    g_used = fp8.dequantize(*fp8.quantize_rows(grad))  # the gathered FP8 output gradient
    _close(f"{what} weight grad", layer.weight.grad, scaled(g_used.t(), x[:, ks].t()))
    if bias:
        _close(f"{what} bias grad", layer.bias.grad, grad.double().sum(0))


def _layers_body(rank, world, seed):
    check_column(rank, world, seed, 6 * world, 32, (8 * world,), True, False)
    check_column(rank, world, seed + 1, 4 * world, 48, (4 * world, 8 * world), False, True)  # two layers, save_memory
    check_column(rank, world, seed + 2, 3 * world, 16, (2 * world, 2 * world, 6 * world), True, False)  # q, k, v
    check_row(rank, world, seed + 3, 6 * world, 16 * world, 24, True)
    check_row(rank, world, seed + 4, 2 * world, 8 * world, 40, False)


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_layers_match_the_unsharded_emulation(world):
    run_on_ranks(_layers_body, world, random.randrange(1 << 30), backend="gloo")


def test_fp8_layers_world_of_one():
    _layers_body(0, 1, random.randrange(1 << 30))


def test_fp8_column_layer_with_save_memory_quantizes_its_rows_once(monkeypatch):
    """save_memory keeps the FP8 rows and scales the all-gather moved: the forward quantizes the
    input rows once for both, and the layer computes exactly what it does without save_memory."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16, bias=True)
    x = torch.randn(8, 32) * 2.0 ** torch.randint(-3, 4, (8, 1))
    grad = torch.randn(8, 16)
    real, quantized = fp8.quantize_rows, []

    def counting(t, *args, **kwargs):
        quantized.append(tuple(t.shape))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(fp8, "quantize_rows", counting)
    results = {}
    for save_memory in (False, True):
        layer = ColumnParallelLinear.from_linear(linear, fp8=True, save_memory=save_memory, backend="nccl")
        x_in = x.clone().requires_grad_(True)
        quantized.clear()
        y = layer(x_in)
        forward_rows = quantized.count(tuple(x.shape))
        y.backward(grad)
        results[save_memory] = (y.detach(), x_in.grad, layer.weight.grad, layer.bias.grad)
        assert forward_rows == 1, f"save_memory={save_memory}: the input rows quantized {forward_rows} times"
    for kept, saved in zip(results[False], results[True]):
        assert torch.equal(kept, saved)


# ---------------------------------------------------------------- a short training run

STEPS = 40
# The FP8 run's loss within this fraction of the bf16 run's at every step. e4m3 keeps 3 mantissa
# bits (relative rounding error up to 2^-4, about 2^-4/sqrt(3) rms per value), so each FP8 GEMM
# is off by a few percent of its output's norm against bf16's 2^-8: the two runs differ from the
# first step by that much, and the drift must stay of that order while the loss falls by half.
LOSS_BOUND = 0.1


def _train(rank, world, seed, use_fp8):
    """A column -> GELU -> row MLP block, bf16 parameters, learning a fixed random target map."""
    torch.manual_seed(seed)
    hidden, ffn, tokens = 32, 64, 16 * world
    up, down = nn.Linear(hidden, ffn, dtype=torch.bfloat16), nn.Linear(ffn, hidden, dtype=torch.bfloat16)
    target = torch.randn(hidden, hidden) / hidden**0.5
    col = ColumnParallelLinear.from_linear(up, fp8=use_fp8, backend="nccl")
    row = RowParallelLinear.from_linear(down, fp8=use_fp8, backend="nccl")
    opt = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=3e-3)
    losses = []
    data = torch.Generator().manual_seed(seed + 1)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    for _ in range(STEPS):
        x = torch.randn(tokens, hidden, generator=data)
        y = (x @ target)[rows]
        out = row(torch.nn.functional.gelu(col(x[rows].bfloat16())))
        loss = ((out.float() - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _training_body(rank, world, seed):
    bf16, fp8_run = _train(rank, world, seed, False), _train(rank, world, seed, True)
    assert fp8_run[-1] < 0.6 * fp8_run[0], f"the FP8 run did not learn: {fp8_run[0]:.4f} -> {fp8_run[-1]:.4f}"
    worst = max(abs(a - b) / b for a, b in zip(fp8_run, bf16))
    assert worst <= LOSS_BOUND, f"FP8 loss off the bf16 loss by {worst:.3f} (bf16 {bf16}, fp8 {fp8_run})"
    if rank == 0:
        print(f"fp8 vs bf16 loss, worst relative gap {worst:.4f}: {fp8_run[0]:.4f} -> {fp8_run[-1]:.4f}")


def test_fp8_training_tracks_bf16():
    run_on_ranks(_training_body, 2, random.randrange(1 << 30), backend="gloo")
