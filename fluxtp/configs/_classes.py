"""The launch configs of the fused kernels: frozen dataclasses with a measured heuristic default,
and the tuner's search space over them (what `fluxtp tune` enumerates and prunes).

Every rank must launch the same config. No triton import here: the configs are data, read by
the lookup and the CLI on hosts without a GPU; `cdiv` stands in for triton.cdiv.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as triton.cdiv."""
    return (a + b - 1) // b


# Field metadata: a config field that a tuning table's entry may leave out (its default then).
TABLE_OPTIONAL = "table_optional"


@dataclass(frozen=True)
class GemmTiling:
    """Tile shape and pipelining of a persistent TMA GEMM; every rank must launch the same one."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # row bands of tiles visited together (L2 reuse of the weight tiles)
    num_stages: int = 3
    num_warps: int = 8

    def as_entry(self):
        """This config as launched, as a tuning table records it: itself (the all-gather's leaves
        its per-call stream-K out)."""
        return self


def fp8_tiling(precise: bool, narrow: bool) -> dict:
    """GemmTiling fields of the FP8 kernels, the fastest of eight tilings screened on one H200
    (GEMM-only against torch._scaled_mm, llama3-8b dims, TP 2 and 8: docs/perf-log.md).
    Precise accumulation (not use_fast_accum) keeps a float32 accumulator beside the MMA's, so
    it takes 128x128 tiles (64 + 64 registers a thread at 8 warps) with K blocks of 256: each
    promotion waits for the MMAs of its block, and longer blocks wait less often (128x128x128
    took 1.04-1.16x its time). Fast accumulation: 128x256x128, 3 stages (48 KiB a stage), unless
    narrow (its last wave mostly empty), then 128x128x128, 4 stages."""
    if precise:
        return {"block_m": 128, "block_n": 128, "block_k": 256, "num_warps": 8, "num_stages": 3}
    if narrow:
        return {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4}
    return {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3}


# The warp-specialized FP8 kernel's tiling: 128x128 tiles (two 64-row consumers, an accumulator and
# a promotion buffer each), K blocks of 128 promoted in pairs (every 256 products, as fp8_tiling's
# precise one), 4 stages of 32 KiB. Measurements: docs/perf-log.md.
WARP_SPECIALIZED_FP8_TILING = {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4}
# What a precise call with a 2-byte output (bf16, fp16) changes in it: more stages fit beside that
# output's staging.
WARP_SPECIALIZED_FP8_TWO_BYTE_OUTPUT = {"num_stages": 6, "group_m": 4}
# Its fast-accumulation tiling (no promotion buffer: a 64x256 accumulator per consumer fits): on one
# H100 it took 0.87-0.99x the Triton kernel's time at 12 all-gather shapes, TP 2 and 8 (docs/perf-log.md).
WARP_SPECIALIZED_FP8_FAST_TILING = {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 4, "num_stages": 3}
# The precise all-gather's wide tiling: 128x256 tiles whose accumulator goes in column halves
# (fluxtp.kernels._pingpong), 4 stages beside a 2-byte output's two 64x128 staging buffers. One
# H100, the FP8 all-gather grid: 0.74-0.99x the 128x128 tiling's time at most cases, slower where
# the wide tiles leave most of their last wave empty (docs/perf-log.md).
WARP_SPECIALIZED_FP8_WIDE_PRECISE_TILING = {**WARP_SPECIALIZED_FP8_FAST_TILING, "num_stages": 4}
# The precise reduce-scatter's wide tiling on the reducer kernel: the all-gather's, its column
# halves staged in two pieces each, which leaves room beside the reduction units for the four
# 128-deep stages. One H100, the FP8 reduce-scatter grid: 0.84-0.89x the time of seven 64-deep
# stages in geomean a TP degree (0.75-0.93 a case); against the narrow tiling 0.85-0.97x where
# the GEMM gives each SM REDUCER_FP8_WIDE_MIN_BLOCKS of its K blocks or more (one case 1.03),
# 1.00-1.04x below (docs/perf-log.md).
REDUCER_FP8_WIDE_PRECISE_TILING = WARP_SPECIALIZED_FP8_WIDE_PRECISE_TILING
REDUCER_FP8_WIDE_MIN_BLOCKS = 40


# SMs of an H100 / H200 (SXM): the wave count the heuristic assumes when it is not told.
HOPPER_SMS = 132

# The precise reducer kernel's fifth stage, in GEMMs of at most this many 128x128 tiles (about 8 a
# program): one H100 took 0.90-1.04x four stages' time there, 0.967 in geomean over 19 cases at TP 4
# and 8; 0.97-1.12x on larger GEMMs (docs/perf-log.md).
REDUCER_FP8_FIVE_STAGES_MAX_TILES = 1024


def reducer_fp8_tiling(precise_acc: bool, out_bytes: int, m_total: int, n: int, k: int = 0,
                       sms: int = HOPPER_SMS) -> dict:  # fmt: skip
    """The reduce-scatter's reducer kernel's FP8 tiling for an [m_total, n] output of K k a rank:
    the wide one where 2-byte slots leave it room (fast accumulation: one H100, TP=8: 0.76-0.93x
    the narrow tiling's time; precise, REDUCER_FP8_WIDE_PRECISE_TILING, where the GEMM gives each
    of `sms` SMs REDUCER_FP8_WIDE_MIN_BLOCKS of its K blocks), else the narrow one (float32 slots,
    or a precise GEMM too short for the wide tiles), with a fifth stage beside 2-byte slots in
    small GEMMs (REDUCER_FP8_FIVE_STAGES_MAX_TILES)."""
    if out_bytes > 2:
        return WARP_SPECIALIZED_FP8_TILING
    if not precise_acc:
        return WARP_SPECIALIZED_FP8_FAST_TILING
    wide = REDUCER_FP8_WIDE_PRECISE_TILING
    if cdiv(m_total, 128) * cdiv(n, wide["block_n"]) * cdiv(k, wide["block_k"]) >= REDUCER_FP8_WIDE_MIN_BLOCKS * sms:
        return wide
    if cdiv(m_total, 128) * cdiv(n, 128) <= REDUCER_FP8_FIVE_STAGES_MAX_TILES:
        return {**WARP_SPECIALIZED_FP8_TILING, "num_stages": 5}
    return WARP_SPECIALIZED_FP8_TILING


# What a 128x128 tile costs relative to a 128x256 one (half the work, a little less efficient):
# the all-gather's tiles with 128x128 over 128x256 at the one-GPU grid (docs/perf-log.md).
NARROW_TILE_COST = 0.525


def narrow_tiles_win(tile_rows: int, n: int, sms: int = HOPPER_SMS) -> bool:
    """Whether 128x128 tiles finish a persistent GEMM before 128x256 ones: each takes whole waves
    of `sms` tiles, so the wide tile loses where its last wave is mostly empty (448 tiles are 3.4
    waves of 132: 4 waves, against 6.8 -> 7 waves of half the cost). tile_rows: 128-row tiles of
    the whole M (per segment, summed over segments); n: the GEMM's N."""
    wide = tile_rows * cdiv(n, 256)
    narrow = tile_rows * cdiv(n, 128)
    return cdiv(narrow, sms) * NARROW_TILE_COST < cdiv(wide, sms)


