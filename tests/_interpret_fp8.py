"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py: the fused kernels with FP8
operands (their FP8 constexprs on) on CPU, against float64 on the dequantized inputs.

AllGather+GEMM: launch_gemm with float8_e4m3fn rows, row-wise scales (this rank's from its shard,
the peers' from the gathered scales, whose own rows are poisoned like the gathered rows) or per
tensor, ragged rows, bias, bf16 / fp16 / fp32 outputs, precise and fast accumulation; the GEMM-only
mode; and the launcher's Plan for a row-wise call (stand-ins as in _interpret_ag_launcher.py): it
publishes its row scales beside its shard, pulls every peer's before their rows, and returns the
gathered FP8 rows and scales exactly. GEMM+ReduceScatter: W ranks simulated (_rs_simulation), each
with its own scales of its slice of K, partials in out_dtype in every transport, bitwise repeatable.
"""

import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

import fluxtp.backends.fused._all_gather_matmul as ag  # noqa: E402
from fluxtp import fp8  # noqa: E402
from fluxtp._dist import GroupInfo  # noqa: E402
from fluxtp.backends.fused._matmul_reduce_scatter import MatmulReduceScatterConfig, gemm_only  # noqa: E402
from fluxtp.backends.fused._scaled import Scaled, flat  # noqa: E402
from _rs_simulation import simulate  # noqa: E402 -- a sibling: this script runs as a file

E4M3 = torch.float8_e4m3fn
# Output rounding (u: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32) plus float32 accumulation and scaling;
# bf16 2u: the interpreter's float32 -> bfloat16 cast truncates (measured: 6.3e-3 relative on
# one value, against 2.2e-3 for torch's rounding), GPUs round to nearest (tests/gpu: u).
TOL = {torch.bfloat16: 2 * 2**-8 + 1e-5, torch.float16: 2**-11 + 1e-5, torch.float32: 1e-5}


def quantized(g, rows, cols, row_wise, spread=6):
    """(t_fp8, scale [rows, 1] or 0-d): rows of magnitudes 2^-spread .. 2^spread (x: every row
    scale must go to its row), or (weights, spread 0) of about 1/sqrt(cols): fp16 outputs stay finite."""
    t = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-spread, spread + 1, (rows, 1), generator=g)
    t = t if spread else t * cols**-0.5
    if row_wise:
        return fp8.quantize_rows(t)
    scale = t.abs().amax() / 448.0  # not a power of two: per-tensor scales are general
    return (t / scale).to(E4M3), scale


def check(out, ref, out_dtype, what, partials=()):
    """Against float64; a reduce-scatter's `partials` (float64, of out's rows) were each rounded
    to out_dtype before the sum too: their norms over ref's, times the same unit, on top."""
    assert out.dtype == out_dtype, f"{what}: dtype {out.dtype}"
    assert not torch.isnan(out).any(), f"{what}: unwritten outputs: {torch.isnan(out).sum().item()}"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    allowed = TOL[out_dtype] * (1 + sum(p.norm().item() for p in partials) / ref.norm().item())
    assert err <= allowed, f"{what}: rel err {err:.2e}"


