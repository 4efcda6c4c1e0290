"""Shared test logic: every backend against a dense float64 computation of the same function.

Inputs are drawn fresh for every case from a seed the parent picks at random (all ranks draw
the same global tensors, then take their shards), so no two runs test the same numbers.
"""

from __future__ import annotations

import contextlib

import torch

import fluxtp

# Normwise relative error allowed against the float64 result, ||out - ref|| / ||ref||. The
# output is rounded once to its dtype (unit roundoff u: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32);
# reduce-scatter/all-reduce also round each rank's partial before the sum, and partials can be
# larger than their sum, so allow 4u. float32 GEMMs on GPUs may use TF32-free cuBLAS: still 4u
# of float32 plus K-term accumulation, hence 1e-5.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double()
    assert torch.isfinite(out64).all(), "output has NaN or Inf"
    return ((out64 - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def draw(seed: int, shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values at an address 2 bytes past a 16-byte boundary (Triton compiles such a pointer apart)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def _transposed_view(w: torch.Tensor) -> torch.Tensor:
    """w's values with strides (1, rows): the W^T view ColumnParallelLinear's backward passes."""
    return w.t().contiguous().t()


def check_all_gather_matmul(
    rank, world, seed, m, n_local, k, dtype, device, backend, with_bias, group=None, transposed_weight=False,
    misaligned_bias=False,
):
    """x_gathered must be exact; y within TOLERANCE of float64. transposed_weight: the weight is
    passed as a transposed view (the backward's layout); misaligned_bias: the bias starts 2 bytes
    past a 16-byte boundary."""
    x = draw(seed, (m * world, k), dtype, "cpu")
    w = draw(seed + 1, (n_local * world, k), dtype, "cpu", scale=k**-0.5)
    b = draw(seed + 2, (n_local * world,), dtype, "cpu") if with_bias else None
    x_shard = x[rank * m : (rank + 1) * m].to(device)
    w_shard = w[rank * n_local : (rank + 1) * n_local].to(device)
    b_shard = b[rank * n_local : (rank + 1) * n_local].to(device) if with_bias else None
    if transposed_weight:
        w_shard = _transposed_view(w_shard)
    if misaligned_bias:
        b_shard = _misaligned(b_shard)
    y, xg = fluxtp.all_gather_matmul(x_shard, w_shard, bias=b_shard, group=group, backend=backend, return_gathered=True)
    assert y.shape == (m * world, n_local) and y.dtype == dtype and y.device == x_shard.device
    assert torch.equal(xg.cpu(), x), "the gathered input is not an exact copy"
    ref = x.double() @ w_shard.cpu().double().T + (b_shard.cpu().double() if with_bias else 0)
    err = rel_error(y.cpu(), ref)
    assert err <= TOLERANCE[dtype], f"all_gather_matmul {backend} {dtype} m={m} n={n_local} k={k}: rel err {err:.2e}"
    y2 = fluxtp.all_gather_matmul(x_shard, w_shard, bias=b_shard, group=group, backend=backend)
    assert isinstance(y2, torch.Tensor) and y2.shape == y.shape


def check_matmul_reduce(
    op, rank, world, seed, m_total, n, k_local, dtype, device, backend, with_bias, group=None, transposed_weight=False,
    misaligned_bias=False,
):
    """matmul_reduce_scatter ([M/W, N] rows of this rank) or matmul_all_reduce ([M, N]);
    transposed_weight: the weight is passed as a transposed view (the backward's layout);
    misaligned_bias: the bias starts 2 bytes past a 16-byte boundary."""
    x = draw(seed, (m_total, k_local * world), dtype, "cpu")
    w = draw(seed + 1, (n, k_local * world), dtype, "cpu", scale=(k_local * world) ** -0.5)
    b = draw(seed + 2, (n,), dtype, "cpu") if with_bias else None
    cols = slice(rank * k_local, (rank + 1) * k_local)
    x_local, w_local = x[:, cols].contiguous().to(device), w[:, cols].contiguous().to(device)
    if transposed_weight:
        w_local = _transposed_view(w_local)
    bias = None if b is None else b.to(device)
    if misaligned_bias:
        bias = _misaligned(bias)
    out = getattr(fluxtp, op)(x_local, w_local, bias=bias, group=group, backend=backend)
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    if op == "matmul_reduce_scatter":
        rows = m_total // world
        ref = ref[rank * rows : (rank + 1) * rows]
    assert out.shape == ref.shape and out.dtype == dtype, f"{op}: shape {tuple(out.shape)} dtype {out.dtype}"
    err = rel_error(out.cpu(), ref)
    assert err <= TOLERANCE[dtype], f"{op} {backend} {dtype} M={m_total} N={n} k={k_local}: rel err {err:.2e}"


def check_all_reduce(rank, world, seed, shape, dtype, device, backend, group=None):
    """The sum of every rank's tensor within TOLERANCE of float64, x untouched, the same bits on every rank."""
    import torch.distributed as dist

    xs = [draw(seed + 100 * r, shape, dtype, "cpu") for r in range(world)]
    x = xs[rank].to(device)
    out = fluxtp.all_reduce(x, group=group, backend=backend)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert torch.equal(x.cpu(), xs[rank]), "all_reduce modified its input"
    ref = sum(t.double() for t in xs)
    err = rel_error(out.cpu(), ref)
    assert err <= TOLERANCE[dtype], f"all_reduce {backend} {dtype} shape={shape}: rel err {err:.2e}"
    if world > 1:
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.contiguous(), group=group)
        assert all(torch.equal(o, out) for o in outs), f"all_reduce {backend}: ranks hold different sums"


ALL_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_reduce")


def sweep(rank, world, seed, device, backends, dtypes, group=None, ops=ALL_OPS):
    """Odd and even shapes, with and without bias, every op (or those named)."""
    shapes = [(1, 5, 8), (7, 3, 13), (16, 32, 64), (33, 17, 40)]
    case = 0
    for dtype in dtypes:
        for backend in backends:
            for m, n, k in shapes:
                with_bias = case % 2 == 0
                s = seed + 10 * case
                if "all_gather_matmul" in ops:
                    check_all_gather_matmul(rank, world, s, m, n, k, dtype, device, backend, with_bias, group)
                if "matmul_reduce_scatter" in ops:
                    check_matmul_reduce("matmul_reduce_scatter", rank, world, s, m * world, n, k, dtype, device, backend, with_bias, group)
                if "matmul_all_reduce" in ops:
                    check_matmul_reduce("matmul_all_reduce", rank, world, s, m, n, k, dtype, device, backend, not with_bias, group)
                if "all_reduce" in ops:
                    check_all_reduce(rank, world, s, (m, n, 3) if case % 2 else (m * n + k,), dtype, device, backend, group)
                case += 1


@contextlib.contextmanager
def recording_return_gathered(*places):
    """Each (module, name) all-gather op replaced, meanwhile, by one that records the
    return_gathered it is called with into the yielded list, then calls the op."""
    asked, reals = [], [(module, name, getattr(module, name)) for module, name in places]

    def recording(real):
        def op(*args, return_gathered=False, **kwargs):
            asked.append(return_gathered)
            return real(*args, return_gathered=return_gathered, **kwargs)

        return op

    for module, name, real in reals:
        setattr(module, name, recording(real))
    try:
        yield asked
    finally:
        for module, name, real in reals:
            setattr(module, name, real)