# Stream-K on the all-gather's warp-specialized kernel (its stream_k knob) where whole tiles would
# leave its last wave at most this full, after a whole wave or more, with K this deep or deeper.
# One H200 (docs/perf-log.md), stream-K forced against the same tiling without it: bf16 at TP 2, 4
# and 8, 0.906-0.994x the time at all 15 cases where this holds (K from 4096; one 4-round run read
# 1.034 at 8192x14336x4096 at TP=2, an 8-round repeat 0.991), 0.976-1.22x at the 17
# elsewhere (two gains just past 0.7; the one-wave grids the worst: each program's float32
# partial in and out costs more than the idle SMs); fast FP8 at TP 4 and 8, whose MMAs take half
# bf16's time beside the same partials, 0.954-0.983x at the 5 cases with two whole waves or more,
# the last at most 0.6 full and K from 12288, 0.998-1.04x at the 10 with fuller last waves, and
# after 1.59 waves 0.974 and 1.019 in two runs.
STREAM_K_MAX_LAST_WAVE = 0.7
STREAM_K_MIN_K = 4096
STREAM_K_FP8_MAX_LAST_WAVE = 0.6
STREAM_K_FP8_MIN_K = 12288
STREAM_K_FP8_MIN_WAVES = 2
# What the split can take back at most, the last wave's idle SMs' share of the whole grid's time,
# at least this: at 101.6 waves (0.4%) it read 1.022x.
STREAM_K_MIN_IDLE_SHARE = 0.01


def stream_k_pays(tiles: int, k: int, programs: int, fp8: bool = False) -> bool:
    """Whether splitting the last partial wave of `tiles` (K k deep) by K over `programs` paid
    where measured: bf16 / fp16 (STREAM_K_MAX_LAST_WAVE, STREAM_K_MIN_K), or FP8 with fast
    accumulation (STREAM_K_FP8_MAX_LAST_WAVE, STREAM_K_FP8_MIN_K, STREAM_K_FP8_MIN_WAVES); either where
    the idle share it could take back is STREAM_K_MIN_IDLE_SHARE or more."""
    if fp8:
        max_last, min_k, min_waves = STREAM_K_FP8_MAX_LAST_WAVE, STREAM_K_FP8_MIN_K, STREAM_K_FP8_MIN_WAVES
    else:
        max_last, min_k, min_waves = STREAM_K_MAX_LAST_WAVE, STREAM_K_MIN_K, 1
    last = tiles % programs
    idle_share = (programs - last) / (cdiv(tiles, programs) * programs)
    return (tiles >= min_waves * programs and 0 < last <= max_last * programs and k >= min_k
            and idle_share >= STREAM_K_MIN_IDLE_SHARE)  # fmt: skip


