"""Autotuning of the fused ops: `fluxtp tune`, writing the on-disk config cache, `fluxtp info
--configs`. The product side (the config dataclasses and their search space, reading the
tables, the call-time lookup) is fluxtp.configs; this module is tooling on top of it.

Search space (`search_space(op, m_total, n, k, world)`, shapes are the layer's global sizes as
in `fluxtp bench --shapes`): tiles 128x128 / 128x256 / 256x128, block_k 64 / 128, 4 / 8 warps,
3 / 4 / 5 stages, group_m 4 / 8 / 16, plus the op's own knobs: chunk_rows (all_gather_matmul:
the rows per rank in 1, 2, 4 or 8 copy chunks) and transport copy_engine / push / pull and
epilogue_split 1 / 2 / 4 (matmul_reduce_scatter); where an all-gather may take the
warp-specialized kernel (bf16 / fp16 on Hopper), each 128-row, 64-deep tiling on it too, and
the heuristic as the launcher takes it there. Pruned before anything runs: what needs more
shared memory than an H100/H200 block may have (`smem_bytes`), and tilings whose float32
accumulator would not fit the registers (more than 128 per thread; 64 with an unsplit
reduce-scatter epilogue). The estimate is an estimate: a candidate the compiler still rejects
is dropped on every rank.

Cache: one JSON file, `$FLUXTP_CACHE_DIR/configs.json` (default `$XDG_CACHE_HOME/fluxtp`, else
`~/.cache/fluxtp`):

    {"schema": "fluxtp.tune/1",
     "entries": [{"gpu": "NVIDIA H200", "world": 2, "dtype": "bfloat16",
                  "op": "all_gather_matmul", "N": 28672, "K": 8192, "M_bucket": 4096,
                  "config": {every field of the op's config dataclass},
                  "measured": {"M": 4096, "ms": ..., "heuristic_ms": ..., ...}}]}

The key is (gpu, world, dtype, op, N, K, M_bucket, weight_layout): the GPU name as torch.cuda
reports it, the group size, the dtype, and the layer's global N and K; M_bucket is M (global
tokens) rounded up to a power of two; weight_layout is "linear" (nn.Linear's [N, K] row-major)
or "transposed" (the W^T view of a [K, N] weight that the backward passes, which the kernels
read in place with another B descriptor; an entry without the field is "linear"). Lookup
(`choose`; `tuned_config` on the launchers' hot path, `measured_verdict` for "auto"), two
tables in turn: the user's cache (above), then the table shipped with fluxtp (package data,
fluxtp/configs/default.json, the same format: configs measured on our GPUs; see
`merge_into_shipped`); in each, the exact key, else the nearest M bucket of the same (gpu,
world, dtype, op, N, K, layout) (ties: the smaller); for a transposed weight with no entry of
its own layout, the same for "linear" (either config runs either layout). The first table with
an answer wins, so a user's own tuning beats the shipped one even where it only has a nearer
bucket; with neither, None, and the launcher uses the op's heuristic. A file that cannot be
read, is not valid JSON, has another schema version or a config field this version does not
know (or lacks one) is ignored as a whole, with one warning per version of the file, never an
exception (the shipped table too: the other table and the heuristic still answer).

Every rank must launch the same config (and, under "auto", take the same backend: the measured
verdict comes from the same entry). The answer is a function of the file and of the call's
shape, weight layout, dtype, world and GPU name only, so the ranks of one host (one file)
agree; on several hosts, give them the same file (copy it, or point FLUXTP_CACHE_DIR at shared
storage). A running process reads each table once, at its first fused call, and keeps it:
a file rewritten later is seen only after `fluxtp.configs.reload()` (on every rank at the same
point) or in a new process; the tuner's own writes reload by themselves. Writes take a lock
file, merge with the entries already there and replace the file atomically (temporary file +
os.replace), so a reader never sees a half-written file.

`fluxtp tune` (rank_tune, on every rank of a launch like `fluxtp bench`'s), per shape: draw
random inputs, compute the nccl reference; for each candidate, the heuristic's first and then
the others nearest to it first: compile it without communication (gemm_only) and verify the
fused op's output against the reference (every rank agrees on the verdict), time one short
sample with fluxtp.bench.harness (the slowest rank's time counts) and drop it at once if slower
than PRUNE_RATIO times the best so far, else take SCREEN_ROUNDS more samples. When the shape's
share of the budget (the rest split evenly over the shapes left) is three-quarters spent,
screening stops (checked between candidates). Then the best few survivors and the heuristic
are timed together, interleaved, with the harness; rank 0 picks the fastest and broadcasts it,
every rank checks that it holds the same winner, and rank 0 writes the winners into the cache.
A candidate that computes a wrong result is never chosen and makes the command exit 1 (a
kernel bug); one the compiler rejects is only listed.
`fluxtp tune --vary FIELD,...` re-measures only those fields (e.g. transport, after a kernel
change) around the config each shape uses now (the cache's, else the shipped table's, nearest
bucket included, else the heuristic's), which takes the heuristic's place as the baseline;
its entries record "varied".

Tuned against heuristic: the final pick is made on the same samples that rank the finalists,
which favours whichever got lucky; so the winner is then timed again against the heuristic in
a fresh interleaved measurement (the confirmation), with the nccl reference (collective, then
cuBLAS) and the plain cuBLAS GEMM of the same per-rank shape as `fluxtp bench` times them, and
it replaces the heuristic only if it is faster there too. The confirmation's times are what
the cache entry's "measured" and `fluxtp tune --out` record: heuristic and tuned ms, and each
one's E_overlap = 1 - (T - T_gemm) / (T_nccl - T_gemm), all from one interleaved run.

Shipping measured configs: `fluxtp tune` on the GPU machine into a cache of its own, then
`python -m fluxtp.tune merge-defaults <that dir>/configs.json` merges its entries (measured
ones only) into fluxtp/configs/default.json, to be committed; given the run's `--out` results
file instead (benchmarks/results/tune-*.json), its tuned rows, or those `--shapes` names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fluxtp._dist import max_over_ranks
from fluxtp._terminal import fit_table, terminal_width, wrap

# The product side (configs, search space, tables, lookup) lives in fluxtp.configs; re-exported
# here for the tuner's code and its callers.
from fluxtp.configs._classes import (  # noqa: F401
    AG_CHUNK_PIECES,
    BLOCK_KS,
    ELEMENT_BYTES,
    FUSED_OPS,
    GROUP_MS,
    MAX_ACC_REGISTERS,
    MAX_ACC_REGISTERS_UNSPLIT_EPILOGUE,
    REDUCER_TILING,
    RS_EPILOGUE_SPLITS,
    RS_TRANSPORTS,
    SMEM_LIMIT_BYTES,
    SMEM_RESERVE_BYTES,
    STAGES,
    TILES,
    WARPS,
    candidates,
    config_class,
    describe,
    fits,
    heuristic,
    search_space,
    smem_bytes,
)
from fluxtp.configs._table import (  # noqa: F401
    AUTO_WIN_RATIO,
    CACHE_FILE,
    HEURISTIC,
    KEY_FIELDS,
    SCHEMA,
    SHIPPED,
    SHIPPED_RESOURCE,
    USER_CACHE,
    WEIGHT_LAYOUTS,
    CacheFileError,
    CacheWarning,
    Choice,
    Entry,
    Key,
    _gpu_name,
    _signature,
    _verdict,
    cache_dir,
    cache_path,
    choose,
    config_from_dict,
    config_to_dict,
    dumps,
    key_dtype,
    load,
    m_bucket,
    measured_verdict,
    parse,
    reload,
    shipped_path,
    tuned_config,
    weight_layout_of,
)

# What a shipped entry must record of its measurement (rank_tune writes all of these).
SHIPPED_MEASURED_FIELDS = ("M", "ms", "heuristic_ms", "date", "torch", "triton", "commit")
TUNE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Screening: one short sample per candidate; slower than PRUNE_RATIO x the best so far: dropped,
# else SCREEN_ROUNDS more samples give its screening time (median, slowest rank).
PRUNE_RATIO = 1.3
SCREEN_ROUNDS = 3
FINAL_CANDIDATES = 4  # the best survivors timed again, interleaved with the heuristic
SCREEN_SHARE = 0.75  # of a shape's budget; the rest is the final measurement's





@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on path + '.lock' (POSIX; elsewhere no lock: last writer wins)."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+") as f:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_entries(new_entries, path: str | os.PathLike | None = None) -> Path:
    """Merge entries into the cache file (replacing equal keys) and replace it atomically.

    An unusable existing file is replaced (with the warning load() gives). The new text goes
    to a temporary file in the same folder, is flushed to disk, and os.replace()s the old one:
    a reader sees the old file or the new one, never a mixture."""
    path = Path(cache_path() if path is None else path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        entries, _ = load(path)
        merged = dict(entries)
        for entry in new_entries:
            merged[entry.key] = entry
        _replace_file(path, dumps(merged.values()))
    reload()  # this process's lookups and call plans see what it wrote
    return path


def _replace_file(path: Path, text: str) -> None:
    """Write text to a temporary file beside path, flush it to disk, os.replace() path with it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def merge_into_shipped(source: str | os.PathLike, target: str | os.PathLike | None = None,
                       shapes: tuple[str, ...] = ()) -> tuple[int, int]:  # fmt: skip
    """Merge the entries of a `fluxtp tune` cache file, or the tuned rows of a `fluxtp tune --out`
    results file (entries_from_results: `shapes` picks rows), into the shipped table (default:
    the package's fluxtp/configs/default.json, in a source checkout the file to commit); equal
    keys are replaced by the source's. Returns (entries added, entries replaced).

    Only measured entries ship: each must record SHIPPED_MEASURED_FIELDS in "measured" (what
    rank_tune writes). CacheFileError, and nothing written, when the source lacks them or
    either file cannot be used (a corrupt shipped table is not overwritten silently)."""
    source, target = Path(source), Path(shipped_path() if target is None else target)
    try:
        text = source.read_text()
        results = _tune_results(text)
        if shapes and results is None:
            raise CacheFileError("--shapes picks rows of a `fluxtp tune --out` results file; this is a cache file")
        new = parse(text) if results is None else {e.key: e for e in entries_from_results(results, shapes)}
    except (OSError, UnicodeDecodeError) as e:
        raise CacheFileError(f"cannot read {source} ({e})") from None
    except CacheFileError as e:
        raise CacheFileError(f"{source}: {e}") from None
    for entry in new.values():
        lacking = [f for f in SHIPPED_MEASURED_FIELDS if f not in entry.measured]
        if lacking:
            raise CacheFileError(
                f"{source}: entry {entry.key} lacks measured {', '.join(lacking)}: only configs measured by "
                "`fluxtp tune` ship"
            )
    shipped: dict[Key, Entry] = {}
    if target.exists():
        try:
            shipped = parse(target.read_text())
        except (OSError, UnicodeDecodeError, CacheFileError) as e:
            raise CacheFileError(f"the shipped table {target} cannot be used ({e}); fix or delete it first") from None
    replaced = sum(key in shipped for key in new)
    shipped.update(new)
    target.parent.mkdir(parents=True, exist_ok=True)
    _replace_file(target, dumps(shipped.values()))
    reload()
    return len(new) - replaced, replaced


