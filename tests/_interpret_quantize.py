"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py: fluxtp.fp8's quantization
kernel on CPU tensors, bit for bit against the eager reference (the same scales, the same FP8
bytes): row-major and transposed views, ragged sizes, rows of zeros and of wide range, bf16 /
fp16 / fp32 sources, FP8 sources dequantized by row or per-tensor scales, e4m3 and e5m2."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from fluxtp import fp8  # noqa: E402


def same(got, want, values, what):
    """Scales bit for bit; the FP8 values at the reference's or, where they differ, one step of
    the format from `values` (the exact scaled values): the interpreter's float32 -> FP8 cast
    rounds ties away from zero and loses the carry into the next power of two (127.2 -> 64 in
    e4m3, where torch and a GPU give 128), so only tests/gpu compares every byte."""
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.is_contiguous(), what
    assert s.shape == s_ref.shape and torch.equal(s, s_ref), f"{what}: scales differ"
    got_values, ref = q.float(), q_ref.float()
    mantissa_bits = 3 if q.dtype == torch.float8_e4m3fn else 2
    step = torch.ldexp(torch.ones_like(values), torch.frexp(values.abs())[1] - 1 - mantissa_bits)
    step = step.clamp_min(2.0 ** (-6 - mantissa_bits if mantissa_bits == 3 else -14 - mantissa_bits))  # subnormals
    near = (got_values - values).abs() <= step
    carried = (ref != 0) & (torch.frexp(ref.abs())[0] == 0.5) & (got_values == ref / 2)
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~near & ~carried
    assert not bad.any(), f"{what}: {bad.sum().item()} FP8 values off, e.g. {got_values[bad][:4]} for {values[bad][:4]}"


def main(seed):
    g = torch.Generator().manual_seed(seed)
    for rows, cols in ((1, 1), (7, 130), (64, 512), (33, 1000)):
        t = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-20, 21, (rows, 1), generator=g)
        t[0, :] = 0.0  # an all-zero row: the smallest scale, zeros out
        t[-1, -1] = 3.0e4  # one large value in the last row
        for src_dtype in (torch.bfloat16, torch.float16, torch.float32):
            src = t.to(src_dtype) if src_dtype != torch.float16 else t.clamp(-6e4, 6e4).to(src_dtype)
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                what = f"{rows}x{cols} {src_dtype} -> {dtype}"
                want = fp8._quantize_rows_eager(src, dtype)
                same(fp8._quantize_by_kernel(src, None, dtype), want, src.float() / want[1], what)
                want = fp8._quantize_rows_eager(src.t(), dtype)
                same(fp8._quantize_by_kernel(src.t(), None, dtype), want, src.t().float() / want[1],
                     what + " (transposed view)")  # fmt: skip
        # An FP8 source with its row scales (the layers' gathered rows), and per tensor.
        q, s = fp8._quantize_rows_eager(t, torch.float8_e4m3fn)
        for scale in (s, torch.tensor(0.25)):
            expanded = scale.expand(q.shape)
            got = fp8._quantize_by_kernel(q.t(), (expanded, expanded.stride(1), expanded.stride(0)), torch.float8_e4m3fn)
            values = fp8.dequantize(q, scale).t()
            want = fp8._quantize_rows_eager(values, torch.float8_e4m3fn)
            same(got, want, values / want[1], f"{rows}x{cols} FP8 rows with scales {tuple(scale.shape)}, transposed")
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
