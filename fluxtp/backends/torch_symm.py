"""The "torch" backend: PyTorch's own async-TP ops on symmetric memory (torch.ops.symm_mem).

fused_all_gather_matmul / fused_matmul_reduce_scatter split the matmul into per-rank chunks on
two streams with copy-engine transfers; for all-reduce, the matmul writes into a symmetric
buffer that the one-shot (small) or two-shot (large) symmetric-memory all-reduce then reduces.
CUDA only; no multicast is used.
"""

from __future__ import annotations

import torch

from fluxtp import symm
from fluxtp._dist import GroupInfo

# Above this many bytes the two-shot all-reduce (reduce-scatter + all-gather) moves less data.
ONE_SHOT_MAX_BYTES = 1 << 20


def unsupported_reason(op: str, x, weight, info: GroupInfo, **details) -> str | None:
    if x.device.type != "cuda":
        return f"it needs CUDA tensors (got {x.device}) and an NCCL group with symmetric memory"
    if op in ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter"):
        reason = _scaled_unsupported_reason(op, x, weight, **details)
        if reason is not None:
            return reason
    if op in ("matmul_all_reduce", "all_reduce") and x.dtype not in (torch.bfloat16, torch.float32):
        # torch 2.11's one_shot_all_reduce raised NotImplementedError for float16 on 2xH200.
        return f"torch's symmetric-memory all-reduce takes bfloat16 and float32, got {x.dtype}"
    return symm.unsupported_reason(info)


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    symm.enable_for_group(info)
    x_gathered, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
        x_shard.contiguous(), [weight.t()], 0, info.name, return_A=True
    )
    if bias is not None:
        y += bias
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    symm.enable_for_group(info)
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), weight.t(), "sum", 0, info.name)
    if bias is not None:
        out += bias
    return out


def _symm_all_reduce(info: GroupInfo, numel: int, dtype: torch.dtype, device, fill) -> torch.Tensor:
    """Sum over ranks of the `numel` values `fill(flat)` writes into a symmetric buffer (flat[:numel])."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    # The symmetric all-reduces want 16-byte sizes that split evenly over ranks: reduce a padded
    # flat buffer (its tail is ignored) and return the real values.
    quantum = info.world_size * 16 // itemsize
    padded = -(-numel // quantum) * quantum
    buf = symm.buffer(info, "torch_all_reduce", padded * itemsize, device)
    flat = buf.local(dtype, (padded,))
    fill(flat[:numel])
    if padded * itemsize <= ONE_SHOT_MAX_BYTES:
        reduced = torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", info.name)
    else:
        reduced = torch.empty_like(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(flat, "sum", info.name, reduced)
    return reduced[:numel]


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    symm.enable_for_group(info)
    rows, cols = x.shape[0], weight.shape[0]
    y = _symm_all_reduce(
        info, rows * cols, x.dtype, x.device, lambda flat: torch.mm(x, weight.t(), out=flat.view(rows, cols))
    ).view(rows, cols)
    if bias is not None:
        y += bias
    return y


def all_reduce(x, info: GroupInfo):
    symm.enable_for_group(info)
    return _symm_all_reduce(info, x.numel(), x.dtype, x.device, lambda flat: flat.copy_(x.view(-1))).view(x.shape)


# ---------------------------------------------------------------- the scaled (FP8) ops
#
# torch.ops.symm_mem.fused_all_gather_scaled_matmul / fused_scaled_matmul_reduce_scatter: chunked
# copy-engine transfers and one torch._scaled_mm per chunk. Each chunk's output is in the op's
# out_dtype (the reduce-scatter's partials too, as fluxtp's contract has them), and torch's
# row-wise scaled kernel writes only bfloat16: so row-wise scales run only into bfloat16.
_SCALED_OP_ARGS = {
    "all_gather_scaled_matmul": ("fused_all_gather_scaled_matmul", ("A", "Bs", "A_scale", "B_scales", "gather_dim",
                                 "group_name", "biases", "result_scales", "out_dtypes", "use_fast_accum")),
    "scaled_matmul_reduce_scatter": ("fused_scaled_matmul_reduce_scatter", ("A", "B", "A_scale", "B_scale", "reduce_op",
                                     "orig_scatter_dim", "scatter_dim_after_maybe_reshape", "group_name",
                                     "output_shape", "bias", "result_scale", "out_dtype", "use_fast_accum")),
}  # fmt: skip


def _scaled_unsupported_reason(op, x, weight, row_wise: bool, out_dtype, use_fast_accum: bool, **_) -> str | None:
    name, args = _SCALED_OP_ARGS[op]
    import torch.distributed._symmetric_memory  # noqa: F401 -- defines the symm_mem ops: unloaded, none is found

    torch_op = getattr(torch.ops.symm_mem, name, None)
    if torch_op is None:
        return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{name}"
    schema = tuple(a.name for a in torch_op.default._schema.arguments)
    if schema != args:
        return f"this torch's torch.ops.symm_mem.{name} takes ({', '.join(schema)}), not the ({', '.join(args)}) fluxtp calls"
    if x.shape[1] % 16 or weight.shape[0] % 16:
        return f"torch._scaled_mm needs K and n multiples of 16, got K={x.shape[1]}, n={weight.shape[0]}"
    if row_wise and out_dtype != torch.bfloat16:
        return f"torch's row-wise scaled matmul writes only bfloat16, out_dtype is {out_dtype}"
    return None


def all_gather_scaled_matmul(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum,
                             return_gathered: bool):  # fmt: skip
    from fluxtp import fp8

    symm.enable_for_group(info)
    row_wise = fp8.is_row_wise(scale_x, scale_w)
    # Row-wise [m, 1] of this rank's rows: torch gathers them with the rows (its "row-wise sharded" mode).
    sx, sw = fp8.scaled_mm_scales(x_shard, weight, scale_x, scale_w)
    # Per tensor: a float32 product, then the bias, rounded once. Row-wise (bfloat16 only): a
    # bfloat16 bias goes into torch's epilogue; another is added to the rounded product.
    in_epilogue = row_wise and bias is not None and bias.dtype == torch.bfloat16
    x_gathered, (y,) = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        x_shard.contiguous(), [weight.t()], sx, [sw], 0, info.name, [bias if in_epilogue else None], [None],
        [torch.bfloat16 if row_wise else torch.float32], [use_fast_accum],
    )  # fmt: skip
    y = fp8.plus_bias(y, None if in_epilogue else bias, out_dtype)
    if not return_gathered:
        return y, None
    # torch gathers the rows but returns no gathered scales: gather those (small) beside.
    return y, (x_gathered, _gather_row_scales(sx, info) if row_wise else scale_x.clone())


def _gather_row_scales(scale_rows, info: GroupInfo):
    import torch.distributed as dist

    out = scale_rows.new_empty(scale_rows.shape[0] * info.world_size, 1)
    dist.all_gather_into_tensor(out, scale_rows, group=info.group)
    return out


def scaled_matmul_reduce_scatter(x, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum):
    from fluxtp import fp8

    symm.enable_for_group(info)
    m_total, n = x.shape[0], weight.shape[0]
    sx, sw = fp8.scaled_mm_scales(x, weight, scale_x, scale_w)  # row-wise [M, 1]: torch splits them with x's rows
    # torch would add a bias to every rank's partial: it is added once, after the sum.
    out = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        x.contiguous(), weight.t(), sx, sw, "sum", 0, 0, info.name, [m_total, n], None, None, out_dtype, use_fast_accum,
    )  # fmt: skip
    return fp8.plus_bias(out, bias, out_dtype)