def _tune_results(text: str) -> dict | None:
    """The envelope of a `fluxtp tune --out` results file, None for any other text."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and data.get("scenario") == "tune" and "rows" in data:
        return data
    return None


def entries_from_results(results: dict, shapes: tuple[str, ...] = ()) -> list:
    """The table entries a `fluxtp tune --out` results file records: its rows whose tuned config
    replaced the baseline, or the rows of `shapes` (MxNxK as tuned); CacheFileError for a shape
    the file has no row of."""
    rows = {f"{r['M']}x{r['N']}x{r['K']}": r for r in results["rows"]}
    missing = [s for s in shapes if s not in rows]
    if missing:
        raise CacheFileError(f"no row of {', '.join(missing)} (the file has {', '.join(rows)})")
    picked = [rows[s] for s in shapes] if shapes else [r for r in rows.values() if not r["tuned_is_heuristic"]]
    run = {f: results[f] for f in ("date", "torch", "triton", "commit")}
    varied = _varied_in(results.get("command", ""))
    return [entry_from_row(r, results["device"], results["world"], run, varied) for r in picked]


def _varied_in(command: str) -> list[str]:
    """The fields `--vary` named in a recorded `fluxtp tune` command (rows before "varied" was
    recorded in them)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--vary" and i + 1 < len(words):
            return words[i + 1].split(",")
        if word.startswith("--vary="):
            return word.removeprefix("--vary=").split(",")
    return []


