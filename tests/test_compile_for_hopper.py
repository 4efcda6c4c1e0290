"""The fused kernels compile for sm_90 without a GPU, launched as the ops launch them: a kernel
change that Gluon, Triton or ptxas rejects, or a heuristic's tiling that does not fit shared
memory, fails here on CPU, before device time. Each case captures the Launch its op's GEMM-only
mode makes (CPU tensors, 132 SMs), then compiles it offline (Triton's GluonASTSource or ASTSource
with an explicit target) and checks its shared memory. Every compile here also fails where ptxas
serializes a kernel's wgmma (its warning C7512: the MMAs one at a time, several times slower).

Skipped where this Triton cannot compile Gluon offline (no GluonASTSource; 3.6, 3.8 and 3.9 have it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import io
import itertools
import multiprocessing
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
if not hasattr(_runtime, "GluonASTSource"):
    pytest.skip("this Triton compiles Gluon only through a GPU driver", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from fluxtp._dist import GroupInfo  # noqa: E402
from fluxtp.backends.fused import _all_gather_matmul as ag  # noqa: E402
from fluxtp.backends.fused import _launch, _scaled  # noqa: E402
from fluxtp.backends.fused import _matmul_reduce_scatter as rs  # noqa: E402
from fluxtp.configs import SMEM_LIMIT_BYTES, AllGatherMatmulConfig, MatmulReduceScatterConfig  # noqa: E402
from fluxtp.configs._classes import (  # noqa: E402
    REDUCER_FP8_WIDE_PRECISE_TILING,
    WARP_SPECIALIZED_FP8_TILING,
    WARP_SPECIALIZED_FP8_TWO_BYTE_OUTPUT,
)
from fluxtp.kernels import COMPILE_OPTIONS  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SMS = 132


@pytest.fixture
def captured_launch(monkeypatch):
    """The ops' GEMM-only modes on CPU tensors as on a 132-SM Hopper: each launch recorded, not run."""
    launches = []
    monkeypatch.setattr(_launch.Launch, "__call__", lambda self, *args: launches.append((self, args)))
    monkeypatch.setattr(_scaled, "pingpong_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(rs, "num_sms", lambda device: SMS)
    monkeypatch.setattr(ag, "num_sms", lambda device: SMS)
    return launches


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """What compiling a launch takes, picklable (for the sweep's worker processes): its kernel by
    module and name, the arguments' types as the JIT launcher mangles them, constexprs, options."""

    module: str
    kernel: str
    signature: tuple
    constexprs: tuple
    options: tuple

    @classmethod
    def of(cls, launch: _launch.Launch, args: tuple) -> CompileJob:
        names = launch.kernel.arg_names
        signature = {name: mangle_type(arg) for name, arg in zip(names, args)}
        constexprs = {name: None for name, kind in signature.items() if kind == "constexpr"}
        options = dict(COMPILE_OPTIONS)  # as every launch passes them
        for name, value in launch.constexprs.items():
            if name in names:
                signature[name], constexprs[name] = "constexpr", value
            if name not in names or name == "num_warps":
                options[name] = value
        return cls(launch.kernel.fn.__module__, launch.kernel.__name__, tuple(signature.items()),
                   tuple(constexprs.items()), tuple(options.items()))  # fmt: skip


def _compile(launch: _launch.Launch, args: tuple):
    """The launch's kernel compiled for HOPPER with its arguments' types and constexprs."""
    return _compile_job(CompileJob.of(launch, args))


def _compile_job(job: CompileJob):
    kernel = getattr(importlib.import_module(job.module), job.kernel)
    gluon = isinstance(kernel, _runtime.GluonJITFunction)
    options = dict(job.options)
    source = (_runtime.GluonASTSource if gluon else ASTSource)(kernel, dict(job.signature), dict(job.constexprs))
    ptxas_log = io.StringIO()
    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(ptxas_log):
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas's -v log to stdout
        triton.knobs.compilation.always_compile = True  # so ptxas runs even where the kernel is cached
        compiled = triton.compile(source, target=HOPPER, options=options)
    log = ptxas_log.getvalue()
    assert re.search(r"ptxas\S* info", log), f"{kernel.__name__}: no ptxas log printed (Triton {triton.__version__})"
    serialized = [line for line in log.splitlines() if "C7512" in line or "serialized" in line]
    assert not serialized, f"{kernel.__name__} {dict(job.constexprs)} {options}: {serialized[0]}"
    return compiled


# Spill loads and stores a launch may have: on an H200, 279 (Triton 3.8, a trap beside the
# reducer's accumulators) and 1658 (3.6, stream-K's first form, its MMAs serialized) cost 1.3x
# and 5x; 162 (Triton 3.9's ptxas, the precise reducer) cost nothing (docs/perf-log.md, "Under
# Triton 3.9").
MAX_SPILL_OPS = 192


NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"  # ships with Triton


def _local_memory_ops(compiled) -> int:
    """Spill loads and stores (LDL / STL) in the compiled kernel's SASS, read by the nvdisasm that
    ships with Triton; a test that counts them skips where it is missing."""
    if not NVDISASM.exists():
        pytest.skip(f"no {NVDISASM} to read the SASS with")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(NVDISASM), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    return sum("STL" in line or "LDL" in line for line in sass.splitlines())


TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared")
STORES_WRITTEN = re.compile(r"cp\.async\.bulk\.wait_group 0;")  # not .read: the writes done, not only the reads
RELEASE_ATOMIC = re.compile(r"\b(atom|red)\.\S*\.(release|acq_rel)\.")


def _stores_written_before_releases(compiled) -> tuple[int, int]:
    """(releasing atomics after a TMA store, waits for the stores' writes) in the kernel's PTX;
    fails where such an atomic has no wait for the writes (cp.async.bulk.wait_group without .read)
    since the last store before it, in the PTX's order: a flag released after `.read` alone may
    reach a reader before the data. (A partition that releases stores of another, as the reducer
    kernel's counter warp, lies elsewhere in the PTX: the caller counts the waits.)"""
    checked, stored, written = 0, False, False
    ptx = compiled.asm["ptx"]
    for number, line in enumerate(ptx.splitlines(), 1):
        if TMA_STORE.search(line):
            stored, written = True, False
        elif STORES_WRITTEN.search(line):
            written = True
        elif stored and RELEASE_ATOMIC.search(line):
            assert written, f"PTX line {number}: {line.strip()!r} releases TMA stores that may not be written yet"
            checked += 1
    return checked, len(STORES_WRITTEN.findall(ptx))


TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global")
ACQUIRE = re.compile(r"\.acquire\.")


# The kernels whose TMA loads read what flags publish (a peer's rows, partials); the Triton
# reduce-scatter reads its partials by pointer (the generic proxy), its operands by TMA.
TMA_READS_FLAGGED = {
    "all_gather_matmul_kernel",
    "all_gather_matmul_pingpong_kernel",
    "matmul_reduce_scatter_reducer_kernel",
}


def _orders_acquires_before_tma_loads(compiled) -> bool:
    """Whether a kernel that acquires flags and TMA-loads data has the proxy fence that orders the
    one before the other (fence.proxy.async.global; the PTX memory model orders accesses of the
    generic and the async proxy only through it); True where it does not do both."""
    ptx = compiled.asm["ptx"]
    return not (ACQUIRE.search(ptx) and TMA_LOAD.search(ptx)) or "fence.proxy.async.global" in ptx


def _inputs(m: int, n: int, k: int, fp8: bool):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    if not fp8:
        return x.to(torch.bfloat16), w.to(torch.bfloat16), {}
    scales = (torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5)
    return x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), {"scales": scales}