def all_gather_case(seed, world, rank, m, n, k, row_wise, out_dtype, bias_dtype, cfg, precise):
    g = torch.Generator().manual_seed(seed)
    x, sx = quantized(g, world * m, k, row_wise)
    w, sw = quantized(g, n, k, row_wise, spread=0)
    sw = sw.reshape(1, -1) if row_wise else sw
    b = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    scaled = Scaled.of(sx, sw, out_dtype, not precise)
    x_own = x[rank * m : (rank + 1) * m].clone()
    x_gathered = x.clone()
    x_gathered[rank * m : (rank + 1) * m] = float("nan")  # read from x_own, never from here
    scales_own = flat(sx[rank * m : (rank + 1) * m] if row_wise else sx)
    scales_gathered = flat(sx).clone()
    if row_wise:
        scales_gathered[rank * m : (rank + 1) * m] = float("nan")
    y = torch.full((world * m, n), float("nan"), dtype=out_dtype)
    chunk = cfg.chunk_rows_for(m)
    signals = torch.ones(world * -(-m // chunk), dtype=torch.int32)
    ag.launch_gemm(x_gathered, x_own, w, b, y, signals, torch.zeros(1, dtype=torch.int32), m, chunk,
                   GroupInfo(None, rank, world), cfg, signal_reset=1, scaled=scaled,
                   scales=(scales_gathered, scales_own, flat(sw)))  # fmt: skip
    ref = fp8.dequantize(x, sx).double() @ fp8.dequantize(w, sw.reshape(-1, 1)).double().T
    ref += b.double() if b is not None else 0
    what = f"all-gather W={world} rank={rank} m={m} n={n} k={k} row_wise={row_wise} {out_dtype} precise={precise}"
    check(y, ref, out_dtype, what)
    if rank == 0:  # GEMM-only: the same kernel on this rank's rows repeated for every segment
        own = ag.gemm_only(x_own, w, b, GroupInfo(None, rank, world), cfg, scales=(sx[:m] if row_wise else sx, sw),
                           out_dtype=out_dtype, use_fast_accum=not precise)()  # fmt: skip
        check(own, ref[:m].repeat(world, 1), out_dtype, f"{what} gemm_only")


def launcher_case(seed, world=3, m=40, n=32, k=32):
    """The Plan of a row-wise call, every rank, two calls (the second reuses the plan)."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.empty(m, k, dtype=E4M3) for _ in range(world)]
    scale_bufs = [torch.empty(m) for _ in range(world)]

    class Workspace:
        signals = torch.zeros(64, dtype=torch.int32)
        done = torch.zeros(1, dtype=torch.int32)
        shard = types.SimpleNamespace(handle=types.SimpleNamespace(barrier=lambda **kw: None))

        def shard_views(self, dtype, shape, world, offset=0):
            if offset:
                assert dtype == torch.float32 and offset % 16 == 0 and offset >= m * k, f"scales at byte {offset}"
                return scale_bufs
            return shards

    held, gemm_call = [], ag._Gemm.__call__

    def join(stream):  # the interpreter runs a kernel at its launch: hold it until the copies are done
        for args in held:
            gemm_call(*args)
        held.clear()

    stream = types.SimpleNamespace(wait_stream=join)
    ag._Gemm.__call__ = lambda *args: held.append(args)
    ag._workspace = lambda *args: Workspace()
    ag._write_value32 = lambda signals, index, value: signals.__setitem__(index, value)
    ag.symm.copy_stream = lambda device: stream
    ag.symm.current_stream = lambda index: stream
    ag.symm.stream_wait = lambda waiter, producer: join(producer)
    torch.cuda.set_stream = lambda s: None
    cfg = ag.AllGatherMatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=4, chunk_rows=16)
    w, sw = quantized(g, n, k, True, spread=0)
    sw = sw.reshape(1, -1)
    try:
        for call in range(2):
            x, sx = quantized(g, world * m, k, True)
            for rank in range(world):
                for r in range(world):  # every peer published its shard and scales (the first barrier)
                    shards[r].view(torch.uint8).copy_(x[r * m : (r + 1) * m].view(torch.uint8) if r != rank else 0x7F)
                    scale_bufs[r].copy_(sx[r * m : (r + 1) * m, 0] if r != rank else torch.nan)
                run = ag.scaled_plan(x[:m], w, None, GroupInfo(None, rank, world), torch.bfloat16, False, True, cfg)
                y, (xg, sg) = run(x[rank * m : (rank + 1) * m], w, sx[rank * m : (rank + 1) * m], sw, None)
                what = f"launcher call {call} rank {rank}"
                assert torch.equal(xg.view(torch.uint8), x.view(torch.uint8)), f"{what}: gathered rows not exact"
                assert torch.equal(sg, sx), f"{what}: gathered scales not exact"
                assert torch.equal(scale_bufs[rank], sx[rank * m : (rank + 1) * m, 0]), f"{what}: scales not published"
                ref = fp8.dequantize(x, sx).double() @ fp8.dequantize(w, sw.reshape(-1, 1)).double().T
                check(y, ref, torch.bfloat16, what)
    finally:
        ag._Gemm.__call__ = gemm_call


def reduce_scatter_case(seed, world, m, n, k_local, row_wise, out_dtype, bias_dtype, cfg, precise):
    g = torch.Generator().manual_seed(seed)
    xs, ws, scales = [], [], []
    for _ in range(world):  # each rank quantizes its own slice of K
        xr, sxr = quantized(g, world * m, k_local, row_wise)
        wr, swr = quantized(g, n, k_local, row_wise, spread=0)
        xs.append(xr)
        ws.append(wr)
        scales.append((flat(sxr), flat(swr)))
    b = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    x, w = torch.cat(xs, dim=1), torch.cat(ws, dim=1)
    scaled = Scaled(out_dtype, row_wise, precise)
    partials = [fp8.dequantize(xr, s[0].reshape(-1, 1)).double() @ fp8.dequantize(wr, s[1].reshape(-1, 1)).double().T
                for xr, wr, s in zip(xs, ws, scales)]  # fmt: skip
    ref = sum(partials) + (b.double() if b is not None else 0)
    what = f"reduce-scatter W={world} m={m} n={n} k_local={k_local} row_wise={row_wise} {cfg.transport} {out_dtype}"
    outs, _ = simulate(x, w, b, world, k_local, cfg, float("nan"), scaled=scaled, rank_scales=scales)
    again, _ = simulate(x, w, b, world, k_local, cfg, 12345.0, scaled=scaled, rank_scales=scales)
    for r in range(world):
        rows = slice(r * m, (r + 1) * m)
        check(outs[r], ref[rows], out_dtype, f"{what} rank={r}", [p[rows] for p in partials])
        assert torch.equal(outs[r], again[r]), f"{what} rank={r}: outputs differ between identical runs"
    # GEMM-only: rank 0's own partial of its rows, plus bias.
    own = gemm_only(xs[0], ws[0], b, GroupInfo(None, 0, world), cfg, scales=scales[0], out_dtype=out_dtype,
                    use_fast_accum=not precise)()  # fmt: skip
    part = fp8.dequantize(xs[0][:m], scales[0][0].reshape(-1, 1)[:m] if row_wise else scales[0][0]).double()
    part = part @ fp8.dequantize(ws[0], scales[0][1].reshape(-1, 1)).double().T + (b.double() if b is not None else 0)
    check(own, part, out_dtype, f"{what} gemm_only")


def main():
    seed = int(sys.argv[1])
    small = ag.AllGatherMatmulConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4, chunk_rows=16)
    flat_cfg = ag.AllGatherMatmulConfig(block_m=16, block_n=16, block_k=16, group_m=3, num_stages=2, num_warps=4,
                                        chunk_rows=32, tma_store=False)  # fmt: skip
    all_gather_case(seed, 2, 1, 40, 48, 64, True, torch.bfloat16, torch.bfloat16, small, True)  # ragged, TMA store off
    all_gather_case(seed + 1, 2, 0, 32, 64, 32, True, torch.float32, torch.float32, small, False)  # TMA store, fp32 out
    all_gather_case(seed + 2, 3, 2, 23, 20, 48, False, torch.float16, None, flat_cfg, True)  # per tensor, ring wraps
    all_gather_case(seed + 3, 4, 1, 9, 16, 16, True, torch.bfloat16, torch.float32, flat_cfg, False)  # fewer rows than a tile
    launcher_case(seed + 4)
    rs = MatmulReduceScatterConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4, transport="push")
    reduce_scatter_case(seed + 5, 2, 40, 48, 32, True, torch.bfloat16, torch.bfloat16, rs, True)
    reduce_scatter_case(seed + 6, 3, 17, 40, 16, False, torch.float32, None, rs.__class__(**{**rs.__dict__, "transport": "pull", "epilogue_split": 2}), False)
    reduce_scatter_case(seed + 7, 2, 40, 48, 32, True, torch.float16, torch.float32,
                        rs.__class__(**{**rs.__dict__, "transport": "copy_engine", "epilogue_split": 1}), True)  # fmt: skip
    print("ok")


if __name__ == "__main__":
    main()