def entry_from_row(row: dict, gpu: str, world: int, run: dict, varied: list[str] = ()) -> Entry:
    """The table entry of one tuned shape from its results row (comparison_row); run: the date,
    torch, triton and commit of the run that measured it."""
    key = Key(gpu, world, row["dtype"], row["op"], row["N"], row["K"], m_bucket(row["M"]), row["weight_layout"])
    ms = row["ms"]
    measured = {
        "M": row["M"],
        "ms": ms["tuned"],
        "heuristic_ms": ms["heuristic"],
        "nccl_ms": ms["nccl"],
        "gemm_ms": ms["gemm"],
        "candidates": row["candidates"],
        "screened": row["screened"],
        **run,
    }
    varied = row.get("varied", varied)
    if varied:  # heuristic_ms is then the time of the config in use before
        measured["varied"] = list(varied)
    return Entry(key, config_from_dict(row["op"], row["tuned_config"]).as_entry(), measured)


# ---------------------------------------------------------------- fluxtp tune


class TuneError(RuntimeError):
    """Tuning cannot go on; raised on every rank alike."""


NO_GPU_MESSAGE = (
    "fluxtp tune: tuning measures the fused Triton kernels, which need NVIDIA GPUs (CUDA); this host has none "
    "(torch.cuda.is_available() is False). Nothing was tuned; run it on the GPU host that will use the configs."
)


@dataclass(frozen=True)
class TuneJob:
    op: str
    shapes: tuple  # of fluxtp.bench.ops.Shape
    dtype: torch.dtype
    budget_s: float
    path: str  # the cache file, resolved once by the launching process
    out: str | None = None  # where rank 0 writes the tuned-vs-heuristic results (fluxtp.bench/1, scenario "tune")
    command: str = "fluxtp tune"  # as typed, for the results
    weight_layout: str = "linear"  # or "transposed": tune the backward's W^T views (a key of their own)
    vary: tuple[str, ...] = ()  # only these config fields, from the config the op uses now (not the heuristic)


@dataclass
class ShapeResult:
    shape: object
    winner: object
    winner_ms: float
    heuristic_ms: float
    space: int
    screened: int
    pruned: int
    failed: list  # (config, why): the compiler or the launch rejected it
    wrong: list  # (config, why): it computed a wrong result (a kernel bug)
    # The confirmation (module docstring): winner_ms and heuristic_ms above come from it, with these.
    heuristic: object = None  # the heuristic's config
    nccl_ms: float | None = None  # the collective, then cuBLAS
    gemm_ms: float | None = None  # cuBLAS alone, the same per-rank GEMM
    selected: object = None  # the fastest finalist, which the confirmation kept (= winner) or not
    selection_ms: float | None = None  # its time among the finalists


def _baseline_variants(op, shape, dtype, inputs, info, device, generator, weight_layout="linear") -> list:
    """The nccl reference on the tuner's inputs and cuBLAS alone on the same per-rank GEMM (as
    `fluxtp bench` times them: `gemm` on its own inputs of fluxtp.bench.ops.gemm_shapes)."""
    import torch.nn.functional as F

    import fluxtp
    from fluxtp.bench.harness import Variant
    from fluxtp.bench.ops import gemm_shapes, random_weight

    op_fn = getattr(fluxtp, op)
    gx_shape, gw_shape = gemm_shapes(op, shape, info.world_size)
    gemm_inputs = [
        (
            torch.randn(gx_shape, dtype=dtype, device=device, generator=generator),
            random_weight(gw_shape, dtype, device, generator, gw_shape[1] ** -0.5, weight_layout),
        )
        for _ in inputs
    ]
    return [
        Variant("nccl", tuple(functools.partial(op_fn, x, w, group=info.group, backend="nccl") for x, w in inputs)),
        Variant("gemm", tuple(functools.partial(F.linear, x, w) for x, w in gemm_inputs)),
    ]


def _same_on_every_rank(values: list, info) -> list:
    """Rank 0's values, on every rank."""
    if info.group is not None:
        dist.broadcast_object_list(values, src=dist.get_global_rank(info.group, 0), group=info.group)
    return values


def _launchers(op: str):
    """(the fused op's launcher as fn(x, w, info, config) -> (out, gathered or None), gemm_only)."""
    if op == "all_gather_matmul":
        from fluxtp.backends.fused import _all_gather_matmul

        def run(x, w, info, config):
            return _all_gather_matmul.all_gather_matmul(x, w, None, info, True, config=config)

        return run, _all_gather_matmul.gemm_only
    from fluxtp.backends.fused import _matmul_reduce_scatter

    def run(x, w, info, config):
        return _matmul_reduce_scatter.matmul_reduce_scatter(x, w, None, info, config=config), None

    return run, _matmul_reduce_scatter.gemm_only