REDUCER = MatmulReduceScatterConfig(warp_specialized=True)


def _as_a_call(launch: _launch.Launch) -> _launch.Launch:
    """A captured GEMM-only launch as a call's plan makes it: the reducer kernel without its own
    region's reset (the call's step 1 zeroes it); any other kernel as it is."""
    if "RESET_OWN" not in launch.constexprs:
        return launch
    return _launch.Launch(launch.kernel, launch.grid, **{**launch.constexprs, "RESET_OWN": False})


@pytest.mark.parametrize(
    "world, m, n, k, fp8, transport, call",
    [
        (8, 1024, 4096, 1792, False, "push", True),  # a tail after the join; one copy a unit
        (4, 2048, 4096, 3584, False, "copy_engine", False),  # a copy a slot
        (8, 4096, 4096, 1792, "precise", "push", False),  # FP8 precise: two units in flight
        (4, 1024, 4096, 3584, "fast", "push", True),  # FP8 fast: the wide tiling at TP=4
    ],
)
def test_the_reducer_kernel_compiles_for_hopper(captured_launch, world, m, n, k, fp8, transport, call):
    """The GEMM-only mode's launch (the kernel resets its own region as it ends), or with `call`
    the same launch as a call's plan makes it (its step 1 zeroes the flags: RESET_OWN off)."""
    x, w, scaled = _inputs(m, n, k, bool(fp8))
    fp8_call = _scaled.Scaled.of(*scaled["scales"], torch.bfloat16, fp8 == "fast") if fp8 else None
    config = dataclasses.replace(REDUCER, transport=transport)
    if fp8:
        config = dataclasses.replace(rs._config_for(x, w, world, None, fp8_call), transport=transport)
        assert config.warp_specialized
    rs.gemm_only(x, w, None, GroupInfo(None, 0, world), config, use_fast_accum=fp8 == "fast", **scaled)()
    launch, args = captured_launch[-1]
    assert launch.kernel.__name__ == "matmul_reduce_scatter_reducer_kernel"
    assert launch.constexprs["PRECISE_ACC"] == (fp8 == "precise") and launch.constexprs["RESET_OWN"]
    # Two reducer warps for precise calls in 256-wide tiles (the split accumulator), else one.
    assert launch.constexprs["REDUCER_WARPS"] == (2 if launch.constexprs["SPLIT_ACC"] else 1)
    compiled = _compile(_as_a_call(launch) if call else launch, args)
    part = rs.partial_dtype(x, fp8_call)
    modelled = rs.reducer_smem_bytes(config, world, x.element_size(), part.itemsize, launch.constexprs["UNITS_IN_FLIGHT"],
                                     launch.constexprs["SPLIT_ACC"])  # fmt: skip
    assert compiled.metadata.shared <= modelled <= SMEM_LIMIT_BYTES
    released, written = _stores_written_before_releases(compiled)
    assert released >= 1 and written >= 4  # each consumer's own flags and its handover of the peers' halves


