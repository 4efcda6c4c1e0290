"""Shared FP8 test logic: the scaled ops against float64 on the dequantized inputs.

The inputs are quantized once (fluxtp.fp8.quantize_rows for row-wise scales; one scale of the
whole tensor, amax / fp8_max, not a power of two, per tensor), and the reference is the float64
product of exactly those FP8 values times their scales: quantization error is not what these
tests measure, only what the ops add to it. Fresh random data from a seed the parent draws.
"""

from __future__ import annotations

import torch

import fluxtp
from fluxtp.fp8 import fp8_max, quantize_rows

# Normwise relative error allowed against float64: the output rounded once to out_dtype (unit
# roundoff u: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32), plus float32 accumulation of K exact products
# and the float32 scaling and partial sums (a few hundred float32 roundings at most: < 1e-5).
UNIT_ROUNDOFF = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}
TOLERANCE = {dtype: u + 1e-5 for dtype, u in UNIT_ROUNDOFF.items()}
# Hopper's fast FP8 accumulation (use_fast_accum=True on GPUs) keeps fewer bits than float32
# between its products (DeepSeek-V3 report: about 14), so K terms lose up to ~K * 2^-14 relative
# in the worst case, ~sqrt(K) * 2^-14 typically: allowed as 2^-14 * sqrt(K) * 4 on top.
FAST_ACCUM_PER_SQRT_K = 4 * 2**-14
# Precise accumulation on Hopper (cuBLAS's FP8 GEMM without use_fast_accum) promotes into float32
# only every 128 products or so, at ~14 bits in between: up to 4 * 2^-14 * sqrt(128) on top
# (measured on one H200 at K = 1024, float32 out: 1.3e-4).
PROMOTED_ACCUM = 4 * 2**-14 * 128**0.5


def tolerance(out_dtype, k: int, fast: bool, hopper: bool = False) -> float:
    """The error allowed an FP8 GEMM of K terms (hopper: run by a GPU's FP8 tensor cores)."""
    if fast:
        return TOLERANCE[out_dtype] + FAST_ACCUM_PER_SQRT_K * k**0.5
    return TOLERANCE[out_dtype] + (PROMOTED_ACCUM if hopper else 0.0)


def on_gpu(device) -> bool:
    """Whether the op ran on a GPU's FP8 tensor cores (tolerance's hopper: their promoted
    accumulation), not the CPU's exact dequantized product."""
    return torch.device(device).type == "cuda"