def _check(op, config, inputs, ref, ref_gathered, info, device) -> tuple[str | None, bool]:
    """(why the candidate is dropped or None, whether it computed a wrong result), the same on
    every rank: compile and run without communication first (a compiler rejection happens
    before any collective is queued), then the fused op against the nccl reference."""
    from fluxtp.bench.ops import VERIFY_TOLERANCE, relative_error

    run, gemm_only = _launchers(op)
    x, w = inputs[0]
    reason = None
    try:
        gemm_only(x, w, None, info, config=config)()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001  OutOfResources and other compiler rejections: the same on every rank
        reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:200]
    (failed,) = max_over_ranks([float(reason is not None)], info, device)
    if failed:
        return reason or "does not compile or launch on another rank", False
    out, gathered = run(x, w, info, config)
    shape_differs = tuple(out.shape) != tuple(ref.shape)
    error = math.inf if shape_differs else relative_error(out, ref)
    gathered_differs = gathered is not None and not torch.equal(gathered, ref_gathered)
    error, gathered_differs = max_over_ranks([error, float(gathered_differs)], info, device)
    if gathered_differs:
        return "the gathered input differs from the nccl reference's", True
    if not error <= VERIFY_TOLERANCE[x.dtype]:
        return f"max-norm relative error {error:.3g} against the nccl reference", True
    return None, False


def _variant(op, name, config, inputs, info):
    from fluxtp.bench.harness import Variant

    run, _ = _launchers(op)
    return Variant(name, tuple(functools.partial(run, x, w, info, config) for x, w in inputs))


def _time_left(deadline: float, info, device) -> float:
    """Seconds to the deadline, the smallest over the ranks (so every rank decides alike)."""
    return -max_over_ranks([-(deadline - time.monotonic())], info, device)[0]


def varied_space(op: str, start, vary, m_total: int, n: int, k: int, world: int,
                 warp_specialized: bool = False) -> list:  # fmt: skip
    """`start`, then the candidates that differ from it in the `vary` fields only. warp_specialized
    names the kernel, and the other kernel's tiling stands for the entry's, so the entry meets its
    twin there: a reduce-scatter's reducer kernel in its one tiling (REDUCER_TILING; the same band
    and transport), from a reducer-kernel entry that tiling on Triton; an all-gather's other
    kernel in a tile of the same area (the warp-specialized kernel takes 128-row tiles only: a
    256x128 Triton entry meets it in 128x256), at the warps and stages it has there."""
    fields = {f.name for f in dataclasses.fields(start)}
    unknown = sorted(set(vary) - fields)
    if unknown:
        raise ValueError(f"{op} configs have no field(s) {', '.join(unknown)}; they have {', '.join(sorted(fields))}")
    pinned = {f: getattr(start, f) for f in vary}

    def twin_tiling(c) -> dict:
        """The start's values of the fields in which c, on the other kernel, may differ from it."""
        if "warp_specialized" not in vary or c.warp_specialized == start.warp_specialized:
            return {}
        if op == "matmul_reduce_scatter":
            return {f: getattr(start, f) for f in REDUCER_TILING} if c.warp_specialized else {}
        if c.block_m * c.block_n != start.block_m * start.block_n:
            return {}
        return {f: getattr(start, f) for f in ("block_m", "block_n", "num_warps", "num_stages")}

    def varies_only_there(c) -> bool:
        return dataclasses.replace(c, **{**twin_tiling(c), **pinned}) == start

    space = candidates(op, m_total, n, k, world, warp_specialized)
    return [start] + [c for c in space if c != start and varies_only_there(c)]


def launched_space(op: str, space: list, shape, world: int, kernels_run: bool, itemsize: int) -> list:
    """The candidates as a call launches a table entry of each, duplicates dropped: a reduce-scatter's
    on the reducer kernel where on_reducer_kernel says and kernels_run (_launcher_kernels_run), an
    unscaled all-gather's with stream-K where with_stream_k_rule says and kernels_run, so the tune
    measures what its entry launches."""
    if op != "matmul_reduce_scatter":
        from fluxtp.backends.fused._all_gather_matmul import routed

        rows, n = shape.M // world, shape.N // world
        return list(dict.fromkeys(routed(c, rows, n, shape.K, world, kernels_run) for c in space))
    from fluxtp.backends.fused._matmul_reduce_scatter import routed

    k = shape.K // world
    return list(dict.fromkeys(routed(c, shape.M, shape.N, k, world, itemsize, kernels_run) for c in space))