@pytest.mark.parametrize("world, transport", [(2, "copy_engine"), (8, "push")])
def test_the_precise_reducer_kernel_compiles_with_wide_tiles(captured_launch, world, transport):
    """Precise FP8 reduce-scatters in 128x256 tiles: the accumulator in column halves, staged in
    two pieces each, four 128-deep stages beside the reduction units; at TP=8 with the tail after
    the join. Few spills: with a trap inside the tail's loop, Triton 3.8 spilled 279 ops around
    the consumer's accumulators: 1.25-1.66x 3.6's ratio to cuBLAS on an H200 (docs/perf-log.md);
    Triton 3.9 spills 162 there, which measured costing nothing."""
    x, w, scaled = _inputs(1024 * world, 4096, 1792, True)
    config = MatmulReduceScatterConfig(**REDUCER_FP8_WIDE_PRECISE_TILING, warp_specialized=True, transport=transport)
    rs.gemm_only(x, w, None, GroupInfo(None, 0, world), config, **scaled)()
    launch, args = captured_launch[-1]
    assert launch.constexprs["SPLIT_ACC"] and launch.constexprs["PRECISE_ACC"]
    assert (launch.constexprs["TAIL_UNITS"] > 0) == (world == 8)
    assert launch.constexprs["REDUCER_WARPS"] == 2
    compiled = _compile(launch, args)
    modelled = rs.reducer_smem_bytes(config, world, 1, 2, launch.constexprs["UNITS_IN_FLIGHT"], split=True)
    assert compiled.metadata.shared <= modelled <= SMEM_LIMIT_BYTES
    assert _local_memory_ops(compiled) <= MAX_SPILL_OPS
    released, written = _stores_written_before_releases(compiled)
    assert released >= 1 and written >= 4  # each consumer's own flags and its handover of the peers' halves


WS_WIDE = AllGatherMatmulConfig(block_m=128, block_n=256, block_k=64, num_stages=3, warp_specialized=True)


