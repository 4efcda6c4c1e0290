"""FP8 formats and scales as torch._scaled_mm defines them, and the dynamic row-wise quantization
of fluxtp's FP8 layers (the manner of torchao's rowwise recipe).

A scale is the dequantization multiplier: x ~= x_fp8.float() * scale, and a scaled matmul is
(x_fp8 * scale_x) @ (w_fp8 * scale_w)^T. Per tensor: one float32 scale (0-d, [1] or [1, 1]); row
wise: scale_x [rows, 1] (one per row of x) and scale_w [1, n] (one per output row of the weight,
torch._scaled_mm's [1, N] of its B operand), both float32.

quantize_rows picks each row's scale as the power of two just above amax / FP8_MAX (torchao's
rowwise recipe rounds its scales to powers of two too): the scaled values then fit the format,
and dequantizing (x_fp8 * scale) is exact, so a tensor quantized again along other rows loses
nothing to the first scale.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# The formats fluxtp's scaled ops take: e4m3 (activations and weights) and e5m2 (wider range),
# never both operands e5m2 (torch._scaled_mm refuses that pair too).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) on.
MIN_CAPABILITY = (8, 9)
# A row of zeros still gets a finite scale (its values quantize to 0 either way).
_MIN_AMAX = 2.0**-100


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_rows(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_fp8 [rows, cols], scale float32 [rows, 1]) with t ~= t_fp8 * scale, one scale per row.

    scale = 2^ceil(log2(amax_row / fp8_max)): the smallest power of two with |t| / scale <=
    fp8_max, so nothing saturates; values are rounded to nearest by the cast. On CUDA one
    kernel computes it (fluxtp.kernels._quantize), bit for bit as the eager reference here."""
    if t.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor, got shape {tuple(t.shape)}")
    if _kernel_quantizes(t, dtype):
        return _quantize_by_kernel(t.detach(), None, dtype)
    return _quantize_rows_eager(t, dtype)