def tune_shape(
    op, shape, dtype, deadline, info, device, generator, show_progress=False, weight_layout="linear", start=None, vary=()
) -> ShapeResult:
    """Tune one shape on every rank of `info` (collective); returns the same result everywhere.
    weight_layout "transposed": the candidates run on the backward's W^T views. With `vary`, the
    space is varied_space(start, vary) and `start` plays the heuristic's part (the baseline)."""
    from tqdm import tqdm

    import fluxtp
    from fluxtp.bench.harness import (
        GPU_PROTOCOL,
        Protocol,
        cache_bytes,
        input_copies,
        measure,
    )
    from fluxtp.bench.ops import random_weight, shard_shapes

    world = info.world_size
    x_shape, w_shape = shard_shapes(op, shape, world)
    copies = input_copies((math.prod(x_shape) + math.prod(w_shape)) * ELEMENT_BYTES, cache_bytes(device))
    inputs = [
        (
            torch.randn(x_shape, dtype=dtype, device=device, generator=generator),
            random_weight(w_shape, dtype, device, generator, w_shape[1] ** -0.5, weight_layout),
        )
        for _ in range(copies)
    ]
    reference = getattr(fluxtp, op)
    if op == "all_gather_matmul":
        ref, ref_gathered = reference(*inputs[0], group=info.group, backend="nccl", return_gathered=True)
    else:
        ref, ref_gathered = reference(*inputs[0], group=info.group, backend="nccl"), None

    # The warp-specialized kernels are screened where the launcher may take them.
    warp_specialized = _launcher_kernels_run(device, dtype)
    if vary:
        space = varied_space(op, start, vary, shape.M, shape.N, shape.K, world, warp_specialized)
    else:
        space = search_space(op, shape.M, shape.N, shape.K, world, warp_specialized)
    space = launched_space(op, space, shape, world, warp_specialized, dtype.itemsize)
    base = space[0]
    start = time.monotonic()
    screen_end = start + SCREEN_SHARE * max(0.0, deadline - start)
    calls = GPU_PROTOCOL.calls_per_sample
    first = Protocol(rounds=1, warmup_rounds=1, calls_per_sample=calls)
    screen = Protocol(rounds=SCREEN_ROUNDS, warmup_rounds=0, calls_per_sample=calls)
    # nccl and cuBLAS for the confirmation: one short sample now warms them up and gives the wall
    # time a round of them takes (sizes the final measurements).
    baselines = _baseline_variants(op, shape, dtype, inputs, info, device, generator, weight_layout)
    began = time.monotonic()
    measure(baselines, first, info, device)
    baselines_round_s = (time.monotonic() - began) / (first.warmup_rounds + first.rounds)
    times: dict[object, float] = {}
    sample_s: dict[object, float] = {}  # wall seconds one sample of the candidate took, barriers included
    failed, wrong = [], []
    screened = pruned = 0
    bar = tqdm(total=len(space), disable=not show_progress, unit="config", desc=f"{op} {shape}", leave=False)
    try:
        for i, config in enumerate(space):
            if i > 0 and _time_left(screen_end, info, device) <= 0:
                break  # the heuristic (i = 0) is always measured
            screened += 1
            why, is_wrong = _check(op, config, inputs, ref, ref_gathered, info, device)
            if why is not None:
                (wrong if is_wrong else failed).append((config, why))
            else:
                variant = [_variant(op, "candidate", config, inputs, info)]
                began = time.monotonic()
                t = measure(variant, first, info, device)["candidate"]  # one short sample (slowest rank)
                sample_s[config] = (time.monotonic() - began) / (first.warmup_rounds + first.rounds)
                if times and t > PRUNE_RATIO * min(times.values()):
                    pruned += 1  # hopeless: no more samples
                else:
                    times[config] = measure(variant, screen, info, device)["candidate"]
            bar.update(1)
            if times:
                bar.set_postfix(best_ms=f"{min(times.values()):.4g}")
    finally:
        bar.close()
    if base not in times:  # measured first, so never pruned: it failed
        raise TuneError(f"{op} {shape}: the heuristic config {describe(base)} itself failed: {(failed + wrong)[0][1]}")
    best = min(times.values())
    survivors = sorted((c for c, t in times.items() if t <= PRUNE_RATIO * best), key=lambda c: (times[c], space.index(c)))
    finalists = list(dict.fromkeys([*survivors[:FINAL_CANDIDATES], base]))
    names = [f"c{space.index(c)}" for c in finalists]
    # Two measurements of as many rounds as the rest of the budget allows (>= 3, <= the
    # benchmark's), by the wall time the screening samples took, one warm-up round each (every
    # variant has run already): the finalists, then the confirmation (heuristic, the selected
    # finalist, nccl, cuBLAS).
    # The wall times are each rank's own: the ranks agree on the smallest count (every rank must
    # take the same number of samples).
    per_round_s = sum(sample_s[c] for c in finalists)
    per_round_s += 2 * max(sample_s[c] for c in finalists) + baselines_round_s
    rounds = int(min(GPU_PROTOCOL.rounds, _time_left(deadline, info, device) / max(per_round_s, 1e-6) - 1))
    rounds = int(-max_over_ranks([-float(rounds)], info, device)[0])
    final = Protocol(max(3, rounds), 1, calls)
    ms = measure([_variant(op, n, c, inputs, info) for n, c in zip(names, finalists)], final, info, device)
    (pick,) = _same_on_every_rank([min(range(len(finalists)), key=lambda j: (ms[names[j]], j))], info)
    selected = finalists[pick]
    confirm = [_variant(op, "heuristic", base, inputs, info)]
    if selected != base:
        confirm.append(_variant(op, "tuned", selected, inputs, info))
    confirmed_ms = measure(confirm + baselines, final, info, device)
    (keep,) = _same_on_every_rank([selected != base and confirmed_ms["tuned"] < confirmed_ms["heuristic"]], info)
    winner = selected if keep else base
    mine = config_to_dict(winner)
    everyone = [mine] * world
    if info.group is not None:
        dist.all_gather_object(everyone, mine, group=info.group)
    if any(d != mine for d in everyone):
        raise TuneError(f"{op} {shape}: the ranks hold different winners ({everyone}); nothing written")
    return ShapeResult(
        shape,
        winner,
        confirmed_ms["tuned" if keep else "heuristic"],
        confirmed_ms["heuristic"],
        len(space),
        screened,
        pruned + len(times) - len(survivors),
        failed,
        wrong,
        heuristic=base,
        nccl_ms=confirmed_ms["nccl"],
        gemm_ms=confirmed_ms["gemm"],
        selected=selected,
        selection_ms=ms[names[pick]],
    )


def comparison_row(op: str, dtype_name: str, r: ShapeResult, weight_layout: str = "linear", varied=()) -> dict:
    """One shape's tuned-vs-heuristic row of `fluxtp tune --out` (the confirmation's times);
    varied: the fields `--vary` named (the heuristic is then the config in use before)."""
    from fluxtp.bench.harness import overlap_efficiency, speedup

    def rounded(value, digits=4):
        return None if value is None else round(value, digits)

    ms = {"gemm": r.gemm_ms, "nccl": r.nccl_ms, "heuristic": r.heuristic_ms, "tuned": r.winner_ms}
    return {
        "op": op,
        "M": r.shape.M,
        "N": r.shape.N,
        "K": r.shape.K,
        "dtype": dtype_name,
        "weight_layout": weight_layout,
        "ms": {k: round(v, 5) for k, v in ms.items()},
        "E_overlap": {k: rounded(overlap_efficiency(ms[k], r.gemm_ms, r.nccl_ms)) for k in ("heuristic", "tuned")},
        "speedup_vs_nccl": {k: rounded(speedup(r.nccl_ms, ms[k])) for k in ("heuristic", "tuned")},
        "speedup_vs_heuristic": rounded(speedup(r.heuristic_ms, r.winner_ms)),
        "tuned_config": config_to_dict(r.winner),
        "heuristic_config": config_to_dict(r.heuristic),
        "tuned_is_heuristic": r.winner == r.heuristic,
        "candidates": r.space,
        "screened": r.screened,
        "pruned": r.pruned,
        "failed": len(r.failed) + len(r.wrong),
        **({"varied": list(varied)} if varied else {}),
    }