def partial_rounding(out_dtype, partials, total, roundings: int = 1) -> float:
    """What the reduce-scatter adds: its partials are rounded to out_dtype before the sum (u of
    each partial's norm, over the output's norm), and NCCL's ring rounds its running sum at every hop
    too (roundings = W: each sum's norm is at most the partials' together; fluxtp's kernels and
    torch's sum the rounded partials in float32: roundings = 1)."""
    spread = sum(p.double().norm().item() for p in partials) / max(total.double().norm().item(), 1e-30)
    return UNIT_ROUNDOFF[out_dtype] * roundings * spread


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref = out.double().cpu(), ref.double().cpu()  # the GPU tests' references are CUDA tensors
    assert torch.isfinite(out64).all(), "output has NaN or Inf"
    return ((out64 - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def draw(seed: int, shape, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes: row-wise scales must not be mixed up between rows.
    magnitudes = 2.0 ** torch.randint(-4, 5, (shape[0], 1), generator=g).double()
    return torch.randn(shape, generator=g, dtype=torch.float64) * magnitudes * scale


def quantize(t: torch.Tensor, row_wise: bool, dtype=torch.float8_e4m3fn):
    """(t_fp8, scale [rows, 1]) row-wise, or (t_fp8, 0-d scale) per tensor."""
    if row_wise:
        return quantize_rows(t, dtype)
    scale = (t.abs().amax() / fp8_max(dtype)).float()
    return (t / scale.double()).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype), scale


def dequantized(t_fp8, scale) -> torch.Tensor:
    return t_fp8.double() * scale.double().cpu()


def weight_scale(scale_w: torch.Tensor, row_wise: bool) -> torch.Tensor:
    """quantize's [n, 1] row scales of a weight in torch._scaled_mm's [1, n] layout."""
    return scale_w.reshape(1, -1) if row_wise else scale_w


def check_all_gather_scaled(rank, world, seed, m, n_local, k, device, backend, row_wise, out_dtype, bias_dtype,
                            group=None, x_dtype=torch.float8_e4m3fn, w_dtype=torch.float8_e4m3fn, fast=False):  # fmt: skip
    """y against float64; the gathered FP8 bytes and the gathered scales exact."""
    x = draw(seed, (m * world, k))
    w = draw(seed + 1, (n_local * world, k), k**-0.5)
    if row_wise:
        xq, sx = quantize(x, True, x_dtype)  # one scale per row: each rank's rows keep theirs
    else:  # one scale of the whole x, the same on every rank
        xq, sx = quantize(x, False, x_dtype)
    rows, cols = slice(rank * m, (rank + 1) * m), slice(rank * n_local, (rank + 1) * n_local)
    wq, sw = quantize(w[cols], row_wise, w_dtype)
    sw = weight_scale(sw, row_wise)
    b = draw(seed + 2, (1, n_local))[0].to(bias_dtype) if bias_dtype is not None else None
    x_shard, sx_shard = xq[rows].to(device), (sx[rows] if row_wise else sx).to(device)
    args = (x_shard, wq.to(device), sx_shard, sw.to(device))
    bias = None if b is None else b.to(device)
    y, xg, sg = fluxtp.all_gather_scaled_matmul(
        *args, group=group, bias=bias, out_dtype=out_dtype, backend=backend, return_gathered=True, use_fast_accum=fast
    )
    what = f"all_gather_scaled_matmul {backend} W={world} m={m} n={n_local} k={k} row_wise={row_wise} {out_dtype} bias={bias_dtype}"
    assert y.shape == (m * world, n_local) and y.dtype == out_dtype and y.device == x_shard.device, what
    assert xg.dtype == x_dtype and torch.equal(xg.cpu().view(torch.uint8), xq.view(torch.uint8)), f"{what}: gathered rows not exact"
    assert sg.dtype == torch.float32 and torch.equal(sg.cpu(), sx), f"{what}: gathered scales not exact"
    assert sg.shape == ((m * world, 1) if row_wise else sx_shard.shape), f"{what}: gathered scales of shape {tuple(sg.shape)}"
    ref = dequantized(xq, sx) @ dequantized(wq, sw.reshape(-1, 1)).T + (b.double() if b is not None else 0)
    err = rel_error(y, ref)
    assert err <= tolerance(out_dtype, k, fast, on_gpu(device)), f"{what}: rel err {err:.2e}"
    again = dict(group=group, bias=bias, out_dtype=out_dtype, backend=backend, use_fast_accum=fast)
    y2, xg2, sg2 = fluxtp.all_gather_scaled_matmul(*args, **again, return_gathered=True)
    assert torch.equal(y2, y) and torch.equal(xg2.view(torch.uint8), xg.view(torch.uint8)) and torch.equal(sg2, sg), (
        f"{what}: a second call (the cached plan) gave other bits"
    )
    # Not keeping the rows is another plan, which "auto" may give another backend (its rounding).
    err = rel_error(fluxtp.all_gather_scaled_matmul(*args, **again), ref)
    assert err <= tolerance(out_dtype, k, fast, on_gpu(device)), f"{what}: without return_gathered, rel err {err:.2e}"


def check_scaled_reduce_scatter(rank, world, seed, m, n, k_local, device, backend, row_wise, out_dtype, bias_dtype,
                                group=None, x_dtype=torch.float8_e4m3fn, w_dtype=torch.float8_e4m3fn, fast=False):  # fmt: skip
    """Each rank quantizes its own slice of K (its own scales); the sum against float64."""
    k = k_local * world
    x = draw(seed, (m * world, k))
    w = draw(seed + 1, (n, k), k**-0.5)
    b = draw(seed + 2, (1, n))[0].to(bias_dtype) if bias_dtype is not None else None
    rows = slice(rank * m, (rank + 1) * m)
    partials = []
    for r in range(world):
        cols = slice(r * k_local, (r + 1) * k_local)
        xq, sx = quantize(x[:, cols], row_wise, x_dtype)
        wq, sw = quantize(w[:, cols], row_wise, w_dtype)
        sw = weight_scale(sw, row_wise)
        # This rank's rows of each partial only (a per-tensor scale is the whole slice's): W times
        # less float64 work than the whole product, which made the 4-GPU run take minutes.
        own_sx = sx[rows] if row_wise else sx
        partials.append(dequantized(xq[rows], own_sx) @ dequantized(wq, sw.reshape(-1, 1)).T)
        if r == rank:
            args = tuple(t.to(device) for t in (xq, wq, sx, sw))
    ref = sum(partials)
    if b is not None:
        ref += b.double()
    roundings = 1 if backend in ("fused", "torch") else world
    allowed = tolerance(out_dtype, k, fast, on_gpu(device)) + partial_rounding(out_dtype, partials, ref, roundings)
    bias = None if b is None else b.to(device)
    out = fluxtp.scaled_matmul_reduce_scatter(*args, group=group, bias=bias, out_dtype=out_dtype, backend=backend, use_fast_accum=fast)
    what = f"scaled_matmul_reduce_scatter {backend} W={world} m={m} n={n} k_local={k_local} row_wise={row_wise} {out_dtype} bias={bias_dtype}"
    assert out.shape == (m, n) and out.dtype == out_dtype, f"{what}: {tuple(out.shape)} {out.dtype}"
    err = rel_error(out, ref)
    assert err <= allowed, f"{what}: rel err {err:.2e}"
    again = fluxtp.scaled_matmul_reduce_scatter(*args, group=group, bias=bias, out_dtype=out_dtype, backend=backend, use_fast_accum=fast)
    assert torch.equal(again, out), f"{what}: not deterministic"


SHAPES = [(1, 16, 16), (7, 3, 13), (16, 32, 64), (33, 17, 40)]
OUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def sweep(rank, world, seed, device, backends, group=None):
    """Odd and even shapes, both scalings, every out_dtype, with and without a bias (of another
    dtype than the output, too), one e5m2 operand."""
    case = 0
    for backend in backends:
        for i, (m, n, k) in enumerate(SHAPES):
            for row_wise in (True, False):
                out_dtype = OUT_DTYPES[case % 3]
                bias_dtype = (None, out_dtype, torch.float32)[case % 3]
                x_dtype = torch.float8_e5m2 if case % 5 == 4 else torch.float8_e4m3fn
                s = seed + 10 * case
                check_all_gather_scaled(rank, world, s, m, n, k, device, backend, row_wise, out_dtype, bias_dtype, group, x_dtype)
                check_scaled_reduce_scatter(rank, world, s, m, n, k, device, backend, row_wise, out_dtype, bias_dtype, group,
                                            w_dtype=x_dtype)  # fmt: skip
                case += 1
