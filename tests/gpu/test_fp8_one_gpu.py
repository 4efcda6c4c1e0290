"""The FP8 paths on ONE GPU: the fused kernels with FP8 operands under the one-GPU harnesses, and
the ops' local scaled GEMM (torch._scaled_mm, or the dequantized float32 product), each against
float64 on the dequantized inputs (tests/_fp8_cases.py's tolerances).

All-gather: one simulated rank's kernel runs while a copy stream delivers the peers' row scales
and then their FP8 rows chunk by chunk, each chunk behind a host gate (tests/_gates.py), as the
launcher orders them; rows and scales a tile could read early are NaN until copied. Reduce-scatter:
W ranks simulated one after another (tests/_rs_simulation.py), every transport, partials in out_dtype,
bitwise repeatable. Ragged rows, per-tensor and row-wise scales, bf16 / fp16 / fp32 outputs,
precise and fast accumulation, the heuristic's FP8 tilings.
"""

import dataclasses
import json
import random
import re

import pytest
import torch
import triton

import fluxtp
from fluxtp import fp8
from fluxtp._dist import GroupInfo
from fluxtp.configs import describe
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig, _set_signal, launch_gemm
from fluxtp.backends.fused._matmul_reduce_scatter import TRANSPORTS, MatmulReduceScatterConfig, gemm_only
from fluxtp.backends.fused._scaled import Scaled, flat, pingpong_unsupported
from fluxtp.configs._classes import REDUCER_FP8_WIDE_PRECISE_TILING, WARP_SPECIALIZED_FP8_FAST_TILING
from tests._fp8_cases import partial_rounding, quantize, rel_error, tolerance
from tests._gates import HostGates
from tests._rs_simulation import owner_with_late_partials, simulate
from tests.gpu import run_until_trap, skip_unless_hopper

pytestmark = pytest.mark.gpus(1)

GATE_DELAY_S = 0.004
MAX_SPINS = 1 << 26


def _operands(seed, rows, n, k, row_wise, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-6, 7, (rows, 1), generator=g)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * k**-0.5
    (xq, sx), (wq, sw) = quantize(x, row_wise), quantize(w, row_wise)
    return xq.to(device), sx.to(device), wq.to(device), (sw.reshape(1, -1) if row_wise else sw).to(device)


def _reference(xq, sx, wq, sw, bias):
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double().reshape(-1, 1)).T
    return ref + bias.double() if bias is not None else ref


def _rank_operands(seed, world, m, n, k_local, row_wise):
    """Every rank's own K slice quantized by itself: x [W*m, W*k_local], w [n, W*k_local], each
    rank's flat (scale_x, scale_w), and each rank's float64 partial product [W*m, n] (on CPU)."""
    parts, scales = [], []
    for r in range(world):
        xq, sx, wq, sw = _operands(seed + r, world * m, n, k_local, row_wise)
        parts.append((xq, wq))
        scales.append((flat(sx), flat(sw)))
    x, w = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    partials = [_reference(xq, s[0].reshape(-1, 1), wq, s[1], None).cpu() for (xq, wq), s in zip(parts, scales)]
    return x, w, scales, partials, parts


ALL_GATHER_CASES = [
    (2, 1, 1000, 1000, 2048, True, torch.bfloat16, True, 256),  # ragged rows, N not a tile multiple, 4 chunks
    (2, 0, 512, 2048, 4096, False, torch.float32, False, 512),  # per tensor, fast accumulation, one chunk
    (4, 2, 384, 1536, 1024, True, torch.float16, False, 128),  # a chunk per tile row, the ring wraps
    (8, 5, 256, 640, 1152, False, torch.float32, True, 128),  # TMA stores, an odd number of 128-wide K blocks
    (4, 3, 200, 256, 384, True, torch.float16, True, 128),  # under one tile of rows a rank, three K blocks
    (8, 3, 100, 896, 1024, True, torch.bfloat16, False, 128),  # fast, narrow tiles win: 128x128 on the ws kernel
]