def format_comparison(rows: list[dict], title: str) -> str:
    from tabulate import tabulate

    def fmt(value) -> str:
        return "-" if value is None else f"{value:.4g}"

    body = [
        [
            f"{r['M']}x{r['N']}x{r['K']}",
            f"{r['screened']}/{r['candidates']}",
            r["pruned"],
            r["failed"],
            *(fmt(r["ms"][k]) for k in ("gemm", "nccl", "heuristic", "tuned")),
            fmt(r["speedup_vs_heuristic"]),
            fmt(r["E_overlap"]["heuristic"]),
            fmt(r["E_overlap"]["tuned"]),
            "= heuristic" if r["tuned_is_heuristic"] else describe(config_class(r["op"])(**r["tuned_config"])),
        ]
        for r in rows
    ]
    headers = ["MxNxK", "screened", "pruned", "failed", "gemm ms", "nccl ms", "heuristic ms", "tuned ms",
               "speedup", "E_overlap heuristic", "E_overlap tuned", "tuned config"]  # fmt: skip
    return f"{title}:\n" + tabulate(body, headers=headers, disable_numparse=True)


def write_comparison(rows: list[dict], job: TuneJob, gpu: str, world: int, cuda: bool) -> Path:
    """The rows in the results envelope (fluxtp.bench/1, scenario "tune") at job.out; a folder
    gets tune-<gpu>-x<n>-<date>-<op>.json (benchmarks/results/ naming)."""
    from fluxtp.bench.results import envelope, result_filename, write_json

    data = envelope("tune", rows, device=gpu, gpus=world if cuda else 0, world=world, command=job.command)
    out = Path(job.out)
    if job.out.endswith(("/", os.sep)) or out.is_dir():
        name = result_filename("tune", gpu, world, data["date"]).removesuffix(".json")
        out = out / f"{name}-{job.op}.json"
    return write_json(data, out)


def rank_tune(rank: int, world: int, job: TuneJob) -> None:
    """Every rank's body (inside an initialized default group, one GPU per rank; a gloo group
    runs on CPU, which only tests use, with stand-ins for the kernels)."""
    from fluxtp._dist import resolve_group
    from fluxtp.bench.results import git_commit, triton_version

    info = resolve_group(None)
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gpu = _gpu_name(device.type, device.index)  # the name the launchers' lookup uses
    generator = torch.Generator(device=device).manual_seed(20261122 + info.rank)
    dtype_name = str(job.dtype).removeprefix("torch.")
    if info.group is not None:
        dist.barrier(group=info.group)
    deadline_total = time.monotonic() + job.budget_s
    results, errors = [], []
    for i, shape in enumerate(job.shapes):
        left = _time_left(deadline_total, info, device)
        deadline = time.monotonic() + max(0.0, left) / (len(job.shapes) - i)
        start = None
        if job.vary:  # what the op launches for this shape now: the cache's, the shipped table's or the heuristic
            start = choose(
                job.op, gpu, world, dtype_name, shape.M, shape.N, shape.K, path=job.path,
                weight_layout=job.weight_layout, warp_specialized=_launcher_kernels_run(device, job.dtype),
            ).config
        try:
            result = tune_shape(
                job.op, shape, job.dtype, deadline, info, device, generator, rank == 0, job.weight_layout, start, job.vary
            )
        except TuneError as e:  # raised on every rank alike; the shapes tuned so far are still written
            errors.append(f"fluxtp tune: {e}")
            break
        results.append(result)
        if cuda:
            torch.cuda.empty_cache()  # the next shape's inputs may be larger
    rows = [comparison_row(job.op, dtype_name, r, job.weight_layout, job.vary) for r in results]
    run = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton_version(),
           "commit": git_commit()}  # fmt: skip
    entries = [entry_from_row(row, gpu, world, run) for row in rows]
    if rank == 0:
        layout = "" if job.weight_layout == "linear" else f", {job.weight_layout} weight"
        print(format_comparison(rows, f"{job.op} on {gpu} x{world}, {dtype_name}{layout}"), flush=True)
        for r in results:
            if r.selected != r.winner:
                print(
                    f"  {r.shape}: {describe(r.selected)} was the fastest finalist ({r.selection_ms:.4g} ms) but not "
                    f"faster than the heuristic when timed again: the heuristic is kept",
                    flush=True,
                )
            for config, why in r.failed:
                print(f"  {r.shape}: dropped {describe(config)}: {why}", flush=True)
        if entries:
            print(f"wrote {len(entries)} entries to {write_entries(entries, job.path)}", flush=True)
        if job.out and rows:
            print(f"wrote {write_comparison(rows, job, gpu, world, cuda)}", flush=True)
    errors += [
        f"fluxtp tune: {r.shape}: {describe(c)} computed a WRONG result ({why}): a kernel bug"
        for r in results
        for c, why in r.wrong
    ]
    if rank == 0:
        for line in errors:
            print(line, file=sys.stderr, flush=True)
    if info.group is not None:
        dist.barrier(group=info.group)  # rank 0 has written and printed before any rank exits
    if errors:
        raise SystemExit(1)


