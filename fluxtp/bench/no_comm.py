"""The "no_comm" backend (registered by fluxtp.bench): every op and plain collective with its
transfers between ranks removed and its local work kept at its shapes. The step scenarios
(train, serve) time it as the step with communication perfectly hidden, the ceiling of any
overlap. Its results are wrong wherever they would depend on another rank's data.

- all_gather_matmul: the gathered input [W*m, K] is this rank's rows repeated W times (a local
  copy the size of the gather's output), then the same GEMM;
- matmul_reduce_scatter: the same full GEMM, then this rank's W row blocks of its own partial
  product summed locally (the reduce's local reading and writing, without any peer's data);
- matmul_all_reduce: the GEMM alone (no sum over ranks);
- the scaled (FP8) ops as their unscaled ones, the FP8 rows (and row-wise scales) repeated, the
  GEMM fluxtp.fp8.scaled_linear as the reference's;
- gather_rows: the local repeat; all_reduce_sum: nothing (the partial sum stays as it is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import fp8
from fluxtp._dist import GroupInfo


def unsupported_reason(op: str, x, weight, info: GroupInfo, **details) -> str | None:
    return None  # runs wherever torch does; fluxtp.backends reports the ops it lacks


def gather_rows(x_shard: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    return x_shard.contiguous().repeat(info.world_size, *([1] * (x_shard.dim() - 1)))


def all_reduce_sum(t: torch.Tensor, info: GroupInfo, async_op: bool = False):
    return None


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    x_gathered = gather_rows(x_shard, info)
    y = F.linear(x_gathered, weight, bias)
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    world = info.world_size
    partial = F.linear(x, weight)
    out = partial.view(world, partial.shape[0] // world, partial.shape[1]).sum(0)
    return out if bias is None else out + bias


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    return F.linear(x, weight, bias)


def all_gather_scaled_matmul(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum,
                             return_gathered: bool):  # fmt: skip
    x_gathered = gather_rows(x_shard, info)
    scales = scale_x
    if fp8.is_row_wise(scale_x, scale_w):  # the reference's gathered row scales [W*m, 1]
        scales = gather_rows(scale_x.reshape(-1, 1).expand(x_shard.shape[0], 1), info)
    y = fp8.scaled_linear(x_gathered, weight, scales, scale_w, bias, out_dtype, use_fast_accum)
    return y, (x_gathered, scales) if return_gathered else None


def scaled_matmul_reduce_scatter(x, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum):
    world = info.world_size
    partial = fp8.scaled_linear(x, weight, scale_x, scale_w, None, out_dtype, use_fast_accum)
    out = partial.view(world, partial.shape[0] // world, partial.shape[1]).sum(0)
    return fp8.plus_bias(out, bias, out_dtype)
