"""The four linears of fluxtp.nn.styles as differentiable torch.library custom ops, forward and
backward, so torch.compile sees each as one opaque node and traces nothing of fluxtp.

Why custom ops and not autograd.Functions calling the public ops: dynamo traces an
autograd.Function's forward and backward, and through them the public ops' host code (the
backend choice imports modules, the nn layers' backward issues an async all-reduce), which it
cannot trace: each is a graph break. Inside a custom op that code runs eagerly, as in eager mode,
on plain tensors (so the public ops call their backend directly). One path for eager and
compile. When the public ops become differentiable and traceable themselves, these can go.

Ops (namespace fluxtp_nn; x rows are [tokens, features] row-major, W the group size):
    colwise_gather(x_shard [m, K], w [n, K], b, group, backend, save_memory)
        -> (y [m*W, n], x_gathered [m*W, K] or [0] with save_memory)     all_gather_matmul
    colwise_gather_backward: G_x = matmul_reduce_scatter(G_y, w^T), G_w = G_y^T @ x_gathered (re-gathered
        after the fused op with save_memory), G_b = sum of G_y's rows
    colwise_replicated(x [M, K], w [n, K], b, ...) -> y [M, n]                  local linear
    colwise_replicated_backward: G_x = matmul_all_reduce(G_y, w^T), local G_w, G_b
    rowwise_scatter(x [M, k], w [N, k], b, ...) -> out [M/W, N]                 matmul_reduce_scatter
    rowwise_scatter_backward: (G_x, gathered G_out) = all_gather_matmul(G_out, w^T), G_w = gathered^T @ x,
        G_b = all_reduce(sum of G_out's rows) (issued after the fused op: nothing beside a fused op)
    rowwise_reduce(x [M, k], w [N, k], b, ...) -> out [M, N]                    matmul_all_reduce
        backward: local GEMMs only (G_out is the same on every rank), traced as plain aten ops

Gradients a backward is not asked for come back from the op as empty tensors (an op's outputs
must be tensors) and are turned into None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp._dist import group_from_name
from fluxtp.nn._collectives import all_reduce_sum, gather_rows
from fluxtp.nn.linear import GEMMS
from fluxtp.ops import matmul_all_reduce, matmul_reduce_scatter


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _none_if_empty(t: torch.Tensor | None, needed: bool):
    return t if needed else None


# --- column-parallel, sequence-parallel input: all-gather fused with the GEMM ------------------


@torch.library.custom_op("fluxtp_nn::colwise_gather", mutates_args=())
def colwise_gather(
    x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str, save_memory: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y, gathered = GEMMS[False].gather_linear(x_shard, weight, bias, group_from_name(group_name), backend, keep=not save_memory)
    return y, _empty(x_shard) if gathered is None else gathered


@colwise_gather.register_fake
def _(x_shard, weight, bias, group_name, backend, save_memory):
    rows = x_shard.shape[0] * group_from_name(group_name).world_size
    gathered = _empty(x_shard) if save_memory else x_shard.new_empty(rows, x_shard.shape[1])
    return x_shard.new_empty(rows, weight.shape[0]), gathered


@torch.library.custom_op("fluxtp_nn::colwise_gather_backward", mutates_args=())
def colwise_gather_backward(
    grad_y: torch.Tensor,
    saved_x: torch.Tensor,
    weight: torch.Tensor,
    group_name: str,
    backend: str,
    save_memory: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    info = group_from_name(group_name)
    grad_y = grad_y.contiguous()
    grad_x = grad_w = grad_b = _empty(grad_y)
    if need_x:
        grad_x = matmul_reduce_scatter(grad_y, weight.t(), group=info.group, backend=backend)
    if need_w:
        # Re-gathered after the fused op, never beside it (fluxtp.nn.linear's docstring).
        x_gathered = gather_rows(saved_x, info, backend) if save_memory else saved_x
        grad_w = grad_y.t() @ x_gathered
    if need_b:
        grad_b = grad_y.sum(0)
    return grad_x, grad_w, grad_b


@colwise_gather_backward.register_fake
def _(grad_y, saved_x, weight, group_name, backend, save_memory, need_x, need_w, need_b):
    world = group_from_name(group_name).world_size
    rows, n = grad_y.shape
    k = weight.shape[1]
    return (
        grad_y.new_empty(rows // world, k) if need_x else _empty(grad_y),
        grad_y.new_empty(n, k) if need_w else _empty(grad_y),
        grad_y.new_empty(n) if need_b else _empty(grad_y),
    )


def _colwise_gather_setup(ctx, inputs, output):
    x_shard, weight, bias, group_name, backend, save_memory = inputs
    _, x_gathered = output
    ctx.save_for_backward(x_shard if save_memory else x_gathered, weight)
    ctx.args = (group_name, backend, save_memory)


def _colwise_gather_grad(ctx, grad_y, _grad_gathered):
    saved_x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = colwise_gather_backward(grad_y, saved_x, weight, *ctx.args, need_x, need_w, need_b)
    return (_none_if_empty(grad_x, need_x), _none_if_empty(grad_w, need_w), _none_if_empty(grad_b, need_b), None, None, None)


colwise_gather.register_autograd(_colwise_gather_grad, setup_context=_colwise_gather_setup)


# --- column-parallel, replicated input: local GEMM, the input gradient all-reduced -------------


@torch.library.custom_op("fluxtp_nn::colwise_replicated", mutates_args=())
def colwise_replicated(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@colwise_replicated.register_fake
def _(x, weight, bias, group_name, backend):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("fluxtp_nn::colwise_replicated_backward", mutates_args=())
def colwise_replicated_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_name: str, backend: str, need_x: bool
) -> torch.Tensor:
    if not need_x:
        return _empty(grad_y)
    info = group_from_name(group_name)
    return matmul_all_reduce(grad_y.contiguous(), weight.t(), group=info.group, backend=backend)


@colwise_replicated_backward.register_fake
def _(grad_y, x, weight, group_name, backend, need_x):
    return grad_y.new_empty(grad_y.shape[0], weight.shape[1]) if need_x else _empty(grad_y)


def _colwise_replicated_setup(ctx, inputs, output):
    x, weight, bias, group_name, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (group_name, backend)


def _colwise_replicated_grad(ctx, grad_y):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = colwise_replicated_backward(grad_y, x, weight, *ctx.args, need_x)
    grad_w = grad_y.t() @ x if need_w else None
    grad_b = grad_y.sum(0) if need_b else None
    return _none_if_empty(grad_x, need_x), grad_w, grad_b, None, None


colwise_replicated.register_autograd(_colwise_replicated_grad, setup_context=_colwise_replicated_setup)


# --- row-parallel, sequence-parallel output: GEMM fused with the reduce-scatter ----------------


@torch.library.custom_op("fluxtp_nn::rowwise_scatter", mutates_args=())
def rowwise_scatter(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    info = group_from_name(group_name)
    return matmul_reduce_scatter(x, weight, group=info.group, bias=bias, backend=backend)


@rowwise_scatter.register_fake
def _(x, weight, bias, group_name, backend):
    return x.new_empty(x.shape[0] // group_from_name(group_name).world_size, weight.shape[0])


@torch.library.custom_op("fluxtp_nn::rowwise_scatter_backward", mutates_args=())
def rowwise_scatter_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group_name: str,
    backend: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    info = group_from_name(group_name)
    grad_out = grad_out.contiguous()
    grad_x = grad_w = grad_b = _empty(grad_out)
    gathered = None
    if need_x:  # the gathered rows only for the weight gradient
        grad_x, gathered = GEMMS[False].gather_linear(grad_out, weight.t(), None, info, backend, grad=True, keep=need_w)
    elif need_w:
        gathered = gather_rows(grad_out, info, backend)
    if need_w:
        grad_w = gathered.t() @ x
    if need_b:
        # The bias was added to this rank's rows only: the rows' sums of every rank. Issued
        # after the fused op (nothing beside a fused op).
        grad_b = grad_out.sum(0)
        all_reduce_sum(grad_b, info, backend)
    return grad_x, grad_w, grad_b


@rowwise_scatter_backward.register_fake
def _(grad_out, x, weight, group_name, backend, need_x, need_w, need_b):
    n, k = weight.shape
    return (
        x.new_empty(x.shape) if need_x else _empty(grad_out),
        grad_out.new_empty(n, k) if need_w else _empty(grad_out),
        grad_out.new_empty(n) if need_b else _empty(grad_out),
    )


def _rowwise_scatter_setup(ctx, inputs, output):
    x, weight, bias, group_name, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (group_name, backend)


def _rowwise_scatter_grad(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = rowwise_scatter_backward(grad_out, x, weight, *ctx.args, need_x, need_w, need_b)
    return _none_if_empty(grad_x, need_x), _none_if_empty(grad_w, need_w), _none_if_empty(grad_b, need_b), None, None


rowwise_scatter.register_autograd(_rowwise_scatter_grad, setup_context=_rowwise_scatter_setup)


# --- row-parallel, replicated output: GEMM fused with the all-reduce ---------------------------


@torch.library.custom_op("fluxtp_nn::rowwise_reduce", mutates_args=())
def rowwise_reduce(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    info = group_from_name(group_name)
    return matmul_all_reduce(x, weight, group=info.group, bias=bias, backend=backend)


@rowwise_reduce.register_fake
def _(x, weight, bias, group_name, backend):
    return x.new_empty(x.shape[0], weight.shape[0])


def _rowwise_reduce_setup(ctx, inputs, output):
    x, weight, bias, group_name, backend = inputs
    ctx.save_for_backward(x, weight)


def _rowwise_reduce_grad(ctx, grad_out):
    # The output is replicated, so its gradient is the same on every rank: no communication.
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = grad_out @ weight if need_x else None
    grad_w = grad_out.t() @ x if need_w else None
    grad_b = grad_out.sum(0) if need_b else None
    return grad_x, grad_w, grad_b, None, None


rowwise_reduce.register_autograd(_rowwise_reduce_grad, setup_context=_rowwise_reduce_setup)
