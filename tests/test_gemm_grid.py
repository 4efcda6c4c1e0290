"""The GEMM grid, the one-GPU tuner's search space and records, the tile-width rule, and the
shipped tables' coverage of the grid (CPU only: the timing itself needs a GPU)."""

import dataclasses
import types

import pytest
import torch

from fluxtp import cli, tune, tune_gemm
from fluxtp.configs import AllGatherMatmulConfig, MatmulReduceScatterConfig, narrow_tiles_win
from fluxtp.bench.gemm_grid import GRIDS, GemmCase, case_inputs, expected_rows, gathered, grid, parse_cases

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
SHIPPED_GPUS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def test_full_grid_covers_both_ops_every_tp_degree_model_and_dtype():
    cases = grid("full")
    assert len(cases) == len(set(cases)) == 2 * 3 * 4 * 5 * 2 + 2 * 3 * 5
    assert {(c.op, c.world, c.dtype) for c in cases} == {
        (op, w, d) for op in (AG, RS) for w in (2, 4, 8) for d in ("bfloat16", "float16")
    }
    transposed = [c for c in cases if c.weight_layout == "transposed"]
    assert {c.model for c in transposed} == {"llama3-70b"} and len(transposed) == 30
    for name in GRIDS:
        assert grid(name)
    with pytest.raises(ValueError, match="unknown grid 'nope'"):
        grid("nope")


def test_case_shapes_follow_the_ops_sharding_and_any_multiple_of_w_works():
    ag = GemmCase(AG, 3000, 14336, 4096, 8)  # 375 rows per rank: not a tile multiple
    assert ag.shard_shapes == ((375, 4096), (1792, 4096)) and ag.gemm_shape == (3000, 1792, 4096)
    rs = GemmCase(RS, 3000, 4096, 14336, 8)
    assert rs.shard_shapes == ((3000, 1792), (4096, 1792)) and rs.flops == 2 * 3000 * 4096 * 1792
    with pytest.raises(ValueError, match="M=1001 must be divisible by the TP degree 8"):
        GemmCase(AG, 1001, 14336, 4096, 8)
    with pytest.raises(ValueError, match="K=100 must be divisible"):
        GemmCase(RS, 1024, 4096, 100, 8)
    with pytest.raises(ValueError, match="dtype"):
        GemmCase(AG, 1024, 4096, 4096, 2, dtype="float32")
    assert parse_cases("ag:1024x8x16,rs:64x8x16", 2) == [GemmCase(AG, 1024, 8, 16, 2), GemmCase(RS, 64, 8, 16, 2)]
    with pytest.raises(ValueError, match="op:MxNxK"):
        parse_cases("xx:1x2x3", 2)


@pytest.mark.parametrize("layout", ["linear", "transposed"])
def test_case_inputs_are_random_in_the_cases_layout(layout):
    case = GemmCase(RS, 48, 32, 64, 2, "float16", layout)
    x, w = case_inputs(case, "cpu")
    assert x.shape == (48, 32) and w.shape == (32, 32) and x.dtype == w.dtype == torch.float16
    assert (w.stride(0) == 1) == (layout == "transposed")
    assert x.abs().min() >= 0 and x.float().std() > 0.5 and w.float().std() > 0  # never zeros
    ag = GemmCase(AG, 48, 32, 64, 2)
    xs, _ = case_inputs(ag, "cpu")
    assert torch.equal(gathered(ag, xs), torch.cat([xs, xs])) and gathered(case, x) is x
    full = torch.randn(48, 32)
    assert expected_rows(case, full).shape == (24, 32) and expected_rows(ag, full) is full