@pytest.mark.parametrize(
    "world, rows, fp8, bands, peer_bands",
    [(8, 256, False, False, False), (4, 512, "precise", False, False), (8, 256, False, True, False),
     (4, 512, False, False, True)],
)  # fmt: skip
def test_the_warp_specialized_all_gather_compiles_for_hopper(captured_launch, world, rows, fp8, bands, peer_bands):
    x, w, scaled = _inputs(rows, 3584, 4096, fp8)
    config = dataclasses.replace(WS_WIDE, bands_across_segments=bands, peer_bands=peer_bands)
    if fp8:
        config = None  # its heuristic's tiling: precise, 128x256 (the accumulator in column halves)
    ag.gemm_only(x, w, None, GroupInfo(None, 0, world), config, **scaled)()
    launch, args = captured_launch[-1]
    assert launch.kernel.__name__ == "all_gather_matmul_pingpong_kernel"
    assert launch.constexprs["SEGMENT_BANDS"] == bands  # 224 tiles or more: two waves, bands only where asked
    assert launch.constexprs["PEER_BANDS"] == peer_bands
    assert launch.constexprs.get("SPLIT_ACC", False) == (fp8 == "precise")
    compiled = _compile(launch, args)
    assert compiled.metadata.shared <= SMEM_LIMIT_BYTES


@pytest.mark.parametrize("fp8", [False, "fast", "precise"])
def test_the_warp_specialized_all_gather_stores_ragged_rows_by_tma(captured_launch, fp8):
    """Rows a rank that are no multiple of the tile's: the descriptor over C as [W, m, n] clips each
    segment's last tile, so the epilogue stays on TMA (pointer stores spilled offline and took
    1.02-1.23x its time on one H100: docs/perf-log.md)."""
    x, w, scaled = _inputs(1000, 3584, 4096, fp8)
    config = None if fp8 else WS_WIDE
    ag.gemm_only(x, w, None, GroupInfo(None, 0, 4), config, use_fast_accum=fp8 == "fast", **scaled)()
    launch, args = captured_launch[-1]
    assert launch.kernel.__name__ == "all_gather_matmul_pingpong_kernel" and launch.constexprs["TMA_STORE"]
    compiled = _compile(launch, args)
    assert compiled.metadata.shared <= SMEM_LIMIT_BYTES
    assert _local_memory_ops(compiled) == 0


@pytest.mark.parametrize(
    "world, rows, fp8, sk_tiles",
    [
        (8, 128, False, 112),  # 8 x 14 tiles: less than a wave, every tile split
        (4, 512, False, 224 - 131),  # 16 x 14 tiles: those past the first wave split
        (8, 256, "fast", 224 - 131),  # FP8 fast accumulation: 128x256x128 tiles
        (8, 256, "fast-narrow", 448 - 3 * 131),  # ... its 128x128x128 tiling in six stages
        (4, 1024, False, 448 - 3 * 131),  # 32 x 14 tiles: those past three waves
    ],
)
def test_the_all_gather_splits_its_last_wave_by_k_when_asked(captured_launch, world, rows, fp8, sk_tiles):
    """stream_k: the tiles past the last whole wave of 131 programs split by K over all of them, in
    a kernel that compiles for sm_90 with few spills: a partial tile joined into one accumulator
    made Triton 3.6 spill 1658 ops and serialize the MMAs (5x the time); split into two column
    halves it spills none under Triton 3.6 and 3.8, and 104 under 3.9's ptxas (the grid's stream-K
    cases measured 0.99-1.03x 3.6's ratio to cuBLAS there)."""
    x, w, scaled = _inputs(rows, 3584, 4096, fp8 and "fast")
    config = dataclasses.replace(WS_WIDE, stream_k=True)
    if fp8 == "fast":
        fast = _scaled.Scaled.of(*scaled["scales"], torch.bfloat16, True)
        config = dataclasses.replace(ag._config_for(x, w, world, None, fast), stream_k=True)
        assert config.warp_specialized and config.block_n == 256
    elif fp8 == "fast-narrow":
        narrow = {**WARP_SPECIALIZED_FP8_TILING, **WARP_SPECIALIZED_FP8_TWO_BYTE_OUTPUT}
        config = AllGatherMatmulConfig(**narrow, warp_specialized=True, stream_k=True)
    ag.gemm_only(x, w, None, GroupInfo(None, 0, world), config, use_fast_accum=bool(fp8), **scaled)()
    launch, args = captured_launch[-1]
    assert launch.constexprs["STREAM_K"] and launch.grid == SMS - 1
    assert args[-4] == sk_tiles  # then the partials' descriptor, the flags and the half-width C descriptor
    compiled = _compile(launch, args)
    assert compiled.metadata.shared <= SMEM_LIMIT_BYTES
    assert _stores_written_before_releases(compiled)[0] >= 2  # each consumer's flags of the split tiles' partials
    assert _orders_acquires_before_tma_loads(compiled)
    assert _local_memory_ops(compiled) <= MAX_SPILL_OPS


