"""Autograd formulas of the four custom ops, registered on their torch.library ops, so a user can
train through the functional ops directly (and torch.compile traces the backward too).

Convention, as in Megatron-LM and PyTorch's DTensor parallel styles: a sharded output (the
all-gather GEMM's columns, the reduce-scatter's rows) feeds each rank's own part of the loss, and
the ranks' parts add up; a replicated output (matmul_all_reduce, all_reduce: the same sum on
every rank) feeds the one loss that every rank computes alike, so its gradient is already the
whole loss's on every rank and the sum's backward is the identity. With G the output gradient:

    all_gather_matmul      y_r = x @ w_r^T + b_r, x = [x_0; ..; x_{W-1}]
        grad x_r = rows r of sum_s G_s @ w_s        = matmul_reduce_scatter(G, w^T)
                   (+ reduce_scatter of the gathered input's own gradient, if it has one)
        grad w_r = G_r^T @ x (the gathered input, saved by the forward), grad b_r = sum of G_r's rows
    matmul_reduce_scatter  out_r = rows r of sum_s x_s @ w_s^T, + b_r
        grad x_r = [G_0; ..; G_{W-1}] @ w_r         = all_gather_matmul(G, w^T), gathered G kept
        grad w_r = [G_0; ..]^T @ x_r, grad b_r = sum of G_r's rows
    matmul_all_reduce      out = sum_s x_s @ w_s^T + b   (replicated)
        grad x_r = G @ w_r, grad w_r = G^T @ x_r, grad b = sum of G's rows (no communication)
    all_reduce             out = sum_s x_s              (replicated)
        grad x_r = G

Where each rank computes a loss of its own from a replicated output, all-reduce the output's
gradient first (or use the sequence-parallel ops, whose outputs are sharded). The backward calls
the public ops with the forward's backend, so it is planned and fused where the forward was.
"""

from __future__ import annotations

from torch.distributed import _functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group

from fluxtp.ops.all_gather_matmul import _all_gather_matmul_op, all_gather_matmul
from fluxtp.ops.all_reduce import _all_reduce_op
from fluxtp.ops.matmul_all_reduce import _matmul_all_reduce_op
from fluxtp.ops.matmul_reduce_scatter import _matmul_reduce_scatter_op, matmul_reduce_scatter


def _bias_grad(ctx, grad_out):
    return grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None


# ---------------------------------------------------------------- all_gather_matmul


def _ag_setup(ctx, inputs, output):
    x_shard, weight, bias, group_name, backend, return_gathered = inputs
    _, x_gathered = output
    if not return_gathered and ctx.needs_input_grad[1]:
        raise RuntimeError("fluxtp::all_gather_matmul needs return_gathered=True to compute the weight gradient")
    ctx.save_for_backward(weight, x_gathered)
    ctx.group_name, ctx.backend, ctx.has_bias = group_name, backend, bias is not None


def _ag_backward(ctx, grad_y, grad_gathered):
    weight, x_gathered = ctx.saved_tensors
    group = _resolve_process_group(ctx.group_name)
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul_reduce_scatter(grad_y.contiguous(), weight.t(), group=group, backend=ctx.backend)
        if grad_gathered is not None and grad_gathered.numel():  # the gathered copy was used downstream
            scattered = funcol.reduce_scatter_tensor(grad_gathered.contiguous(), "sum", 0, group)
            grad_x = grad_x + funcol.wait_tensor(scattered)
    if ctx.needs_input_grad[1]:
        grad_w = grad_y.t() @ x_gathered
    return grad_x, grad_w, _bias_grad(ctx, grad_y), None, None, None


# ---------------------------------------------------------------- matmul_reduce_scatter


def _rs_setup(ctx, inputs, output):
    x, weight, bias, group_name, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.group_name, ctx.backend, ctx.has_bias = group_name, backend, bias is not None


def _rs_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    group = _resolve_process_group(ctx.group_name)
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_out = grad_out.contiguous()
    grad_x = grad_w = None
    if need_x or need_w:
        # One fused all-gather serves both: the input gradient's GEMM and the weight gradient.
        grad_x, grad_gathered = all_gather_matmul(
            grad_out, weight.t(), group=group, backend=ctx.backend, return_gathered=True
        )
        if need_w:
            grad_w = grad_gathered.t() @ x
    return grad_x if need_x else None, grad_w, _bias_grad(ctx, grad_out), None, None


# ---------------------------------------------------------------- matmul_all_reduce


def _ar_gemm_setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _ar_gemm_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_x = grad_out @ weight if need_x else None
    grad_w = grad_out.t() @ x if need_w else None
    return grad_x, grad_w, _bias_grad(ctx, grad_out), None, None


# ---------------------------------------------------------------- all_reduce


def _sum_setup(ctx, inputs, output):
    pass  # the backward is the identity: nothing to keep


def _sum_backward(ctx, grad_out):
    return grad_out, None, None


_all_gather_matmul_op.register_autograd(_ag_backward, setup_context=_ag_setup)
_matmul_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_rs_setup)
_matmul_all_reduce_op.register_autograd(_ar_gemm_backward, setup_context=_ar_gemm_setup)
_all_reduce_op.register_autograd(_sum_backward, setup_context=_sum_setup)