@dataclass(frozen=True)
class AllGatherMatmulConfig(GemmTiling):
    """How one fused AllGather+GEMM call is launched; every rank must use the same one."""

    chunk_rows: int = 512  # rows per copy-engine chunk; rounded up to a multiple of block_m
    flatten: bool = True  # one software-pipelined loop over (tile, k); used when K has >= num_stages blocks
    tma_store: bool = True  # epilogue through a TMA descriptor (output rows of 16-byte multiples)
    epilogue_subtile: bool = True  # TMA-store the tile in two halves
    # The warp-specialized Gluon kernel (fluxtp/kernels/_all_gather_matmul_pingpong.py; Hopper,
    # 128-row tiles, 4 warps a consumer, num_warps ignored): FP8 calls by heuristic_fp8, bf16 /
    # fp16 calls (either weight layout) untuned by on_warp_specialized_kernel, tuned where their
    # tune chose it (`fluxtp tune --one-gpu` screens it beside Triton's tilings).
    # Optional in tuning tables: entries written before it existed mean False.
    warp_specialized: bool = dataclasses.field(default=False, metadata={TABLE_OPTIONAL: True})
    # The warp-specialized kernel's tile order: group_m bands of row tiles counted across the
    # segments (in arrival order) rather than within each, so that concurrent tiles share the
    # weight's columns where a segment has few row tiles. A communication knob: a call's first
    # wave then needs more peers' rows (measured slower on real peers in grids of several waves).
    # The launcher takes it by itself for a grid of one wave (every tile starts at once either
    # way). Optional in tuning tables.
    bands_across_segments: bool = dataclasses.field(default=False, metadata={TABLE_OPTIONAL: True})
    # Either kernel's tile order after this rank's segment: group_m bands of row tiles counted
    # across the peers' segments (in arrival order), so that where a segment has few row tiles
    # concurrent tiles share the weight's columns (read once more, not once a peer); the peers'
    # tiles then wait for more peers' rows. A communication knob; the launcher takes it by itself
    # where the own segment's GEMM outlasts the peers' rows' arrival (peer_bands). Optional in tables.
    peer_bands: bool = dataclasses.field(default=False, metadata={TABLE_OPTIONAL: True})
    # The warp-specialized kernel's last partial wave of tiles split by K over every program
    # (stream-K), so that no SM idles while others finish whole tiles; calls without FP8's
    # precise accumulation. Optional in tuning tables.
    stream_k: bool = dataclasses.field(default=False, metadata={TABLE_OPTIONAL: True})

    @staticmethod
    @functools.cache
    def heuristic(rows_per_rank: int, n: int, k: int, world: int, sms: int = HOPPER_SMS,
                  warp_specialized: bool = False) -> AllGatherMatmulConfig:  # fmt: skip
        """128x256x64, 8 warps, 3 stages, unless 128x128x64, 4 warps, 5 stages take fewer waves
        (narrow_tiles_win): at the one-GPU grid on H200 and H100 this rule's tiling read 1.003x
        the best screened one in geometric mean, 1.075x at worst (docs/perf-log.md).
        warp_specialized: the call may take the warp-specialized kernel (a bf16 / fp16 call on
        Hopper; the launcher decides), which it then does where on_warp_specialized_kernel says."""
        if narrow_tiles_win(world * cdiv(rows_per_rank, 128), n, sms):
            config = AllGatherMatmulConfig(block_n=128, num_warps=4, num_stages=5)
        else:
            config = AllGatherMatmulConfig()
        if warp_specialized:
            config = config.on_warp_specialized_kernel()
        return config.with_communication_heuristic(rows_per_rank)

    @staticmethod
    @functools.cache
    def heuristic_fp8(rows_per_rank: int, n: int, k: int, world: int, precise_acc: bool, sms: int = HOPPER_SMS,
                      warp_specialized: bool = False, out_bytes: int = 2) -> AllGatherMatmulConfig:  # fmt: skip
        """The scaled (FP8) ops' tiling (fp8_tiling), the same copy chunks as heuristic().
        warp_specialized: the call may take the warp-specialized kernel (Hopper; the launcher
        decides), which it then does in its tiling for the call's accumulation and output
        (out_bytes: the output dtype's size). A fast call stays on Triton where neither of its
        tilings there fits: 128x128 tiles where they win (narrow_tiles_win) beside a 2-byte output,
        128x256 ones where they fill a wave beside it (at llama3-8b TP=8 1024 tokens, 0.4 of a
        wave, they took 1.62x torch._scaled_mm against Triton's narrow tiles' 1.28). On
        Triton a float32 output takes 128x128 tiles: the 128x256 ones' float32 epilogue asked for
        272 KiB of shared memory (Triton 3.6, one H100: OutOfResources at the launch)."""
        tile_rows = world * cdiv(rows_per_rank, 128)
        narrow = narrow_tiles_win(tile_rows, n, sms)
        two_byte = out_bytes <= 2
        fast_fits = two_byte and tile_rows * cdiv(n, 256) >= sms
        if warp_specialized and (precise_acc or fast_fits or narrow and two_byte):
            if narrow and two_byte:
                # Where 128x256 tiles leave their last wave mostly empty (narrow_tiles_win): six stages
                # of 128x128 beside a 2-byte output's staging, in bands of four row tiles, either
                # accumulation. Precise: one H100's tune of the FP8 all-gather grid screened it within
                # 1.1% of the best of six stage / band choices in geomean (worst 1.07); fast: 0.80-1.03x
                # the 128x256 tiling's time at 23 untuned shapes on one H200 (docs/perf-log.md).
                tiling = {**WARP_SPECIALIZED_FP8_TILING, **WARP_SPECIALIZED_FP8_TWO_BYTE_OUTPUT}
            elif precise_acc:
                # Wide tiles (column halves) where they fill their waves; a 4-byte output's staging
                # leaves room for 128x128 tiles only.
                wide = {**WARP_SPECIALIZED_FP8_WIDE_PRECISE_TILING, "group_m": 4}
                tiling = wide if two_byte else WARP_SPECIALIZED_FP8_TILING
            else:
                tiling = WARP_SPECIALIZED_FP8_FAST_TILING
            return AllGatherMatmulConfig(**tiling, warp_specialized=True).with_communication_heuristic(rows_per_rank)
        return AllGatherMatmulConfig(**fp8_tiling(precise_acc, narrow or out_bytes > 2)).with_communication_heuristic(
            rows_per_rank)

    def with_fp8_output(self, out_bytes: int) -> AllGatherMatmulConfig | None:
        """This FP8 warp-specialized config for an output of out_bytes a value, or None where it
        cannot take it: FP8 tables are tuned with a bf16 output, whose staging leaves room for up
        to six 32 KiB stages of 128x128 tiles or four 48 KiB ones of 128x256; a float32 output's
        for four of 128x128 and none of 128x256 tiles (as heuristic_fp8)."""
        if out_bytes <= 2:
            return self
        if self.block_n > WARP_SPECIALIZED_FP8_TILING["block_n"]:
            return None
        return dataclasses.replace(self, num_stages=min(self.num_stages, WARP_SPECIALIZED_FP8_TILING["num_stages"]))

    def on_warp_specialized_kernel(self) -> AllGatherMatmulConfig:
        """This bf16 / fp16 config on the warp-specialized kernel where that measured faster: a
        128x256x64 tiling (3 stages, what fits beside its staging); any other config as it is.
        One H100's tune screen of the all-gather grid (bf16, fp16, TP 2/4/8) took 0.980 / 0.999 /
        0.985 / 0.981 / 0.981x the Triton kernel's time in geometric mean at 1024 ... 16384 tokens;
        its 128x128 tiling lost to Triton's (1.05x; docs/perf-log.md)."""
        if self.warp_specialized or (self.block_m, self.block_n, self.block_k) != (128, 256, 64):
            return self
        return dataclasses.replace(self, warp_specialized=True, num_stages=3)

    def as_entry(self) -> AllGatherMatmulConfig:
        """This config as launched, as a tuning table records it: without stream-K, which the
        launcher decides per call (with_stream_k_rule splits the tuned shape again, and at another
        M of the entry's bucket only where it pays), and at warps its Triton twin can run (the
        tiling's fallback where the warp-specialized kernel cannot: runnable)."""
        if not self.stream_k:
            return self
        return dataclasses.replace(self, stream_k=False, num_warps=triton_warps(self))

    def with_stream_k_rule(self, rows_per_rank: int, n: int, k: int, world: int, sms: int = HOPPER_SMS,
                           fp8: bool = False) -> AllGatherMatmulConfig:  # fmt: skip
        """This tiling on the warp-specialized kernel with stream-K where that paid (stream_k_pays
        over sms - 1 programs; 128-row tiles), a Triton tiling moved there with as many of its
        stages as fit beside that kernel's staging; else this config as it is. For bf16 / fp16
        calls that may take the warp-specialized kernel (the launcher decides), and (fp8) fast FP8
        ones already on it."""
        if self.block_m != 128 or self.stream_k or (fp8 and not self.warp_specialized):
            return self
        tiles = world * cdiv(rows_per_rank, self.block_m) * cdiv(n, self.block_n)
        if not stream_k_pays(tiles, k, sms - 1, fp8):
            return self
        # num_warps as the kernel launches (4 a consumer warpgroup: Triton's 4 and 8 run alike there).
        config = dataclasses.replace(self, warp_specialized=True, stream_k=True, num_warps=4)
        while (not self.warp_specialized and config.num_stages > 2
               and smem_bytes("all_gather_matmul", config) + SMEM_RESERVE_BYTES > SMEM_LIMIT_BYTES):  # fmt: skip
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        return config

    def with_communication_heuristic(self, rows_per_rank: int) -> AllGatherMatmulConfig:
        """This tiling with the heuristic's copy chunks: the peers' rows in four chunks from 4096
        rows per rank on, else one (each chunk costs two host calls, a copy and a signal)."""
        pieces = 4 if rows_per_rank >= 4096 else 1
        chunk = max(self.block_m, cdiv(cdiv(rows_per_rank, pieces), self.block_m) * self.block_m)
        return dataclasses.replace(self, chunk_rows=chunk)

    def chunk_rows_for(self, rows_per_rank: int) -> int:
        rows = cdiv(max(self.chunk_rows, 1), self.block_m) * self.block_m
        return min(rows, cdiv(rows_per_rank, self.block_m) * self.block_m)