def cmd_tune(args) -> int:
    """`fluxtp tune`: checks the options, then launches like `fluxtp bench` (spawn or torchrun)."""
    from fluxtp.bench.launch import (
        LAUNCH_TIMEOUT_S,
        local_device_type,
        run_local,
        run_torchrun,
        under_torchrun,
    )
    from fluxtp.bench.ops import parse_shapes, shard_shapes

    parser = args.parser
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    if args.budget_seconds <= 0:
        parser.error(f"--budget-seconds must be positive, got {args.budget_seconds}")
    if args.dtype not in ("bfloat16", "float16"):
        parser.error(f"--dtype {args.dtype}: the multi-GPU tune runs bf16 and fp16 (FP8 GEMMs: --one-gpu)")
    vary = tuple(f for f in (getattr(args, "vary", None) or "").split(",") if f)
    fields = {f.name for f in dataclasses.fields(config_class(args.op))}
    if set(vary) - fields:
        parser.error(f"--vary {','.join(vary)}: {args.op} configs have the fields {', '.join(sorted(fields))}")
    if local_device_type() != "cuda":
        print(NO_GPU_MESSAGE, file=sys.stderr, flush=True)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("fluxtp tune: triton is not installed; the fused kernels need it", file=sys.stderr, flush=True)
        return 2
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = args.nproc if args.nproc is not None else torch.cuda.device_count()
        if world > torch.cuda.device_count():
            parser.error(f"--nproc {world}: this host has only {torch.cuda.device_count()} CUDA GPUs (one per process)")
    if world < 2:
        print(f"fluxtp tune: the fused kernels run on groups of 2 or more GPUs, got {world}", file=sys.stderr)
        return 2
    try:
        for shape in shapes:
            shard_shapes(args.op, shape, world)
    except ValueError as e:
        parser.error(str(e))
    job = TuneJob(
        args.op,
        shapes,
        TUNE_DTYPES[args.dtype],
        float(args.budget_seconds),
        str(cache_path()),
        getattr(args, "out", None),
        getattr(args, "command_line", "fluxtp tune"),
        getattr(args, "weight_layout", "linear"),
        vary,
    )
    if under_torchrun():
        return run_torchrun(job, rank_fn=rank_tune)
    return run_local(
        job, world, "cuda", rank_fn=rank_tune, command="fluxtp tune", timeout_s=max(LAUNCH_TIMEOUT_S, 2 * job.budget_s + 600)
    )


# ---------------------------------------------------------------- fluxtp info --configs


def _vs_nccl(choice: Choice, layout: str, by_thresholds: bool, measured_decides: bool = True) -> str:
    """The measured speedup over NCCL of an exact entry of the call's layout ("-" where there is
    none), and what "auto" makes of the call alone: the measurement's verdict where it is clear
    (measured_verdict) and decides for the op, else `by_thresholds`'s."""
    verdict, speedup = _verdict(choice.entry, choice.source, layout)
    if verdict is not None and measured_decides:
        auto = "auto: fused" if verdict else "auto: nccl"
    else:
        auto = f"auto: {'fused' if by_thresholds else 'nccl'} by thresholds"
    return f"{'-' if speedup is None else f'{speedup:.2f}x'} ({auto})"


def cmd_info_configs(args) -> int:
    """`fluxtp info --configs`: which config each shape would get, and why (no GPU needed),
    fitted to the terminal's width (or $COLUMNS)."""
    from fluxtp.backends.fused._scaled import Scaled
    from fluxtp.bench.ops import DEFAULT_SHAPES, parse_shapes, shard_shapes

    parser = args.parser
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = args.gpu or (torch.cuda.get_device_name(0) if gpus else "cpu")
    world = args.world if args.world is not None else max(2, gpus)
    if world < 2:
        parser.error(f"--world must be at least 2 (the fused kernels run on groups of 2 or more), got {world}")
    ops = FUSED_OPS if args.op in (None, "all") else (args.op,)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else None
        cases = [(op, s) for op in ops for s in (shapes or DEFAULT_SHAPES["cuda"][op])]
        for op, s in cases:
            shard_shapes(op, s, world)
    except ValueError as e:
        parser.error(str(e))
    path, shipped = cache_path(), shipped_path()
    # This GPU's configs as the launcher takes them here (another GPU's, named by --gpu: its entries
    # as recorded, its heuristic the Triton kernel's, as no local test says what that GPU runs).
    local = gpus > 0 and gpu == torch.cuda.get_device_name(0)
    dtype = getattr(torch, args.dtype)
    fast_accum = getattr(args, "fast_accum", False)
    if fast_accum and dtype != torch.float8_e4m3fn:
        parser.error("--fast-accum: FP8 calls only (--dtype float8_e4m3fn)")
    scaled = Scaled(torch.bfloat16, True, not fast_accum) if dtype == torch.float8_e4m3fn else None
    runs = _launcher_kernels_run(torch.device("cuda", 0), dtype, scaled) if local else None
    width = terminal_width()
    for label, table, is_shipped, absent in (
        ("config cache", path, False, "no file yet (`fluxtp tune` writes it)"),
        ("shipped table", shipped, True, "not found in this installation"),
    ):
        entries, problem = load(table, shipped=is_shipped)
        if problem is not None:
            state = f"ignored: {problem}"
        elif _signature(str(table)) is None:
            state = absent
        else:
            state = f"{len(entries)} entries"
        print(wrap(f"{label}: {table} ({state})", width))
    layout = getattr(args, "weight_layout", None) or "linear"
    print(
        wrap(
            f"lookup for: {gpu}, world {world}, {key_dtype(args.dtype, fast_accum)}"
            f"{' (bf16 output)' if scaled else ''}, {layout} weight "
            "(the user's cache, then the shipped table, then the heuristic)",
            width,
        )
    )
    for op in dict.fromkeys(op for op, _ in cases):
        print()
        op_shapes = [s for o, s in cases if o == op]
        print(_format_choices(op, op_shapes, gpu, world, args.dtype, layout, path, shipped, width, runs, scaled))
    return 0


def _launcher_kernels_run(device, dtype: torch.dtype, scaled=None) -> bool:
    """Whether a fused call of `dtype` (scaled: an FP8 one's) may take its op's warp-specialized
    kernel on `device` (the launchers' own test): the all-gather's, or the reduce-scatter's
    reducer kernel."""
    from fluxtp.backends.fused._scaled import pingpong_unsupported

    return pingpong_unsupported(device, scaled, dtype) is None