@pytest.mark.parametrize(
    "tile_rows, n, narrow",
    [
        (8, 1792, True),  # 56 wide tiles: under half a wave of 132; 112 narrow ones fill one
        (32, 3584, True),  # 448 wide tiles = 4 waves (3.4); 896 narrow = 7 waves of half the cost
        (8, 3584, False),  # 112 wide tiles: one wave either way
        (16, 3584, False),  # 224 wide = 2 waves; 448 narrow = 4 waves
        (128, 3584, False),  # 1792 wide = 14 waves (13.6); 3584 narrow = 28 waves
    ],
)
def test_tile_width_follows_wave_quantization(tile_rows, n, narrow):
    assert narrow_tiles_win(tile_rows, n) is narrow
    config = AllGatherMatmulConfig.heuristic(tile_rows * 128 // 8, n, 8192, 8)
    assert (config.block_n, config.num_warps, config.num_stages) == ((128, 4, 5) if narrow else (256, 8, 3))


def test_wide_bf16_all_gather_tiles_move_to_the_warp_specialized_kernel():
    """128x256x64 tilings take the warp-specialized kernel (3 stages) at any number of rows;
    other tilings and configs already on it stay as they are. The launcher asks only where the
    kernel runs: a CPU call keeps the Triton kernel."""
    from fluxtp.backends.fused._all_gather_matmul import _config_for

    wide = AllGatherMatmulConfig(num_stages=4)
    moved = wide.on_warp_specialized_kernel()
    assert moved == dataclasses.replace(wide, warp_specialized=True, num_stages=3)
    narrow = AllGatherMatmulConfig(block_n=128, num_warps=4, num_stages=5)
    assert narrow.on_warp_specialized_kernel() is narrow
    assert moved.on_warp_specialized_kernel() is moved
    wide_heuristic = AllGatherMatmulConfig.heuristic(1024, 28672 // 8, 8192, 8)
    assert wide_heuristic.block_n == 256
    assert AllGatherMatmulConfig.heuristic(1024, 28672 // 8, 8192, 8, warp_specialized=True) == dataclasses.replace(
        wide_heuristic, warp_specialized=True
    )
    x, w = torch.zeros(4096, 64, dtype=torch.bfloat16), torch.zeros(8192, 64, dtype=torch.bfloat16)
    assert not _config_for(x, w, 2, None).warp_specialized


def test_reduce_scatter_heuristic_is_the_wide_tile_but_in_grids_of_half_a_wave_or_less():
    """128x256 tiles from a wave of them on (every grid case), 128x128 ones (NARROW_TILING) where
    those fit in the one wave that the wide ones would leave at least half idle."""
    for m in (1024, 4096, 16384):
        config = MatmulReduceScatterConfig.heuristic(m, 8192, 3584, 8)
        assert (config.block_m, config.block_n, config.num_warps, config.num_stages) == (128, 256, 8, 3)
    wide = MatmulReduceScatterConfig.heuristic(512, 8192, 14336, 2)  # 4 x 32 = 128 wide tiles
    assert (wide.block_n, wide.fits_grid(512, 8192)) == (256, True)
    for m, n in ((256, 4096), (512, 4096), (256, 8192), (640, 3072)):  # 32, 64, 64 and 60 wide tiles
        narrow = MatmulReduceScatterConfig.heuristic(m, n, 7168, 2)
        assert (narrow.block_m, narrow.block_n, narrow.num_warps, narrow.num_stages, narrow.epilogue_split) == (
            128, 128, 8, 5, 2)
        assert narrow.fits_grid(m, n) and not MatmulReduceScatterConfig().fits_grid(m, n)
        assert narrow.transport == "push"  # a single wave: the copy engine's bands would wait for it
    assert MatmulReduceScatterConfig.heuristic(256, 10240, 7168, 2).block_n == 256  # 80: narrow takes 2 waves


def test_one_gpu_candidates_fit_start_at_the_heuristic_and_keep_its_communication_rule():
    for case in (GemmCase(AG, 8192, 28672, 8192, 8), GemmCase(RS, 1024, 8192, 28672, 4)):
        space = tune_gemm.candidates(case)
        assert space[0] == tune_gemm.heuristic_config(case) and len(space) == len(set(space)) >= 6
        assert all(tune.fits(case.op, c) for c in space)
        for c in space:  # the comm knobs are the heuristic's for that very tiling
            assert c == tune_gemm.with_communication_heuristic(case, c)
        assert {c.block_m for c in space} >= {64, 128, 256}


def test_one_gpu_candidates_add_the_warp_specialized_all_gather_where_it_runs():
    """Where a case may take the warp-specialized kernel, its 128x256 and 128x128 tilings are
    screened beside Triton's (every Triton tiling says so: warp_specialized=False), and the
    baseline is what an untuned call launches there (a 128x256 heuristic on it)."""
    ag = GemmCase(AG, 8192, 28672, 8192, 8)
    triton_only = tune_gemm.candidates(ag)
    space = tune_gemm.candidates(ag, warp_specialized=True)
    on_it = [c for c in space if c.warp_specialized]
    assert space[0] == tune_gemm.heuristic_config(ag, True) and space[0].warp_specialized
    # 128x128 tiles leave the 14th wave 0.68 full: every 128x128 tiling, Triton's too, is screened
    # as it launches, on the warp-specialized kernel with stream-K (Triton's 4- and 8-warp 4-stage
    # ones launch alike there: one candidate).
    assert {(c.block_n, c.block_k, c.num_stages, c.stream_k) for c in on_it} == {
        (256, 64, 3, False), (128, 64, 4, True), (128, 64, 5, True), (128, 128, 3, True)}  # fmt: skip
    kept = [c for c in space if not c.warp_specialized]
    assert kept == [c for c in triton_only if c.block_n != 128 or c.block_m != 128]
    assert all(tune.fits(AG, c) for c in space) and len(space) == len(set(space)) == len(kept) + 4
    assert len({tune.describe(c) for c in space}) == len(space)  # the screen's record is keyed by it
    # Where the heuristic's own tiling splits its last wave (llama3-405b TP=8, 16384 tokens), the
    # other tilings take stream-K only where the rule gives it to them, Triton's never.
    split = tune_gemm.candidates(GemmCase(AG, 16384, 53248, 16384, 8), warp_specialized=True)
    assert split[0].stream_k and all(c.warp_specialized for c in split if c.stream_k)
    assert any(not c.warp_specialized for c in split) and len(split) == len(set(split))
    narrow = GemmCase(AG, 1024, 14336, 4096, 8)  # the heuristic's 128x128 stays on Triton; both screened
    assert not tune_gemm.candidates(narrow, warp_specialized=True)[0].warp_specialized
    assert sum(c.warp_specialized for c in tune_gemm.candidates(narrow, warp_specialized=True)) == 2


def test_one_gpu_candidates_of_a_reduce_scatter_are_as_launched_with_the_reducer_kernel_in_every_band():
    """A bf16 / fp16 reduce-scatter's candidates are what a call launches from a table entry of
    them: where the GPU runs the reducer kernel, the Triton tilings that on_reducer_kernel moves
    there (TP=8; TP=4 from REDUCER_MIN_WORK) are that kernel's, and its tiling is screened in each
    band of GROUP_MS beside them (at TP=2 too, where no Triton tiling moves); a launch of each is
    the candidate itself, so the tune measures what its entry launches."""
    from fluxtp.backends.fused._matmul_reduce_scatter import routed
    from fluxtp.configs._classes import GROUP_MS, REDUCER_TILING

    on_reducer = {(*REDUCER_TILING.values(), g) for g in GROUP_MS}

    def tilings(space):
        return {(c.block_m, c.block_n, c.block_k, c.num_stages, c.num_warps, c.epilogue_split, c.group_m)
                for c in space if c.warp_specialized}  # fmt: skip

    for dtype in ("bfloat16", "float16"):
        tp8 = GemmCase(RS, 1024, 4096, 14336, 8, dtype)
        space = tune_gemm.candidates(tp8, warp_specialized=True)
        assert space[0] == tune_gemm.heuristic_config(tp8, True) and space[0].warp_specialized
        assert all(c.warp_specialized for c in space) and tilings(space) == on_reducer and len(space) == 3
        small_tp4 = GemmCase(RS, 1024, 4096, 14336, 4, dtype)  # 8 x 16 x 56 blocks: Triton's stay
        space = tune_gemm.candidates(small_tp4, warp_specialized=True)
        assert not space[0].warp_specialized and tilings(space) == on_reducer
        assert [c for c in space if not c.warp_specialized] == tune_gemm.candidates(small_tp4)
        for case in (tp8, small_tp4, GemmCase(RS, 8192, 4096, 14336, 2, dtype, "transposed")):
            space = tune_gemm.candidates(case, warp_specialized=True)
            (_, k), (n, _) = case.shard_shapes
            assert all(routed(c, case.M, n, k, case.world, 2, True) == c for c in space)
            assert len(space) == len(set(space)) == len({tune.describe(c) for c in space})
            for c in space:
                assert c == tune_gemm.with_communication_heuristic(case, c)
    # Where the GPU does not run it, the Triton tilings as they are (none moves).
    rs = GemmCase(RS, 8192, 8192, 28672, 8)
    assert not any(c.warp_specialized for c in tune_gemm.candidates(rs)) and len(tune_gemm.candidates(rs)) == 8


def test_one_gpu_candidates_of_an_fp8_all_gather_are_its_stages_and_bands_on_the_warp_specialized_kernel():
    """An FP8 all-gather (precise accumulation) screens the warp-specialized kernel's 128x128x128
    tiling at 4-6 stages in bands of 4 or 8 row tiles and its 128x256x128 one (the accumulator in
    column halves, 4 stages) in either band, the heuristic's first; where the GPU cannot run that
    kernel there is nothing to screen."""
    case = GemmCase(AG, 4096, 28672, 8192, 8, "float8_e4m3fn")
    base = tune_gemm.heuristic_config(case, True)
    assert base == AllGatherMatmulConfig.heuristic_fp8(512, 3584, 8192, 8, True, warp_specialized=True)
    assert base.block_n == 128  # 448 wide tiles: 3.4 waves, the narrow ones take fewer
    space = tune_gemm.candidates(case, warp_specialized=True)
    assert space[0] == base and len(space) == len(set(space)) == 8
    assert {(c.block_n, c.num_stages, c.group_m) for c in space} == {
        *((128, s, g) for s in (4, 5, 6) for g in (4, 8)), (256, 4, 4), (256, 4, 8)}  # fmt: skip
    assert all(c.warp_specialized and (c.block_m, c.block_k) == (128, 128) for c in space)
    assert all(c.chunk_rows == base.chunk_rows for c in space)
    assert tune_gemm.candidates(case) == [tune_gemm.heuristic_config(case)]
    # Fast accumulation: its 128x256x128 tiling in either band beside them, under its own key (the
    # heuristic's narrow tiles first, as the precise call's).
    fast = dataclasses.replace(case, fast_accum=True)
    fast_space = tune_gemm.candidates(fast, warp_specialized=True)
    assert fast_space[0] == tune_gemm.heuristic_config(fast, True) and (fast_space[0].block_n, fast_space[0].num_stages) == (128, 6)
    assert {(c.block_n, c.num_stages, c.group_m) for c in fast_space} == {
        *((128, s, g) for s in (4, 5, 6) for g in (4, 8)), (256, 3, 4), (256, 3, 8)}  # fmt: skip
    assert tune_gemm.case_key(fast, "H").dtype == "float8_e4m3fn+fast_accum" and tune_gemm.case_key(case, "H").dtype == "float8_e4m3fn"
    assert fast.label().endswith(" fast")
    # As launched: where the rule splits the last wave by K (gpt3-175b TP=8, 16384 tokens: 128x256
    # tiles leave it 0.45 full, 128x128 ones 0.90), those candidates carry stream-K.
    split = GemmCase(AG, 16384, 49152, 12288, 8, "float8_e4m3fn", fast_accum=True)
    split_space = tune_gemm.candidates(split, warp_specialized=True)
    assert {c.block_n for c in split_space if c.stream_k} == {256}
    assert any(c.block_n == 128 for c in split_space) and len(split_space) == len(set(split_space))
    with pytest.raises(ValueError, match="FP8 case's choice"):
        GemmCase(AG, 4096, 28672, 8192, 8, fast_accum=True)


def test_one_gpu_candidates_of_an_fp8_reduce_scatter_are_the_reducer_kernels_tilings_that_fit():
    """An FP8 reduce-scatter screens the reducer kernel's 128x128x128 tiling at the stages that fit
    beside bf16 partials in bands of 4 or 8 row tiles, and the 128x256x128 one of its accumulation
    in either band, the heuristic as launched first (on the reducer kernel where it goes); where the
    heuristic keeps the Triton kernel (fast accumulation at TP=2), that kernel's FP8 tilings too;
    where the GPU runs neither warp-specialized kernel there is nothing to screen."""
    from fluxtp.backends.fused._matmul_reduce_scatter import reducer_fits
    from fluxtp.backends.fused._scaled import Scaled

    case = GemmCase(RS, 4096, 8192, 28672, 8, "float8_e4m3fn")
    base = tune_gemm.heuristic_config(case, True)
    assert base.warp_specialized and base == MatmulReduceScatterConfig.heuristic_fp8(4096, 8192, 3584, 8, True).on_reducer_kernel(
        8, 4096, 8192, 3584, True)  # fmt: skip
    space = tune_gemm.candidates(case, warp_specialized=True)
    assert space[0] == base and len(space) == len(set(space)) and len({tune.describe(c) for c in space}) == len(space)
    assert all(c.warp_specialized and (c.block_m, c.block_k) == (128, 128) for c in space)
    assert {(c.block_n, c.group_m) for c in space} == {(128, 4), (128, 8), (256, 4), (256, 8)}
    assert all(reducer_fits(c, 8192, 8, 1, Scaled(torch.bfloat16, True, True)) for c in space)
    assert {c.num_stages for c in space if c.block_n == 128} <= {4, 5, 6} and {c.num_stages for c in space if c.block_n == 256} == {4}
    for c in space:  # the transport is the heuristic's for that very tiling
        assert c == tune_gemm.with_communication_heuristic(case, c)
    assert tune_gemm.candidates(case) == [tune_gemm.heuristic_config(case)] and not space[0] == tune_gemm.heuristic_config(case)
    fast = GemmCase(RS, 4096, 8192, 28672, 2, "float8_e4m3fn", fast_accum=True)
    fast_space = tune_gemm.candidates(fast, warp_specialized=True)
    assert not fast_space[0].warp_specialized and (fast_space[0].block_n, fast_space[0].num_stages) == (256, 3)
    assert {(c.block_n, c.num_stages) for c in fast_space if not c.warp_specialized} == {(256, 3), (128, 4)}
    assert {(c.block_n, c.num_stages) for c in fast_space if c.warp_specialized} >= {(128, 4), (256, 3)}
    assert len(fast_space) == len(set(fast_space)) and tune_gemm.case_key(fast, "H").dtype == "float8_e4m3fn+fast_accum"


def test_compile_jobs_name_each_distinct_kernel_once():
    cases = [GemmCase(AG, m, 28672, 8192, 2) for m in (1024, 4096, 8192)]
    jobs = tune_gemm._compile_jobs(cases)
    # chunk_rows is a runtime argument: the three M share every kernel, compiled on the smallest
    assert {case.M for case, _ in jobs} == {1024}
    tilings = {dataclasses.replace(c, chunk_rows=0) for c in tune_gemm.candidates(cases[0])}
    assert len(jobs) == len(tilings)


def test_tuned_entries_carry_what_shipping_requires_and_are_not_taken_for_multi_gpu_ones():
    case = GemmCase(RS, 2048, 8192, 28672, 8, "float16", "transposed")
    config = tune_gemm.heuristic_config(case)
    result = tune_gemm.CaseResult(case, config, config, {"cublas": 1.0, "heuristic": 1.2, "tuned": 1.1}, {}, 7, [], [])
    entry = tune_gemm.entry_of(result, "NVIDIA H200")
    assert entry.key == tune.Key("NVIDIA H200", 8, "float16", RS, 8192, 28672, 2048, "transposed")
    assert set(tune.SHIPPED_MEASURED_FIELDS) <= set(entry.measured) and entry.measured["mode"] == "gemm_only"
    assert "nccl_ms" not in entry.measured  # so "auto" does not read a GEMM-only time as an op's
    row = tune_gemm.result_row(result)
    assert row["tuned_vs_cublas"] == 1.1 and row["world"] == 8


@pytest.mark.parametrize("gpu", SHIPPED_GPUS)
def test_shipped_table_answers_every_grid_case_with_an_exact_entry(gpu):
    entries, problem = tune.load(shipped=True)
    assert problem is None
    for case in grid("full"):
        key = tune_gemm.case_key(case, gpu)
        assert key in entries, f"{gpu}: no shipped entry for {case.label()}"
        assert tune.fits(case.op, entries[key].config)


@pytest.mark.parametrize("fast_accum", [False, True])
def test_shipped_table_answers_every_fp8_all_gather_of_the_grid_on_h100(fast_accum):
    """The FP8 all-gathers' tilings tuned on one H100, per accumulation: every case of the
    fp8-all-gather grid has its exact entry (precise ones on the warp-specialized kernel)."""
    entries, _ = tune.load(shipped=True)
    for case in grid("fp8-all-gather"):
        case = dataclasses.replace(case, fast_accum=fast_accum)
        entry = entries.get(tune_gemm.case_key(case, "NVIDIA H100 80GB HBM3"))
        assert entry is not None, f"no shipped entry for {case.label()}"
        assert entry.measured["mode"] == "gemm_only" and (fast_accum or entry.config.warp_specialized)


@pytest.mark.parametrize("fast_accum", [False, True])
def test_shipped_table_answers_every_fp8_reduce_scatter_of_the_grid_on_h200(fast_accum):
    """The FP8 reduce-scatters' tilings tuned on one H200, per accumulation: every case of the
    fp8-reduce-scatter grid has its exact entry, each on a kernel its call can take with a bf16
    output (the reducer kernel's within its shared memory)."""
    from fluxtp.backends.fused._matmul_reduce_scatter import reducer_fits
    from fluxtp.backends.fused._scaled import Scaled

    entries, _ = tune.load(shipped=True)
    for case in grid("fp8-reduce-scatter"):
        case = dataclasses.replace(case, fast_accum=fast_accum)
        entry = entries.get(tune_gemm.case_key(case, "NVIDIA H200"))
        assert entry is not None, f"no shipped entry for {case.label()}"
        assert entry.measured["mode"] == "gemm_only"
        (_, _), (n, _) = case.shard_shapes
        config = entry.config
        assert not config.warp_specialized or reducer_fits(config, n, case.world, 1, Scaled(torch.bfloat16, True, not fast_accum))
        assert tune_gemm.with_communication_heuristic(case, config) in tune_gemm.candidates(case, warp_specialized=True)


def test_cli_one_gpu_mode_checks_its_options_and_needs_a_gpu(capsys):
    def fluxtp(*args):
        """`fluxtp ARGS` in this process (as the console script calls it): its exit status and stderr."""
        try:
            returncode = cli.main(list(args))
        except SystemExit as exit_:
            returncode = exit_.code
        return types.SimpleNamespace(returncode=returncode, stderr=capsys.readouterr().err)

    proc = fluxtp("tune", "--one-gpu")
    assert proc.returncode == 2 and "--one-gpu needs --grid, or --op and --shapes" in proc.stderr
    proc = fluxtp("tune", "--one-gpu", "--grid", "nope")
    assert proc.returncode == 2 and "unknown grid 'nope'" in proc.stderr
    proc = fluxtp("tune", "--one-gpu", "--grid", "smoke", "--fast-accum")
    assert proc.returncode == 2 and "--fast-accum: FP8 cases only" in proc.stderr
    proc = fluxtp("tune", "--op", AG, "--shapes", "1024x4096x4096", "--dtype", "float8_e4m3fn")
    assert proc.returncode == 2 and "FP8 GEMMs: --one-gpu" in proc.stderr
    proc = fluxtp("tune")
    assert proc.returncode == 2 and "--op and --shapes are required" in proc.stderr
    if not torch.cuda.is_available():
        for grid_name in ("smoke", "fp8-smoke"):  # FP8 reduce-scatters included
            proc = fluxtp("tune", "--one-gpu", "--grid", grid_name)
            assert proc.returncode == 2 and "need NVIDIA GPUs" in proc.stderr


def test_a_tiling_replaces_the_heuristics_only_on_a_clear_lead():
    names = ("heuristic", "f1", "f2")
    lead = 1 / tune_gemm.MIN_GAIN
    assert tune_gemm.winner_of({"heuristic": 1.0, "f1": 0.995, "f2": 1.2}, names) == "heuristic"
    assert tune_gemm.winner_of({"heuristic": 1.0, "f1": 1.1, "f2": lead * 0.999}, names) == "f2"
    assert tune_gemm.winner_of({"heuristic": 1.0, "f1": 1.0, "f2": 1.1}, names) == "heuristic"  # a tie keeps it
    # ... and its lead must hold in the second measurement of the two alone.
    assert tune_gemm.confirmed({"heuristic": 1.0, "f2": lead * 0.999}, "f2")
    assert not tune_gemm.confirmed({"heuristic": 1.0, "f2": 0.995}, "f2")
    assert tune_gemm.confirmed({"heuristic": 1.0}, "heuristic")