def _all_gather_config(m, n, k, world, precise, chunk_rows, warp_specialized, out_dtype):
    """The heuristic's Triton config; warp-specialized, the heuristic's tiling where it takes that
    kernel, else the fast tiling (a float32 output on two stages, so that its staging fits)."""
    ws_heuristic = AllGatherMatmulConfig.heuristic_fp8(m, n, k, world, precise, warp_specialized=True,
                                                       out_bytes=out_dtype.itemsize)  # fmt: skip
    if warp_specialized and not precise and not ws_heuristic.warp_specialized:
        stages = 2 if out_dtype == torch.float32 else WARP_SPECIALIZED_FP8_FAST_TILING["num_stages"]
        return AllGatherMatmulConfig(**{**WARP_SPECIALIZED_FP8_FAST_TILING, "num_stages": stages}, warp_specialized=True,
                                     chunk_rows=chunk_rows)  # fmt: skip
    cfg = AllGatherMatmulConfig.heuristic_fp8(m, n, k, world, precise, warp_specialized=warp_specialized,
                                              out_bytes=out_dtype.itemsize)  # fmt: skip
    assert cfg.warp_specialized == warp_specialized
    return AllGatherMatmulConfig(**{**cfg.__dict__, "chunk_rows": chunk_rows})


def _wide_precise_config(block_k, chunk_rows, out_dtype):
    """Precise accumulation in 128x256 tiles (the accumulator in column halves): as many stages as
    fit beside the output's staging (two 64x128 buffers: 32 KiB at 2 bytes, 64 at 4)."""
    stage_kib = (128 + 256) * block_k // 1024
    stages = (192 if out_dtype.itemsize <= 2 else 160) // stage_kib
    return AllGatherMatmulConfig(block_m=128, block_n=256, block_k=block_k, num_stages=stages, warp_specialized=True,
                                 chunk_rows=chunk_rows)  # fmt: skip