def test_stream_k_is_refused_where_its_kernel_does_not_run(captured_launch):
    x, w, scaled = _inputs(128, 512, 256, "precise")
    with pytest.raises(ValueError, match="only the warp-specialized kernel"):
        ag.gemm_only(x.to(torch.bfloat16), w.to(torch.bfloat16), None, GroupInfo(None, 0, 2),
                     AllGatherMatmulConfig(stream_k=True))  # fmt: skip
    precise = dataclasses.replace(WS_WIDE, block_n=128, block_k=128, num_stages=4, stream_k=True)
    with pytest.raises(ValueError, match="precise accumulation"):
        ag.gemm_only(x, w, None, GroupInfo(None, 0, 2), precise, **scaled)


@pytest.mark.parametrize("block_k, stages", [(64, 8), (128, 4)])
def test_the_precise_all_gather_compiles_with_wide_tiles(captured_launch, block_k, stages):
    """Precise FP8 in 128x256 tiles: the accumulator in two column halves, stored one after the other."""
    x, w, scaled = _inputs(256, 3584, 4096, "precise")
    config = dataclasses.replace(WS_WIDE, block_k=block_k, num_stages=stages)
    ag.gemm_only(x, w, None, GroupInfo(None, 0, 4), config, **scaled)()
    launch, args = captured_launch[-1]
    assert launch.constexprs["SPLIT_ACC"] and launch.constexprs["PRECISE_ACC"]
    compiled = _compile(launch, args)
    assert compiled.metadata.shared <= SMEM_LIMIT_BYTES
    # The halves fit the consumers' registers only as accumulate lays them out (a branch around a
    # promotion made ptxas spill them: docs/perf-log.md).
    assert _local_memory_ops(compiled) == 0


@pytest.mark.parametrize(
    "rows, bands, expected",
    [
        (128, False, True),  # 8 x 14 = 112 tiles: one wave of 131 programs, bands by themselves
        (256, False, False),  # 224 tiles: two waves, segment by segment
        (256, True, True),  # as the config asks
    ],
)
def test_the_all_gather_counts_bands_across_segments_in_one_wave_or_when_asked(captured_launch, rows, bands, expected):
    x, w, _ = _inputs(rows, 3584, 4096, False)
    config = dataclasses.replace(WS_WIDE, bands_across_segments=bands)
    ag.gemm_only(x, w, None, GroupInfo(None, 0, 8), config)()
    launch, _ = captured_launch[-1]
    assert launch.grid == SMS - 1 or rows == 128
    assert launch.constexprs["SEGMENT_BANDS"] == expected


@pytest.mark.parametrize(
    "world, n, fp8, asked, warp_specialized, expected",
    [
        (4, 13312, False, False, False, True),  # llama3-405b's up projection at TP=4: 3700 columns a peer or more
        (4, 13312, False, False, True, True),  # either kernel
        (4, 7168, False, False, False, False),  # llama3-70b's: the peers' rows would arrive after the own segment
        (8, 6656, False, False, False, False),  # TP=8: 25900 columns a rank would be needed
        (2, 13312, False, False, False, False),  # one peer: the same order either way
        (4, 13312, "fast", False, True, False),  # FP8: not measured on peers
        (8, 1792, False, True, False, True),  # as the config asks
    ],
)  # fmt: skip
def test_the_all_gather_counts_the_peers_bands_by_its_rule_or_when_asked(captured_launch, world, n, fp8, asked,
                                                                         warp_specialized, expected):  # fmt: skip
    x, w, scaled = _inputs(256, n, 256, fp8)
    config = AllGatherMatmulConfig(peer_bands=asked, warp_specialized=warp_specialized or bool(fp8))
    ag.gemm_only(x, w, None, GroupInfo(None, 0, world), config, use_fast_accum=fp8 == "fast", **scaled)()
    launch, _ = captured_launch[-1]
    assert launch.constexprs["PEER_BANDS"] == expected