def quantize_columns(rows, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of the transpose of `rows`: a tensor [T, K], or (FP8 [T, K], their scales)
    dequantized exactly on the way (power-of-two scales): (FP8 [K, T], scale [K, 1]), each of
    the K columns scaled along the T rows (the layers' weight gradient, quantized along tokens)."""
    source, scale = rows if isinstance(rows, tuple) else (rows, None)
    if source.dim() != 2:
        raise ValueError(f"quantize_columns takes a 2-D tensor, got shape {tuple(source.shape)}")
    if _kernel_quantizes(source, dtype, scaled=scale is not None):
        source_scale = None
        if scale is not None:
            expanded = scale.float().expand(source.shape)
            source_scale = (expanded, expanded.stride(1), expanded.stride(0))  # strides along the transpose
        return _quantize_by_kernel(source.detach().t(), source_scale, dtype)
    values = source.float() if scale is None else dequantize(source, scale)
    return _quantize_rows_eager(values.t(), dtype)


def _quantize_rows_eager(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    amax = t.detach().abs().amax(dim=1, keepdim=True).float().clamp_min(_MIN_AMAX)
    # frexp: amax / max = mantissa * 2^exp with mantissa in [0.5, 1); the power of two at or above
    # it is 2^(exp - 1) when the mantissa is exactly 0.5, else 2^exp (exact, unlike log2).
    mantissa, exponent = torch.frexp(amax / fp8_max(dtype))
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    limit = fp8_max(dtype)
    t_fp8 = (t.float() / scale).clamp(-limit, limit).to(dtype).contiguous()  # row-major, views included
    return t_fp8, scale


# The kernel's sources: what it loads and converts to float32 (FP8 only with scales).
_KERNEL_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
_KERNEL_TARGETS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _kernel_quantizes(t: torch.Tensor, dtype: torch.dtype, scaled: bool = False) -> bool:
    """Whether quantize_rows's kernel runs for t: on CUDA, a source it reads, triton importable."""
    sources = FP8_DTYPES if scaled else _KERNEL_SOURCES
    runs = t.device.type == "cuda" and t.dtype in sources and dtype in _KERNEL_TARGETS and t.numel() > 0
    return runs and _offsets_fit_32_bits(t) and _triton_installed()


def _offsets_fit_32_bits(t: torch.Tensor) -> bool:
    """The kernel's offsets are 32-bit: every element of t it reads, and of the output it writes,
    lies within 2^31 elements of the first."""
    last_read = (t.shape[0] - 1) * abs(t.stride(0)) + (t.shape[1] - 1) * abs(t.stride(1))
    return max(last_read, t.numel() - 1) < 2**31


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _quantize_by_kernel(view: torch.Tensor, source_scale, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of the 2-D `view` (any strides) by one kernel launch; source_scale: (float32
    scales, their stride along the view's rows, along its columns) of an FP8 view, or None."""
    import triton

    from fluxtp.kernels import COMPILE_OPTIONS
    from fluxtp.kernels._quantize import quantize_rows_kernel

    rows, cols = view.shape
    out = torch.empty(rows, cols, dtype=dtype, device=view.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=view.device)
    scales, scale_stride_r, scale_stride_c = source_scale if source_scale is not None else (view, 0, 0)
    # Coalesced loads: wide blocks along a contiguous row, tall ones down a transposed view's columns.
    block_r, block_c = (4, 512) if view.stride(1) == 1 else (32, 64)
    quantize_rows_kernel[(triton.cdiv(rows, block_r),)](
        view, scales, out, scale, rows, cols, view.stride(0), view.stride(1), scale_stride_r, scale_stride_c,
        fp8_max(dtype), _MIN_AMAX, HAS_SRC_SCALE=source_scale is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out, scale


def dequantize(t_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t_fp8 * scale in float32 (exact for power-of-two scales)."""
    return t_fp8.float() * scale


def is_row_wise(scale_x: torch.Tensor, scale_w: torch.Tensor) -> bool:
    """Row-wise scaling unless both scales are single values (then: per tensor)."""
    return scale_x.numel() != 1 or scale_w.numel() != 1


# ---------------------------------------------------------------- the local scaled GEMM
# What the reference backend computes after its collective, and the layers' local FP8 GEMMs.


def _scaled_mm_runs(x, weight) -> bool:
    """Whether torch._scaled_mm takes these operands: CUDA, K and n multiples of 16, 16-byte
    aligned row-major rows (its B is weight^T, column-major), not both e5m2 (validated)."""
    return (
        x.device.type == "cuda"
        and x.shape[1] % 16 == 0
        and weight.shape[0] % 16 == 0
        and all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, weight))
    )


def scaled_mm_scales(x, weight, scale_x, scale_w):
    """The scales as torch._scaled_mm takes them: both one value, or [rows, 1] and [1, n]."""
    if not is_row_wise(scale_x, scale_w):
        return scale_x.reshape(()), scale_w.reshape(())
    rows, n = x.shape[0], weight.shape[0]
    return scale_x.reshape(-1, 1).expand(rows, 1).contiguous(), scale_w.reshape(1, -1).expand(1, n).contiguous()


def scaled_product(x, weight, scale_x, scale_w, use_fast_accum: bool = False) -> torch.Tensor:
    """float32 [rows, n]: (x @ weight^T) * scale_x * scale_w, no bias, no rounding to out_dtype.

    On CUDA where torch._scaled_mm runs: its float32 output (per tensor scales applied by it;
    row-wise, its row-wise kernel writes only bfloat16, so it runs unscaled and the scales follow
    in float32). Elsewhere (CPU, unaligned shapes) the exact dequantized product: FP8 values are
    exact in float32 and so are their products (8 significant bits); the sum is float32."""
    sx, sw = scaled_mm_scales(x, weight, scale_x, scale_w)
    if _scaled_mm_runs(x, weight):
        if sx.dim() == 0:
            return torch._scaled_mm(x, weight.t(), sx, sw, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        product = torch._scaled_mm(x, weight.t(), one, one, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
    else:
        product = x.float() @ weight.float().t()
    return product * sx * sw


def plus_bias(y: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """y plus bias (if any) in float32, rounded once to out_dtype: how every backend adds a bias
    that is not in torch._scaled_mm's epilogue (the reduce-scatter's: once, after the sum)."""
    return (y if bias is None else y.float() + bias.float()).to(out_dtype)


def scaled_linear(x, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """[rows, n] in out_dtype: the scaled product plus bias, rounded once.

    torch._scaled_mm computes it in one call where it can (per tensor, or row-wise into
    bfloat16; the bias only where it is of out_dtype and not float32, as torch takes it)."""
    sx, sw = scaled_mm_scales(x, weight, scale_x, scale_w)
    fits_torch = sx.dim() == 0 or out_dtype == torch.bfloat16
    bias_fits = bias is None or (bias.dtype == out_dtype and out_dtype != torch.float32)
    if fits_torch and bias_fits and _scaled_mm_runs(x, weight):
        return torch._scaled_mm(x, weight.t(), sx, sw, bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return plus_bias(scaled_product(x, weight, scale_x, scale_w, use_fast_accum), bias, out_dtype)


