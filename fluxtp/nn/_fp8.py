"""The FP8 layers' GEMMs: dynamic row-wise e4m3 scaling in the manner of torchao's rowwise recipe.

Every GEMM quantizes its two operands from the current high-precision tensors along its own
reduction dim (one power-of-two scale per row of each operand, fluxtp.fp8.quantize_rows) and
runs a scaled op; parameters, activations and every gradient stay in their own dtype:

    forward       y  = x @ W^T          x rows (per token), W rows (per output feature)
    input grad    gx = G @ W            G rows (per token), W^T rows (per input feature)
    weight grad   gW = G^T @ x          G^T rows and x^T rows (per feature, along the tokens)

As in torchao's rowwise recipe, the forward lets the tensor cores accumulate fast
(use_fast_accum) and the two gradient GEMMs accumulate in float32. The all-gather moves FP8
rows (half a bf16 gather's bytes) with their scales; the column layer's weight gradient reads
those gathered FP8 rows, dequantized (exactly: the scales are powers of two) and quantized
again along the tokens, so no high-precision copy of the gathered input is kept; with save_memory
the local FP8 rows and scales are kept and re-gathered (half a bf16 re-gather's bytes).

Under tensor parallelism a rank quantizes what it holds: in the column layer's input gradient
each rank's G has only its own output features, so its per-token scales are its own (the
reduce-scatter sums the scaled partials); everything else has whole rows on each rank.
"""

from __future__ import annotations

import torch

from fluxtp import fp8
from fluxtp._dist import GroupInfo
from fluxtp.nn._collectives import gather_rows
from fluxtp.ops import all_gather_scaled_matmul, scaled_matmul_reduce_scatter


def check_fp8_dtype(layer: str, dtype: torch.dtype) -> None:
    """The scaled ops write bfloat16, float16 or float32: the FP8 layers' parameter dtypes."""
    if dtype not in fp8.OUT_DTYPES:
        names = ", ".join(str(d) for d in fp8.OUT_DTYPES)
        raise TypeError(f"{layer}(fp8=True) needs parameters of {names}, got {dtype}")


def _rows(t: torch.Tensor):
    """(t_fp8, scale [rows, 1]): e4m3, one scale per row."""
    return fp8.quantize_rows(t, torch.float8_e4m3fn)


class Fp8Gemms:
    """fluxtp.nn.linear._Gemms in FP8 (the same methods, the module docstring's recipe); `rows`
    and `gathered` are (FP8 rows [T, K], their scales [T, 1])."""

    @staticmethod
    def rows(x):
        """x quantized as gather_linear quantizes it (deterministic: the same bytes)."""
        return _rows(x)

    @staticmethod
    def regather(rows, info: GroupInfo, backend: str):
        """The FP8 rows as bytes and their scales: the bytes the fused all-gather moved."""
        x_q, scales = rows
        return gather_rows(x_q.view(torch.uint8), info, backend).view(x_q.dtype), gather_rows(scales, info, backend)

    @staticmethod
    def gather_linear(x_shard, weight, bias, info: GroupInfo, backend: str, grad: bool = False, keep: bool = True,
                      rows=None):  # fmt: skip
        x_q, scale_x = _rows(x_shard) if rows is None else rows
        w_q, scale_w = _rows(weight)
        out = all_gather_scaled_matmul(
            x_q, w_q, scale_x, scale_w.view(1, -1), group=info.group, bias=bias, out_dtype=x_shard.dtype,
            use_fast_accum=not grad, backend=backend, return_gathered=keep,
        )  # fmt: skip
        if not keep:
            return out, None
        y, x_gathered, scales = out
        return y, (x_gathered, scales)

    @staticmethod
    def linear(gathered, weight, bias):
        x_gathered, scales = gathered
        w_q, scale_w = _rows(weight)
        return fp8.scaled_linear(x_gathered, w_q, scales, scale_w.view(1, -1), bias, weight.dtype, use_fast_accum=True)

    @staticmethod
    def linear_reduce_scatter(x, weight, bias, info: GroupInfo, backend: str, grad: bool = False):
        x_q, scale_x = _rows(x)
        w_q, scale_w = _rows(weight)  # the backward's W^T view: quantized into row-major rows
        return scaled_matmul_reduce_scatter(
            x_q, w_q, scale_x, scale_w.view(1, -1), group=info.group, bias=bias, out_dtype=x.dtype,
            use_fast_accum=not grad, backend=backend,
        )  # fmt: skip

    @staticmethod
    def weight_grad(grad_rows, input_rows, dtype):
        """grad_rows^T @ input_rows [n, K], both quantized along the tokens (their columns)."""
        g_q, scale_g = fp8.quantize_columns(grad_rows)
        x_q, scale_x = fp8.quantize_columns(input_rows)
        return fp8.scaled_linear(g_q, x_q, scale_g, scale_x.view(1, -1), None, dtype)

    @staticmethod
    def pack(gathered) -> tuple:
        return tuple(gathered)

    @staticmethod
    def unpack(tensors):
        return tuple(tensors)