def test_bands_across_segments_on_the_triton_kernel_are_refused():
    x, w, _ = _inputs(128, 512, 256, False)
    config = AllGatherMatmulConfig(bands_across_segments=True)
    with pytest.raises(ValueError, match="only the warp-specialized kernel"):
        ag.gemm_only(x, w, None, GroupInfo(None, 0, 2), config)


# Per-rank shapes the heuristics tile differently: (all-gather rows a rank or reduce-scatter rows in
# all, n, k): few tiles (narrow), ragged rows and columns (pointer stores), many tiles (wide).
SWEEP_SHAPES = {
    "all_gather_matmul": [(128, 1792, 4096), (1000, 1000, 2048), (2048, 3584, 8192)],
    "matmul_reduce_scatter": [(1024, 4096, 1792), (1000, 1000, 2048), (8192, 8192, 3584)],
}
# (operand dtype, FP8 accumulation, output dtype): bf16 calls (fp16 ones take the same tilings), FP8
# precise and fast, each with a 2-byte and a float32 output (whose staging is twice as large).
SWEEP_KINDS = [
    (torch.bfloat16, None, None),
    (torch.float8_e4m3fn, "precise", torch.bfloat16),
    (torch.float8_e4m3fn, "precise", torch.float32),
    (torch.float8_e4m3fn, "fast", torch.bfloat16),
    (torch.float8_e4m3fn, "fast", torch.float32),
]


def _sweep_check(job: CompileJob) -> tuple[int, int | None, bool]:
    """(shared memory bytes, spill ops or None without nvdisasm, acquires ordered before TMA
    loads) of a launch, compiled in a worker process."""
    compiled = _compile_job(job)
    spills = _local_memory_ops(compiled) if NVDISASM.exists() else None
    ordered = job.kernel not in TMA_READS_FLAGGED or _orders_acquires_before_tma_loads(compiled)
    return compiled.metadata.shared, spills, ordered


@pytest.fixture(scope="module")
def compile_pool():
    """Worker processes for the sweep's compiles (ptxas runs one kernel on one core): spawned,
    as forking a process that has run MLIR's thread pool may hang."""
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.mark.parametrize("op", list(SWEEP_SHAPES))
def test_every_heuristic_launch_fits_shared_memory_and_spills_little(captured_launch, compile_pool, op):
    """What an untuned call launches on an H100 / H200 (each kernel specialization compiled once,
    Triton's and the warp-specialized ones, captured from the GEMM-only modes as a call launches
    them: _as_a_call) fits sm_90's shared memory: a tiling whose epilogue
    does not fit fails its launch with OutOfResources on the GPU (the FP8 fast all-gather's
    128x256 Triton tiles with a float32 output did, at TP=4). And it spills at most
    MAX_SPILL_OPS (its comment has the measurements): the Triton release your torch brings may
    allocate registers differently from the measured one."""
    module = ag if op == "all_gather_matmul" else rs
    jobs = {}  # each kernel specialization once
    for world in (2, 4, 8):
        for (rows, n, k), (dtype, accumulation, out_dtype) in itertools.product(SWEEP_SHAPES[op], SWEEP_KINDS):
            torch.manual_seed(0)
            x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
            what = f"{op} W={world} {rows}x{n}x{k} {dtype} {accumulation or ''} out {out_dtype}"
            if accumulation is None:
                module.gemm_only(x, w, None, GroupInfo(None, 0, world))()
            else:
                scales = (torch.rand(rows, 1) + 0.5, torch.rand(1, n) + 0.5)
                module.gemm_only(x, w, None, GroupInfo(None, 0, world), scales=scales, out_dtype=out_dtype,
                                 use_fast_accum=accumulation == "fast")()  # fmt: skip
            launch, args = captured_launch[-1]
            launch = _as_a_call(launch)
            jobs.setdefault(CompileJob.of(launch, args), (what, launch.constexprs))
    for (what, constexprs), (shared, spills, ordered) in zip(jobs.values(), compile_pool.map(_sweep_check, jobs)):
        assert shared <= SMEM_LIMIT_BYTES, f"{what}: {constexprs} needs {shared} bytes of shared memory"
        if spills is None:
            pytest.skip(f"no {NVDISASM} to read the SASS with")
        assert spills <= MAX_SPILL_OPS, f"{what}: {constexprs} spills {spills} ops (Triton {triton.__version__})"
        assert ordered, f"{what}: TMA loads after acquires, no proxy fence"