TRANSPORTS = ("push", "pull", "copy_engine")
# The copy engine's transport wants the SMs to have other tiles to compute while a band's
# copy runs: with a segment of rows of one wave of tiles or less it lost badly (1024x4096x14336,
# 64 tiles: 0.69x NCCL against push's 1.09x; docs/perf-log.md). Below two waves (H100 / H200:
# 132 SMs) the heuristic pushes; the shipped table has measured choices for its shapes.
MIN_COPY_ENGINE_TILES = 256
# Up to this many ranks: one copy stream pushes W-1 owners' bands one after another, which kept up
# at TP=2 (2x H200) but not at TP=4, where the 4x H200 tune measured push faster (docs/perf-log.md).
MAX_COPY_ENGINE_WORLD = 2


# Push and copy-engine reduce-scatters run on the reducer kernel from REDUCER_WORLD ranks on, FP8
# ones with precise accumulation from REDUCER_FP8_PRECISE_MIN_WORLD, fast ones from REDUCER_MIN_WORLD
# (and below it from REDUCER_FP8_FAST_MIN_ROWS rows a rank),
# and bf16 / fp16 ones from REDUCER_MIN_WORLD where the GEMM has REDUCER_MIN_WORK units of 128x256x64
# multiply-adds or more: below that at TP=4 its reduction's tail outweighs what it saves
# (MatmulReduceScatterConfig.on_reducer_kernel).
REDUCER_WORLD = 8
REDUCER_MIN_WORLD = 4
REDUCER_FP8_PRECISE_MIN_WORLD = 2
REDUCER_MIN_WORK = 20_000
# Fast FP8 ones with 2-byte partials take it below REDUCER_MIN_WORLD too from this many rows a rank:
# at TP=2 and 4096-8192 rows a rank its time was 0.945-0.981x the Triton kernel's at the grid's 8
# cases on one H100, and H200's tune moved all 8 there (0.88-0.975x); below, 0.985-1.22x on H100.
REDUCER_FP8_FAST_MIN_ROWS = 4096
# The reducer kernel's bf16 / fp16 tiling (its shared memory holds no more stages), with the
# num_warps and epilogue_split of its Triton twin (the kernel ignores both: one config a tiling).
REDUCER_TILING = {"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8, "epilogue_split": 4}
# The Triton reduce-scatter's bf16 / fp16 tiling where 128x256 tiles leave the grid mostly idle
# (narrow_tiles_win): one H200 at TP 2, 256-640 rows, 0.57-0.69x the wide tiles' time at grids of
# 32-64 of them, 1.09-1.19x at 80 (docs/perf-log.md, "Few tiles"). 8 warps: on 4 (as fast under
# Triton 3.6) Triton 3.8's ptxas spills.
NARROW_TILING = {"block_n": 128, "num_warps": 8, "num_stages": 5, "epilogue_split": 2}


def epilogue_split_for(block_n: int) -> int:
    """The Triton reduce-scatter's epilogue slices for tiles block_n wide: a 256-wide tile in 4,
    a narrower one in 2 (register pressure: MatmulReduceScatterConfig.epilogue_split)."""
    return 4 if block_n >= 256 else 2


@dataclass(frozen=True)
class MatmulReduceScatterConfig(GemmTiling):
    """How one fused GEMM+ReduceScatter call is launched; every rank must use the same one."""

    # How partial tiles reach their owners (see the kernel): "push", the SMs store them into the
    # owner's buffer; "pull", they store locally and the owner's SMs read them; "copy_engine", they
    # store locally and a copy stream pushes each finished band of group_m tile rows. On 2x H200
    # the copy engine's was the fastest at 17 of 20 tuned shapes (1-5%), and slow where a segment
    # has a wave of tiles or less (heuristic below; docs/perf-log.md).
    transport: str = "copy_engine"
    # The epilogue handles the tile in 1, 2 or 4 column slices: fewer live registers (ptxas for
    # sm_90, 8 warps: 128x256 spills at 1 slice, 208 registers at 4; 128x128: 128 at 2).
    epilogue_split: int = 4
    # The warp-specialized kernel (epilogue_split and num_warps ignored; a tile's flag counts two
    # arrivals): the reducer kernel, _matmul_reduce_scatter_reducer.py (push or copy engine), where
    # on_reducer_kernel() says.
    warp_specialized: bool = dataclasses.field(default=False, metadata={TABLE_OPTIONAL: True})

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")

    @property
    def copy_engine(self) -> bool:
        return self.transport == "copy_engine"

    @staticmethod
    def heuristic(m_total: int, n: int, k: int, world: int, sms: int = HOPPER_SMS) -> MatmulReduceScatterConfig:
        """128x256x64, 8 warps, 3 stages (at the one-GPU grid on H200 and H100 it read 1.000-1.007x
        the best screened tiling in geometric mean: docs/perf-log.md), NARROW_TILING where 128x128
        tiles win (narrow_tiles_win; measured at grids of half a wave of wide tiles or less); the copy engine's
        transport where a segment of rows has MIN_COPY_ENGINE_TILES tiles or more, else push."""
        config = MatmulReduceScatterConfig()
        if not config.fits_grid(m_total, n, sms):
            config = MatmulReduceScatterConfig(**NARROW_TILING)
        return config.with_communication_heuristic(m_total, n, world)

    def fits_grid(self, m_total: int, n: int, sms: int = HOPPER_SMS) -> bool:
        """Whether this tiling suits an [m_total, n] output as well as the heuristic's would: not
        the Triton kernel's bf16 / fp16 128x256 tiles where narrow tiles win. A table entry tuned
        at another M bucket that does not is launched as the heuristic instead."""
        wide = (self.block_m, self.block_n, self.block_k, self.warp_specialized) == (128, 256, 64, False)
        return not (wide and narrow_tiles_win(cdiv(m_total, self.block_m), n, sms))

    @staticmethod
    def heuristic_fp8(m_total: int, n: int, k: int, world: int, precise_acc: bool) -> MatmulReduceScatterConfig:
        """The scaled (FP8) ops' tiling (fp8_tiling; the narrow one's epilogue in 2 slices), the
        same transport rule as heuristic(): the Triton kernel's, which on_reducer_kernel moves to the
        reducer kernel where that measured faster."""
        tiling = fp8_tiling(precise_acc, narrow=False)
        config = MatmulReduceScatterConfig(**tiling, epilogue_split=epilogue_split_for(tiling["block_n"]))
        return config.with_communication_heuristic(m_total, n, world)

    @staticmethod
    def warp_specialized_fp8(m_total: int, n: int, world: int, precise_acc: bool = True, out_bytes: int = 2,
                             k: int = 0) -> MatmulReduceScatterConfig:  # fmt: skip
        """The warp-specialized (reducer) kernel's FP8 config for K k a rank (0: a GEMM too short for
        the precise wide tiling), with heuristic()'s transport rule (a call takes it by itself where
        on_reducer_kernel says)."""
        tiling = reducer_fp8_tiling(precise_acc, out_bytes, m_total, n, k)
        config = MatmulReduceScatterConfig(**tiling, epilogue_split=2, warp_specialized=True)
        return config.with_communication_heuristic(m_total, n, world)

    def on_reducer_kernel(self, world: int, m_total: int, n: int, k: int, fp8_precise: bool | None = None,
                          out_bytes: int = 2) -> MatmulReduceScatterConfig:  # fmt: skip
        """This config on the reducer kernel (warp-specialized, bf16 / fp16 on Hopper:
        fluxtp/kernels/_matmul_reduce_scatter_reducer.py) where it measured faster than the Triton
        kernel, else itself: push or copy engine, from REDUCER_WORLD ranks on, and from
        REDUCER_MIN_WORLD on for GEMMs of REDUCER_MIN_WORK tile K-blocks or more (one H100,
        GEMM-only, the four models at 1024-16384 tokens: 0.78-1.01x the Triton kernel's time at
        TP=8, 0.90-1.02x at TP=4 from 57k blocks; since its tail loads together, 0.97x at 28k blocks
        and 1.02-1.05x at 14k and 7k, and 1.00-1.04x at 14k and 7k after its tail went to four
        warps; docs/perf-log.md), in REDUCER_TILING. A scaled call (fp8_precise: its accumulation;
        out_bytes: its slots') in reducer_fp8_tiling: from TP=2 with precise accumulation, from
        TP=4 with fast (one H100, precise: 0.62-0.89x the Triton kernel's time at TP=8; at TP=4
        0.85-0.95 from 20k blocks, 0.90-0.98 below since the fifth stage; at TP=2 0.83-1.02, 0.91 in geomean; fast: 0.74-1.04
        at TP=8, 0.78-1.04 at TP=4, 0.935 in geomean; at TP=2 from REDUCER_FP8_FAST_MIN_ROWS rows a
        rank with 2-byte slots)."""
        if self.warp_specialized or self.transport == "pull":
            return self
        if fp8_precise is not None:
            min_world = REDUCER_FP8_PRECISE_MIN_WORLD if fp8_precise else REDUCER_MIN_WORLD
            many_rows = not fp8_precise and out_bytes <= 2 and m_total // world >= REDUCER_FP8_FAST_MIN_ROWS
            if world < min_world and not many_rows:
                return self
            tiling = reducer_fp8_tiling(fp8_precise, out_bytes, m_total, n, k)
            # epilogue_split as warp_specialized_fp8 writes it (the kernel ignores it): one config a tiling
            return dataclasses.replace(self, **tiling, epilogue_split=2, warp_specialized=True)
        work = cdiv(m_total, 128) * cdiv(n, 256) * cdiv(k, 64)
        if world < REDUCER_MIN_WORLD or (world < REDUCER_WORLD and work < REDUCER_MIN_WORK):
            return self
        return dataclasses.replace(self, **REDUCER_TILING, warp_specialized=True)

    def with_communication_heuristic(self, m_total: int, n: int, world: int) -> MatmulReduceScatterConfig:
        """This tiling with the heuristic's transport: the copy engine's up to MAX_COPY_ENGINE_WORLD
        ranks where a segment of rows has MIN_COPY_ENGINE_TILES tiles or more, else push."""
        tiles = cdiv(m_total // world, self.block_m) * cdiv(n, self.block_n)
        copy_engine = world <= MAX_COPY_ENGINE_WORLD and tiles >= MIN_COPY_ENGINE_TILES
        return dataclasses.replace(self, transport="copy_engine" if copy_engine else "push")


@dataclass(frozen=True)
class MatmulAllReduceConfig(GemmTiling):
    """How one one-shot GEMM+AllReduce call is launched; every rank must use the same one.

    Decode GEMMs stream the weight once (M is tiny): narrow tiles give every SM its own columns,
    and deep pipelines keep enough of the weight in flight."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_stages: int = 6
    num_warps: int = 4
    swap_ab: bool = True  # the tile as (w @ x^T)^T, so that small M is the MMA's narrow side (wgmma)

    @staticmethod
    def heuristic(m: int, n: int, k: int, world: int, sms: int = 132) -> MatmulAllReduceConfig:
        """Measured on 2x H200 under CUDA graphs at N 8192, k 14336 (docs/perf-log.md): swapped
        operands up to 64 rows (16: 61.7 us vs 63.0 unswapped; 32 rows: 63.3 vs 65.6), then
        128x64x128 tiles, 4 stages, 8 warps (128 rows: 79.7 us vs 84.0 with 64-wide K blocks).
        Where 64 columns a tile would give a program (of `sms`) a second tile, 128 columns in
        6 stages of 64-deep K blocks: at N 12288 and 16384 each program's second weight stream
        started from an empty pipeline (docs/perf-log.md, "GEMM+AllReduce at wider outputs")."""
        wide = cdiv(n, 64) > sms
        if m <= 64:
            block_m = max(16, 1 << (m - 1).bit_length())
            if wide:
                return MatmulAllReduceConfig(block_m=block_m, block_n=128, block_k=64, num_stages=6, swap_ab=True)
            return MatmulAllReduceConfig(block_m=block_m, swap_ab=True, num_stages=6 if block_m <= 32 else 5)
        # 8 warps: 4 would hold the whole tile's pointers and values (ptxas for sm_90).
        if wide:
            return MatmulAllReduceConfig(block_m=128, block_n=128, block_k=64, num_stages=6, num_warps=8, swap_ab=False)
        return MatmulAllReduceConfig(block_m=128, block_n=64, block_k=128, num_stages=4, num_warps=8, swap_ab=False)


# The all-reduce alone is one-shot (every rank pushes its whole tensor to every peer) up to this
# many bytes at up to this many ranks, NCCL's all-reduce beyond, in the fused backend and so in
# "auto": one-shot sends W-1 copies where NCCL's ring sends 2 (W-1) / W of one, so its reach
# shrinks with W. Measured under CUDA graphs on H200s (docs/perf-log.md): TP=2 faster up to 8 MB;
# TP=4 up to 1 MB, 0.79x NCCL's speed at 1.5 MB, 0.48x at 8 MB. More ranks are not measured: a
# quarter of TP=4's reach, about half the crossover that TP=4's costs a byte predict at TP=8.
ALL_REDUCE_ONE_SHOT_MAX_BYTES = {2: 8 << 20, 4: 1 << 20, 8: 256 << 10}


def by_ranks(table: dict[int, T], world: int) -> T:
    """A {ranks: value} table's value at `world` ranks: the entry of the fewest ranks at or above
    it (the most ranks' beyond)."""
    fits = [ranks for ranks in table if ranks >= world]
    return table[min(fits) if fits else max(table)]


def all_reduce_one_shot_max_bytes(world: int) -> int:
    """ALL_REDUCE_ONE_SHOT_MAX_BYTES at `world` ranks."""
    return by_ranks(ALL_REDUCE_ONE_SHOT_MAX_BYTES, world)


@dataclass(frozen=True)
class AllReduceConfig:
    """Tiles of fluxtp.all_reduce's one-shot kernel over the tensor viewed as rows of block_n."""

    block_m: int = 4
    block_n: int = 1024
    num_warps: int = 4  # 32 values a thread: 8x1024 spilled at 4 warps (ptxas for sm_90)


# ---------------------------------------------------------------- the tuner's search space

FUSED_OPS = ("all_gather_matmul", "matmul_reduce_scatter")  # the ops with a tunable fused kernel

# Shared memory per block on H100 and H200 (sm_90: 227 KiB opt-in); a little is left for the
# pipeline's mbarriers and alignment.
SMEM_LIMIT_BYTES = 227 * 1024
SMEM_RESERVE_BYTES = 1024
ELEMENT_BYTES = 2  # float16 / bfloat16 operands
# float32 accumulator registers per thread (BM*BN / threads) a tiling may need; sm_90 has 255
# registers per thread and the loop needs its own.
MAX_ACC_REGISTERS = 128
MAX_ACC_REGISTERS_UNSPLIT_EPILOGUE = 64  # reduce-scatter epilogue in one slice: 128x256 spills

TILES = ((128, 128), (128, 256), (256, 128))
BLOCK_KS = (64, 128)
WARPS = (4, 8)
STAGES = (3, 4, 5)
GROUP_MS = (4, 8, 16)
AG_CHUNK_PIECES = (1, 2, 4, 8)
RS_TRANSPORTS = ("copy_engine", "push", "pull")
RS_EPILOGUE_SPLITS = (1, 2, 4)


def config_class(op: str):
    if op == "all_gather_matmul":
        return AllGatherMatmulConfig
    if op == "matmul_reduce_scatter":
        return MatmulReduceScatterConfig
    raise ValueError(f"op {op!r} has no tunable fused kernel; choose one of {', '.join(FUSED_OPS)}")


def heuristic(op: str, m_total: int, n: int, k: int, world: int, warp_specialized: bool = False):
    """The config the launcher uses without a cache entry (global sizes, as the cache keys);
    warp_specialized: the all-gather may take its warp-specialized kernel (the launcher's
    warp_specialized_runs)."""
    cls = config_class(op)
    if op == "all_gather_matmul":
        return cls.heuristic(m_total // world, n // world, k, world, warp_specialized=warp_specialized)
    return cls.heuristic(m_total, n, k // world, world)


def smem_bytes(op: str, config) -> int:
    """Shared memory of one block: the operand pipeline plus the epilogue's staging tile.

    Pipeline: num_stages x (BM x BK + BN x BK) operand elements. Epilogue: all_gather_matmul
    stages the output tile for its TMA store (half of it when subtiled; the warp-specialized
    kernel both consumers' halves); matmul_reduce_scatter converts one float32 column slice
    (BN / epilogue_split) of the accumulator's layout.
    """
    c = config
    pipeline = c.num_stages * (c.block_m * c.block_k + c.block_n * c.block_k) * ELEMENT_BYTES
    if op == "all_gather_matmul":
        halves = 1 if c.warp_specialized or not c.epilogue_subtile else 2
        epilogue = c.block_m * c.block_n * ELEMENT_BYTES // halves if c.tma_store or c.warp_specialized else 0
    else:
        epilogue = c.block_m * (c.block_n // c.epilogue_split) * 4
    return pipeline + epilogue


def triton_warps(config) -> int:
    """The warps Triton's kernel runs `config`'s tiling on: a warp-specialized config's num_warps is
    not its own (that kernel runs 4 a consumer warpgroup), so enough for the accumulator at
    MAX_ACC_REGISTERS a thread (128x256 on 4 warps spilled: 9x the time)."""
    return max(config.num_warps, config.block_m * config.block_n // (32 * MAX_ACC_REGISTERS))


def fits(op: str, config) -> bool:
    """Whether the candidate fits shared memory and its accumulator fits the registers."""
    if smem_bytes(op, config) + SMEM_RESERVE_BYTES > SMEM_LIMIT_BYTES:
        return False
    acc = config.block_m * config.block_n // (32 * config.num_warps)
    if acc > MAX_ACC_REGISTERS:
        return False
    unsplit = op == "matmul_reduce_scatter" and config.epilogue_split == 1
    return not (unsplit and acc > MAX_ACC_REGISTERS_UNSPLIT_EPILOGUE)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _chunk_rows(rows_per_rank: int, pieces: int, block_m: int) -> int:
    """Rows per copy chunk for `pieces` chunks per rank (the heuristic's own rounding)."""
    return max(block_m, _ceil_to(-(-rows_per_rank // pieces), block_m))


def candidates(op: str, m_total: int, n: int, k: int, world: int, warp_specialized: bool = False) -> list:
    """Every config of the space that fits, in enumeration order, without duplicates.
    warp_specialized: the op may take its warp-specialized kernel (a bf16 / fp16 call on Hopper):
    the all-gather's each 128-row tiling of 64-deep stages there too, at the warps of Triton's
    tiling of that shape (the kernel's own warps ignore num_warps, so one twin a tiling); the
    reduce-scatter's reducer kernel in REDUCER_TILING, each band, push or the copy engine."""
    cls = config_class(op)
    out = []
    for (bm, bn), bk, warps, stages, group_m in itertools.product(TILES, BLOCK_KS, WARPS, STAGES, GROUP_MS):
        tiling = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages, "group_m": group_m}
        if op == "all_gather_matmul":
            rows = m_total // world
            chunks = dict.fromkeys(_chunk_rows(rows, p, bm) for p in AG_CHUNK_PIECES)
            twin = warp_specialized and (bm, bk, warps) == (128, 64, bn // 32)
            kernels = (False, True) if twin else (False,)
            variants = [cls(**tiling, chunk_rows=c, warp_specialized=ws) for c in chunks for ws in kernels]
        else:
            variants = [
                cls(**tiling, transport=transport, epilogue_split=split)
                for transport, split in itertools.product(RS_TRANSPORTS, RS_EPILOGUE_SPLITS)
            ]
        out.extend(v for v in variants if fits(op, v))
    if warp_specialized and op == "matmul_reduce_scatter":
        transports = [t for t in RS_TRANSPORTS if t != "pull"]
        out.extend(cls(**REDUCER_TILING, group_m=g, transport=t, warp_specialized=True)
                   for g in GROUP_MS for t in transports)  # fmt: skip
    return list(dict.fromkeys(out))


def search_space(op: str, m_total: int, n: int, k: int, world: int, warp_specialized: bool = False) -> list:
    """The candidates in the order the tuner tries them: the heuristic's config first, then by
    how many fields differ from it (neighbours first), ties in enumeration order
    (warp_specialized: as for candidates and heuristic)."""
    base = heuristic(op, m_total, n, k, world, warp_specialized)
    space = candidates(op, m_total, n, k, world, warp_specialized)
    if base not in space:
        space.insert(0, base)  # the baseline is always measured
    fields = [f.name for f in dataclasses.fields(base)]

    def distance(c) -> int:
        return sum(getattr(c, f) != getattr(base, f) for f in fields)

    order = {c: i for i, c in enumerate(space)}
    return sorted(space, key=lambda c: (distance(c), order[c]))


def describe(config) -> str:
    """A short human form: 128x256x64 w8 s3 g8 (warp-specialized: "ws" for the warps; "stream-K"
    where its last partial wave is split by K) plus the op's own knobs."""
    c = config
    warps = "ws" if getattr(c, "warp_specialized", False) else f"w{c.num_warps}"
    text = f"{c.block_m}x{c.block_n}x{c.block_k} {warps} s{c.num_stages} g{c.group_m}"
    if getattr(c, "stream_k", False):
        text += " stream-K"
    if hasattr(c, "chunk_rows"):
        return text + f" chunk_rows={c.chunk_rows}"
    return text + f" {c.transport} epilogue_split={c.epilogue_split}"