@pytest.mark.parametrize("tiling", ["heuristic", "wide_precise_k64", "wide_precise_k128", "stream_k"])
@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.parametrize("world, rank, m, n, k, row_wise, out_dtype, precise, chunk_rows", ALL_GATHER_CASES)
def test_all_gather_fp8_waits_for_rows_and_scales(tiling, warp_specialized, world, rank, m, n, k, row_wise, out_dtype,
                                                  precise, chunk_rows):  # fmt: skip
    if tiling.startswith("wide_precise") and not (warp_specialized and precise):
        pytest.skip("128x256 tiles with the accumulator in halves: precise calls on the warp-specialized kernel")
    if tiling == "stream_k" and not (warp_specialized and not precise):
        pytest.skip("stream-K: fast accumulation on the warp-specialized kernel")
    seed = random.randrange(1 << 30)
    what = (f"world={world} rank={rank} m={m} k={k} row_wise={row_wise} {out_dtype} precise={precise} "
            f"warp_specialized={warp_specialized} tiling={tiling} seed={seed}")  # fmt: skip
    xq, sx, wq, sw = _operands(seed, world * m, n, k, row_wise)
    bias = torch.randn(n, device="cuda", dtype=out_dtype)
    scaled = Scaled(out_dtype, row_wise, precise)
    if tiling == "heuristic":
        cfg = _all_gather_config(m, n, k, world, precise, chunk_rows, warp_specialized, out_dtype)
    elif tiling == "stream_k":  # the tiles past the last whole wave split by K (every tile here: under one wave)
        cfg = dataclasses.replace(_all_gather_config(m, n, k, world, precise, chunk_rows, True, out_dtype), stream_k=True)
    else:  # odd counts of K blocks at 128 (1152, 384): the loader's zero block
        cfg = _wide_precise_config(int(tiling[-3:].lstrip("k")), chunk_rows, out_dtype)
    own = slice(rank * m, (rank + 1) * m)
    x_own = xq[own].clone()
    x_gathered = torch.full_like(xq.view(torch.uint8), 0x7F).view(xq.dtype)  # e4m3 NaN until copied
    scales_own = flat(sx[own] if row_wise else sx)
    scales_gathered = torch.full((world * m,), float("nan"), device="cuda") if row_wise else flat(sx)
    y = torch.full((world * m, n), float("nan"), dtype=out_dtype, device="cuda")
    chunk_rows = cfg.chunk_rows_for(m)
    chunks = triton.cdiv(m, chunk_rows)
    signals = torch.zeros(world * chunks, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    gates = HostGates((world - 1) * (chunks + 1))
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    finished = torch.cuda.Event()
    copy.wait_stream(compute)
    launch_gemm(x_gathered, x_own, wq, bias, y, signals, done, m, chunk_rows, GroupInfo(None, rank, world), cfg,
                max_spins=MAX_SPINS, scaled=scaled, scales=(scales_gathered, scales_own, flat(sw)))  # fmt: skip
    finished.record(compute)
    with torch.cuda.stream(copy):
        peers = [(rank + s) % world for s in range(1, world)]
        if row_wise:  # the launcher's order: every peer's scales, then the rows chunk by chunk
            for r in peers:
                gates.hold()
                scales_gathered[r * m : (r + 1) * m].copy_(flat(sx)[r * m : (r + 1) * m])
        for r in peers:
            for c in range(chunks):
                r0, r1 = r * m + c * chunk_rows, r * m + min((c + 1) * chunk_rows, m)
                gates.hold()
                x_gathered[r0:r1].copy_(xq[r0:r1])
                _set_signal(signals, r * chunks + c)
    gates.open_slowly(finished, GATE_DELAY_S, what)
    torch.cuda.synchronize()
    err = rel_error(y, _reference(xq, sx, wq, sw, bias))
    # hopper=True: precise accumulation sums a K interval in the tensor cores' precision before promoting it
    allowed = tolerance(out_dtype, k, not precise, hopper=True)
    assert err <= allowed, f"{what}: rel err {err:.2e}"
    assert signals.eq(0).all() and done.item() == 0, f"{what}: signals left {signals.tolist()}"
    for _ in range(3):  # later calls over the same buffers, every chunk there: each leaves signals and count at zero
        y.fill_(float("nan"))
        signals.fill_(1)
        launch_gemm(xq.clone(), x_own, wq, bias, y, signals, done, m, chunk_rows, GroupInfo(None, rank, world), cfg,
                    max_spins=MAX_SPINS, scaled=scaled, scales=(flat(sx), scales_own, flat(sw)))  # fmt: skip
        torch.cuda.synchronize()
        again = rel_error(y, _reference(xq, sx, wq, sw, bias))
        assert again <= allowed, f"{what}: rel err {again:.2e} on a later call"
        assert signals.eq(0).all() and done.item() == 0, f"{what}: signals left {signals.tolist()} on a later call"


def test_the_fp8_heuristic_takes_the_warp_specialized_kernel_for_precise_calls_here():
    """On this Hopper GPU, scaled all-gathers go to the warp-specialized kernel, precise ones and
    fast ones whose wide tiles fill the waves or whose narrow ones win; reduce-scatters to theirs
    (the reducer kernel) precise from TP=2, fast from TP=4."""
    from fluxtp.backends.fused._all_gather_matmul import _config_for
    from fluxtp.backends.fused._matmul_reduce_scatter import _config_for as rs_config_for

    x = torch.zeros(512, 1024, device="cuda").to(torch.float8_e4m3fn)
    w = torch.zeros(768, 1024, device="cuda").to(torch.float8_e4m3fn)
    skip_unless_hopper()
    assert _config_for(x, w, 2, None, Scaled(torch.bfloat16, True, True)).warp_specialized
    wide = torch.zeros(7168, 1024, device="cuda").to(torch.float8_e4m3fn)  # fast: where 128x256 tiles fill the waves
    assert _config_for(x, wide, 2, None, Scaled(torch.bfloat16, True, False)).warp_specialized
    narrow = _config_for(x, w, 2, None, Scaled(torch.bfloat16, True, False))  # 24 wide tiles, 48 narrow ones
    assert narrow.warp_specialized and narrow.block_n == 128
    between = torch.zeros(2304, 1024, device="cuda").to(torch.float8_e4m3fn)  # 72 wide tiles, 144 narrow ones
    assert not _config_for(torch.zeros(128, 1024, device="cuda").to(torch.float8_e4m3fn), between, 8, None,
                           Scaled(torch.bfloat16, True, False)).warp_specialized  # fmt: skip
    # The reduce-scatter's: precise from TP=2, fast from TP=4 (docs/perf-log.md).
    assert rs_config_for(x, w, 2, None, Scaled(torch.bfloat16, True, True)).warp_specialized
    assert not rs_config_for(x, w, 2, None, Scaled(torch.bfloat16, True, False)).warp_specialized
    fast_tp4 = rs_config_for(x, w, 4, None, Scaled(torch.bfloat16, True, False))
    assert fast_tp4.warp_specialized and fast_tp4.block_n == WARP_SPECIALIZED_FP8_FAST_TILING["block_n"]
    assert pingpong_unsupported(x.device, Scaled(torch.bfloat16, True, False)) is None


# One process (a trap poisons its CUDA context): the warp-specialized kernel as rank 1 of 4, chunk 1
# of rank 3's rows never arriving. Its loader's wait must give up and name the chunk.
_AG_PINGPONG_TIMEOUT_SCRIPT = """
import torch
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig, launch_gemm
from fluxtp.backends.fused._scaled import Scaled

world, rank, m, n, k, chunk_rows = 4, 1, 256, 512, 1024, 128
config = AllGatherMatmulConfig.heuristic_fp8(m, n, k, world, True, warp_specialized=True)
config = AllGatherMatmulConfig(**{**config.__dict__, "chunk_rows": chunk_rows})
x = torch.randn(world * m, k, device="cuda").to(torch.float8_e4m3fn)
w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
y = torch.empty(world * m, n, device="cuda", dtype=torch.bfloat16)
signals = torch.ones(world * (m // chunk_rows), dtype=torch.int32, device="cuda")
signals[3 * (m // chunk_rows) + 1] = 0
done = torch.zeros(1, dtype=torch.int32, device="cuda")
one = torch.ones(1, device="cuda")
launch_gemm(x, x[rank * m : (rank + 1) * m], w, None, y, signals, done, m, chunk_rows, GroupInfo(None, rank, world), config,
            max_spins=100_000, scaled=Scaled(torch.bfloat16, False, True), scales=(one, one, one))
"""


# The warp-specialized reduce-scatter (the reducer kernel, push) as rank 2 of 4 running its own
# step: rank 0's second band of rows (one tile row, 2 arrivals a tile) counts one half short. A
# reducer's wait must give up and name rank 0 and a tile of that band: precise in 128x128 tiles
# the reducer warp's (tiles 4-7), fast in 128x256 tiles in three stages the tail's (the one round
# of tiles is all tail; tiles 2-3).
_RS_PINGPONG_TIMEOUT_SCRIPT = """
import dataclasses
import json
import sys
import torch
from fluxtp.backends.fused import _launch
from fluxtp.backends.fused._matmul_reduce_scatter import Layout, MatmulReduceScatterConfig, launch_kernel
from fluxtp.backends.fused._scaled import Scaled

launch = _launch.Launch.__call__
def shown(self, *args):  # which wait gives up: the tail's where it has units
    print("TAIL_UNITS", self.constexprs["TAIL_UNITS"], flush=True)
    return launch(self, *args)
_launch.Launch.__call__ = shown

world, rank, m, n, k = 4, 2, 256, 512, 1024
case = json.loads(sys.argv[1])  # block_n, num_stages, precise
config = MatmulReduceScatterConfig.warp_specialized_fp8(world * m, n, world)
config = dataclasses.replace(config, transport="push", group_m=1, block_n=case["block_n"], num_stages=case["num_stages"])
layout = Layout.of(m, n, 4, world, config, True)
assert layout.counts_bands and layout.bands == 2 and layout.tiles_n == n // case["block_n"]
x = torch.randn(world * m, k, device="cuda").to(torch.float8_e4m3fn)
w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
flags = buffer[layout.flags_offset : layout.flags_offset + 4 * layout.num_flags].view(torch.int32)
flags.copy_(layout.complete_flags(False))
flags[0 * layout.bands + 1] -= 1  # slot 0 holds rank 0's partials here (push)
ptrs = torch.tensor([buffer.data_ptr()] * world, dtype=torch.int64, device="cuda")
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
one = torch.ones(1, device="cuda")
launch_kernel(x, w, None, out, ptrs, layout.flags_offset, rank, world, config, world - 1, world - 1, max_spins=100_000,
              scaled=Scaled(torch.bfloat16, False, case["precise"]), scales=(one, one), own_offset=layout.own_offset,
              buffers=[buffer] * world)
"""


@pytest.mark.parametrize(
    "script, module, args, expected",
    [
        (_AG_PINGPONG_TIMEOUT_SCRIPT, "_all_gather_matmul", (), "rank 1 timed out waiting for chunk 1 of rank 3's rows"),
        (_RS_PINGPONG_TIMEOUT_SCRIPT, "_matmul_reduce_scatter", ({"block_n": 128, "num_stages": 5, "precise": True},),
         r"TAIL_UNITS 0\b[\s\S]*rank 2 timed out waiting for rank 0's partial of tile [4-7]\b"),
        (_RS_PINGPONG_TIMEOUT_SCRIPT, "_matmul_reduce_scatter", ({"block_n": 256, "num_stages": 3, "precise": False},),
         r"TAIL_UNITS [1-9][\s\S]*rank 2 timed out waiting for rank 0's partial of tile [23]\b"),
    ],
    ids=["all_gather", "reduce_scatter", "reduce_scatter_tail"],
)
def test_the_warp_specialized_kernels_name_what_never_arrives(script, module, args, expected):
    skip_unless_hopper()
    proc = run_until_trap(script, module, *map(json.dumps, args))
    assert re.search(expected, proc.stdout), proc.stdout[-2000:] + proc.stderr[-2000:]


REDUCE_SCATTER_CASES = [
    (2, 1000, 1000, 2048, True, torch.bfloat16, True),  # ragged rows, N not a tile multiple
    (4, 384, 1536, 1024, False, torch.float32, False),
    (8, 200, 1024, 512, True, torch.float16, False),  # the unrolled reduction
    (4, 384, 640, 640, False, torch.float32, True),  # per tensor, an odd number of 128-wide K blocks
    (8, 200, 1024, 384, True, torch.float16, True),  # under two tiles of rows a rank, three K blocks
    (4, 300, 1280, 640, True, torch.bfloat16, False),  # fast into 2-byte slots: the wide tiling at TP=4, ragged
    (4, 256, 768, 640, False, torch.bfloat16, True),  # per tensor, K blocks no whole number of spans (zero blocks)
]


@pytest.mark.parametrize("tiling", ["heuristic", "wide_precise"])
@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world, m, n, k_local, row_wise, out_dtype, precise", REDUCE_SCATTER_CASES)
def test_reduce_scatter_fp8_simulated_ranks(tiling, warp_specialized, transport, world, m, n, k_local, row_wise, out_dtype,
                                            precise):  # fmt: skip
    """W ranks one after another (peer steps, copy plan, own steps): float64 reference, poisoned
    slots, bitwise repeatable over reused buffers, and the GEMM-only mode; both kernels, and the
    reducer kernel's precise 128x256 tiles (accumulator in column halves, staged in quarters)."""
    if warp_specialized and transport == "pull":
        pytest.skip("the reducer kernel hands partials over by push or the copy engine")
    if tiling == "wide_precise" and not (warp_specialized and precise and out_dtype.itemsize == 2):
        pytest.skip("the wide precise tiling: precise calls with 2-byte slots on the reducer kernel")
    if warp_specialized:
        skip_unless_hopper()
    seed = random.randrange(1 << 30)
    what = (f"{transport} ws={warp_specialized} {tiling} world={world} m={m} row_wise={row_wise} {out_dtype} "
            f"precise={precise} seed={seed}")  # fmt: skip
    x, w, scales, partials, parts = _rank_operands(seed, world, m, n, k_local, row_wise)
    bias = torch.randn(n, device="cuda", dtype=torch.float32)
    if tiling == "wide_precise":
        base = MatmulReduceScatterConfig(**REDUCER_FP8_WIDE_PRECISE_TILING, epilogue_split=2, warp_specialized=True)
    elif warp_specialized:
        base = MatmulReduceScatterConfig.warp_specialized_fp8(world * m, n, world, precise, out_dtype.itemsize)
    else:
        base = MatmulReduceScatterConfig.heuristic_fp8(world * m, n, world * k_local, world, precise)
    cfg = MatmulReduceScatterConfig(**{**base.__dict__, "transport": transport})
    scaled = Scaled(out_dtype, row_wise, precise)
    outs, _ = simulate(x, w, bias, world, k_local, cfg, float("nan"), MAX_SPINS, scaled=scaled, rank_scales=scales)
    again, _ = simulate(x, w, bias, world, k_local, cfg, 12345.0, MAX_SPINS, scaled=scaled, rank_scales=scales)
    ref = sum(partials) + bias.double().cpu()
    for r in range(world):
        rows = slice(r * m, (r + 1) * m)
        allowed = tolerance(out_dtype, world * k_local, not precise, hopper=True)
        allowed += partial_rounding(out_dtype, [p[rows] for p in partials], ref[rows])
        err = rel_error(outs[r], ref[rows])
        assert err <= allowed, f"{what} rank={r}: rel err {err:.2e}"
        assert torch.equal(outs[r], again[r]), f"{what} rank={r}: not bitwise repeatable"
    own = gemm_only(parts[0][0], parts[0][1], bias, GroupInfo(None, 0, world), cfg, scales=scales[0], out_dtype=out_dtype,
                    use_fast_accum=not precise)()  # fmt: skip
    want = _reference(parts[0][0][:m], scales[0][0][:m].reshape(-1, 1) if row_wise else scales[0][0], parts[0][1],
                      scales[0][1], bias)  # fmt: skip
    assert rel_error(own, want.cpu()) <= tolerance(out_dtype, k_local, not precise, hopper=True), f"{what}: gemm_only"


@pytest.mark.parametrize(
    "world, m, n, k_local, precise",
    [
        (4, 300, 1024, 640, True),  # ragged rows, K blocks no whole number of stages
        (2, 200, 768, 1024, False),  # fast at TP=2: the Triton kernel's tilings too
    ],
)
def test_reduce_scatter_fp8_every_tiling_the_tuner_screens(world, m, n, k_local, precise):
    """Every tiling `fluxtp tune --one-gpu` screens for an FP8 reduce-scatter (its stages and row
    bands on the reducer kernel, whose bands of reduction follow group_m), W ranks simulated with
    row-wise scales and bf16 partials: float64 reference, bitwise repeatable."""
    from fluxtp import tune_gemm
    from fluxtp.bench.gemm_grid import GemmCase

    skip_unless_hopper()
    case = GemmCase("matmul_reduce_scatter", world * m, n, world * k_local, world, "float8_e4m3fn", fast_accum=not precise)
    space = tune_gemm.candidates(case, warp_specialized=True)
    assert space[0].warp_specialized == (precise or world >= 4) and len(space) >= 6
    seed = random.randrange(1 << 30)
    x, w, scales, partials, _ = _rank_operands(seed, world, m, n, k_local, True)
    bias = torch.randn(n, device="cuda", dtype=torch.float32)
    scaled = Scaled(torch.bfloat16, True, precise)
    ref = sum(partials) + bias.double().cpu()
    for cfg in space:
        what = f"{describe(cfg)} world={world} m={m} precise={precise} seed={seed}"
        outs, _ = simulate(x, w, bias, world, k_local, cfg, float("nan"), MAX_SPINS, scaled=scaled, rank_scales=scales)
        again, _ = simulate(x, w, bias, world, k_local, cfg, 12345.0, MAX_SPINS, scaled=scaled, rank_scales=scales)
        for r in range(world):
            rows = slice(r * m, (r + 1) * m)
            allowed = tolerance(torch.bfloat16, world * k_local, not precise, hopper=True)
            allowed += partial_rounding(torch.bfloat16, [p[rows] for p in partials], ref[rows])
            err = rel_error(outs[r], ref[rows])
            assert err <= allowed, f"{what} rank={r}: rel err {err:.2e}"
            assert torch.equal(outs[r], again[r]), f"{what} rank={r}: not bitwise repeatable"


@pytest.mark.parametrize("transport", ["push", "copy_engine"])
@pytest.mark.parametrize(
    "world, owner, m, n, k_local, precise",
    [
        (4, 2, 300, 1280, 640, False),  # fast: the wide tiling at TP=4, ragged rows
        (4, 1, 384, 1024, 512, True),  # precise: the narrow tiling, five stages
        (8, 5, 200, 1024, 384, True),
        (4, 3, 256, 1024, 640, "wide"),  # precise in 128x256 tiles
    ],
)
def test_reduce_scatter_fp8_owner_waits_for_late_partials(transport, world, owner, m, n, k_local, precise):
    """The reducer kernel's FP8 tilings as the ops route them (bf16 slots, row-wise scales): the
    owner's partials and flags taken back after the peer steps and delivered again by a copy
    stream behind host gates, last first, while its kernel runs; its rows against float64."""
    skip_unless_hopper()
    seed = random.randrange(1 << 30)
    what = f"{transport} world={world} owner={owner} precise={precise} seed={seed}"
    x, w, scales, partials, _ = _rank_operands(seed, world, m, n, k_local, True)
    bias = torch.randn(n, device="cuda", dtype=torch.float32)
    wide, precise = precise == "wide", bool(precise)
    base = MatmulReduceScatterConfig.heuristic_fp8(world * m, n, world * k_local, world, precise)
    cfg = dataclasses.replace(base, transport=transport).on_reducer_kernel(world, world * m, n, world * k_local, precise)
    assert cfg.warp_specialized, f"{what}: not routed to the reducer kernel"
    if wide:
        cfg = dataclasses.replace(cfg, **REDUCER_FP8_WIDE_PRECISE_TILING)
    scaled = Scaled(torch.bfloat16, True, precise)
    out = owner_with_late_partials(x, w, bias, world, k_local, cfg, owner, GATE_DELAY_S, MAX_SPINS, what, scaled, scales)
    rows = slice(owner * m, (owner + 1) * m)
    ref = sum(partials)[rows] + bias.double().cpu()
    allowed = tolerance(torch.bfloat16, world * k_local, not precise, hopper=True)
    allowed += partial_rounding(torch.bfloat16, [p[rows] for p in partials], ref)
    err = rel_error(out, ref)
    assert err <= allowed, f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("row_wise", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 512, 1024), (100, 48, 40)])  # torch._scaled_mm's, and its float32 fallback
