"""Row-wise FP8 quantization in one kernel: fluxtp.fp8.quantize_rows's amax, power-of-two scale,
scaling and cast, which eager PyTorch runs as about ten passes over float32 copies.

Each program takes BLOCK_R rows of a 2-D view (any strides: a transposed view quantizes along
the other dim) and reads them twice, once for each row's largest magnitude and once to scale,
clamp and cast them into the row-major output. A source in FP8 with scales (the layers' gathered
rows) is dequantized on the fly, value = source * its scale, the scale indexed by
(row * scale_stride_r + col * scale_stride_c).
"""

import triton
import triton.language as tl


@triton.jit
def quantize_rows_kernel(
    src_ptr,  # [rows, cols] view, strides (stride_r, stride_c); bf16 / fp16 / fp32, or FP8 with src_scale_ptr
    src_scale_ptr,  # float32 scales of the source's values (HAS_SRC_SCALE), else any pointer
    out_ptr,  # FP8 [rows, cols], row-major
    scale_ptr,  # float32 [rows]: each output row's scale
    rows,
    cols,
    stride_r,
    stride_c,
    scale_stride_r,
    scale_stride_c,
    fp8_max,  # the output format's largest finite value
    min_amax,  # an all-zero row's stand-in magnitude (its scale stays finite)
    HAS_SRC_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = r < rows
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        v = _values(src_ptr, src_scale_ptr, r, c0 + tl.arange(0, BLOCK_C), in_rows, cols, stride_r, stride_c,
                    scale_stride_r, scale_stride_c, HAS_SRC_SCALE)  # fmt: skip
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    # The smallest power of two with amax / scale <= fp8_max: amax / fp8_max rounded as torch divides,
    # kept where it is a power of two (no mantissa bits), else its exponent plus one.
    ratio = tl.math.div_rn(tl.maximum(amax, min_amax), fp8_max)
    bits = ratio.to(tl.int32, bitcast=True)
    scale_bits = tl.where((bits & 0x7FFFFF) == 0, bits, ((bits >> 23) + 1) << 23)
    scale = scale_bits.to(tl.float32, bitcast=True)
    inverse = ((254 << 23) - scale_bits).to(tl.float32, bitcast=True)  # 1 / scale, exact for a power of two
    tl.store(scale_ptr + r, scale, mask=in_rows)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        v = _values(src_ptr, src_scale_ptr, r, c, in_rows, cols, stride_r, stride_c, scale_stride_r, scale_stride_c,
                    HAS_SRC_SCALE)  # fmt: skip
        q = tl.clamp(v * inverse[:, None], -fp8_max, fp8_max).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * cols + c[None, :], q, mask=in_rows[:, None] & (c < cols)[None, :])


@triton.jit
def _values(src_ptr, src_scale_ptr, r, c, in_rows, cols, stride_r, stride_c, scale_stride_r, scale_stride_c,
            HAS_SRC_SCALE: tl.constexpr):  # fmt: skip
    """The source's values at rows r, columns c in float32 (0 outside the view)."""
    mask = in_rows[:, None] & (c < cols)[None, :]
    v = tl.load(src_ptr + r[:, None] * stride_r + c[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    if HAS_SRC_SCALE:
        v = v * tl.load(src_scale_ptr + r[:, None] * scale_stride_r + c[None, :] * scale_stride_c, mask=mask, other=0.0)
    return v