def _as_launched_here(op: str, choice: Choice, shape, world: int, dtype: str, scaled, runs: bool | None):
    """The config a call launches for a lookup's answer, where the launcher's warp-specialized
    kernels run (runs), do not, or, on another GPU than this one (None), as its entry records it
    (its heuristic on the Triton kernel): the unscaled reduce-scatter's moved to the reducer kernel
    where that rule says; an FP8 call's entry where its kernel takes it, else its own heuristic."""
    from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter

    tuned = None if choice.source == "heuristic" else choice.config
    if runs is None and (tuned is not None or scaled is None):
        return choice.config
    runs = bool(runs)
    if op == "all_gather_matmul":
        if scaled is None:
            config = choice.config if tuned is None else _all_gather_matmul.runnable(tuned, runs)
            return _all_gather_matmul.routed(config, shape.M // world, shape.N // world, shape.K, world, runs)
        return _all_gather_matmul.scaled_config(tuned, shape.M // world, shape.N // world, shape.K, world, scaled, runs)
    k = shape.K // world
    if scaled is None:
        itemsize = getattr(torch, dtype).itemsize
        return _matmul_reduce_scatter.routed(choice.config, shape.M, shape.N, k, world, itemsize, runs)
    return _matmul_reduce_scatter.scaled_config(tuned, shape.M, shape.N, k, world, scaled, runs)


def _format_choices(op, shapes, gpu, world, dtype, layout, path, shipped, width, runs=None, scaled=None) -> str:
    """One op's table for `fluxtp info --configs`, fitted to `width`: the config of each shape and
    where it comes from; below it, why, for the shapes whose source and bucket do not say it all
    (a nearest bucket, another layout's entry, the heuristic), grouped by reason. runs: whether
    the launcher's warp-specialized kernels run on this GPU (None: another GPU's lookup); scaled:
    an FP8 call's (a bf16 output)."""
    from fluxtp.backends.fused import _UNSCALED, preferred_by_thresholds

    rows, reasons = [], {}
    key = key_dtype(dtype, scaled is not None and not scaled.precise_acc)
    auto_op = op if scaled is None else next(name for name, of in _UNSCALED.items() if of == op)  # auto's op name
    for s in shapes:
        choice = choose(op, gpu, world, key, s.M, s.N, s.K, path=path, shipped_table=shipped, weight_layout=layout,
                        warp_specialized=bool(runs) and op == "all_gather_matmul")  # fmt: skip
        config = _as_launched_here(op, choice, s, world, dtype, scaled, runs)
        moved = op == "matmul_reduce_scatter" and config.warp_specialized and not choice.config.warp_specialized
        twin = config != choice.config and config == dataclasses.replace(choice.config, warp_specialized=False)
        if config != choice.config and choice.source != "heuristic" and not (moved or twin):
            why = f"heuristic: the {choice.origin}'s entry ({describe(choice.config)}) names a kernel that does not run here"
            choice = dataclasses.replace(choice, source="heuristic", origin=HEURISTIC, entry=None, why=why)
        source = choice.origin if choice.source == "heuristic" else f"{choice.origin}, {choice.source}"
        source += ", on the reducer kernel" if moved else ", on the Triton kernel" if twin else ""
        by_thresholds = preferred_by_thresholds(auto_op, s.M, s.N // world, world)
        rows.append([str(s), m_bucket(s.M), source, describe(config),
                     _vs_nccl(choice, layout, by_thresholds, measured_decides=scaled is None)])  # fmt: skip
        said_all = choice.source == "exact" and choice.entry.key.weight_layout == layout and not (moved or twin)
        if not said_all:
            reasons.setdefault(choice.why, []).append(s)
        if twin:
            reasons.setdefault("the entry's warp-specialized kernel does not run here: its tiling on Triton", []).append(s)
        if runs is None and gpu != "cpu" and (op == "all_gather_matmul" or scaled is None):
            on_hopper = _as_launched_here(op, choice, s, world, dtype, scaled, True)
            if on_hopper != config:  # what a Hopper GPU of that name launches; no local test says it is one
                instead = "the reducer kernel instead" if op == "matmul_reduce_scatter" else "launched as"
                reasons.setdefault(f"on a Hopper GPU whose Triton runs the warp-specialized kernels, {instead}: "
                                   f"{describe(on_hopper)}", []).append(s)  # fmt: skip
    headers = ["MxNxK", "M bucket", "source", "config", "vs nccl"]
    # The config wraps first (it is the widest), then the source and the verdict.
    table = fit_table(rows, headers, width, wrappable={2: 9, 3: 20, 4: 8})
    lines = [f"{op}:", table]
    same_nk = len({(s.N, s.K) for s in shapes}) == 1
    for why, which in reasons.items():
        label = "M " + ", ".join(str(s.M) for s in which) if same_nk else ", ".join(map(str, which))
        lines.append(wrap(f"{label}: {why}", width, indent="    "))
    return "\n".join(lines)


# ---------------------------------------------------------------- python -m fluxtp.tune merge-defaults


def main(argv: list[str] | None = None) -> int:
    """`python -m fluxtp.tune merge-defaults FILE [--into PATH]`: a maintainer's step (see the module doc)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fluxtp.tune",
        description="Maintenance of the config table shipped with fluxtp (fluxtp/configs/default.json).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    merge = commands.add_parser(
        "merge-defaults",
        help="merge a `fluxtp tune` cache file into the shipped table",
        description="Merge the measured entries of a `fluxtp tune` cache file (FLUXTP_CACHE_DIR=D fluxtp tune ... "
        "writes D/configs.json), or the tuned rows of its --out results file, into the shipped table; entries with "
        "the same key are replaced.",
    )
    merge.add_argument("file", help="the cache file to merge (schema fluxtp.tune/1), or a `fluxtp tune --out` results "
                       "file (its tuned rows)")
    merge.add_argument("--shapes", metavar="MxNxK,...", default="",
                       help="of a results file, these rows only (those the baseline kept included)")
    merge.add_argument("--into", metavar="PATH", help="the table to merge into (default: the package's default.json)")
    args = parser.parse_args(argv)
    target = Path(args.into) if args.into else shipped_path()
    shapes = tuple(s for s in args.shapes.split(",") if s)
    try:
        added, replaced = merge_into_shipped(args.file, target, shapes)
    except CacheFileError as e:
        print(f"python -m fluxtp.tune merge-defaults: {e}", file=sys.stderr)
        return 2
    total = len(parse(target.read_text()))
    print(f"merged {added + replaced} entries from {args.file} into {target} ({added} new, {replaced} replaced; "
          f"{total} in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