def test_local_scaled_gemm_on_cuda(row_wise, out_dtype, shape):
    """A world of one: fluxtp.fp8.scaled_linear (torch._scaled_mm where it runs) against float64."""
    m, n, k = shape
    xq, sx, wq, sw = _operands(random.randrange(1 << 30), m, n, k, row_wise)
    for bias in (None, torch.randn(n, device="cuda", dtype=out_dtype), torch.randn(n, device="cuda")):
        for fast in (False, True):
            y = fluxtp.all_gather_scaled_matmul(xq, wq, sx, sw, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)
            assert y.dtype == out_dtype and y.shape == (m, n)
            err = rel_error(y, _reference(xq, sx, wq, sw, bias).cpu())
            assert err <= tolerance(out_dtype, k, fast, hopper=True), f"{shape} row_wise={row_wise} {out_dtype} fast={fast}: {err:.2e}"
            out = fluxtp.scaled_matmul_reduce_scatter(xq, wq, sx, sw, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)
            assert rel_error(out, _reference(xq, sx, wq, sw, bias).cpu()) <= tolerance(out_dtype, k, fast, hopper=True)


def test_quantize_rows_on_cuda_matches_cpu():
    t = torch.randn(64, 300) * 2.0 ** torch.randint(-10, 10, (64, 1))
    q_cpu, s_cpu = fp8.quantize_rows(t)
    q_gpu, s_gpu = fp8.quantize_rows(t.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
