"""Fused AllGather+GEMM launcher: copy-engine pulls with per-chunk signals + one persistent GEMM.

Per call, with S the caller's (compute) stream and C the side copy stream:
  C: fork from S; publish this rank's shard in its symmetric buffer; barrier (every rank has
     published).
  S: the persistent GEMM: this rank's rows straight from its shard (no copy to wait for), then
     the peers' rows from x_gathered, waiting for each chunk's signal before its tiles' K loops;
     its last program resets the signals for the next call (no reset launch on the host).
  C: pull each peer's shard into x_gathered in ring order rank+1, rank+2, ... chunk by chunk
     (signal each); copy this rank's shard into x_gathered when the caller wants it back;
     barrier (every rank has finished reading the others' buffers, so the next call may
     overwrite them).
  S: join C, so everything C touched is ordered before later work on S (caching allocator).
The GEMM goes in before the host spends its time on the peers' copies: it computes this rank's
rows meanwhile. Not before the first barrier, a kernel the peers' rows wait for: launched ahead
of it, the GEMM spun on those rows and the first call trapped on 2x H200 (the barrier never ran
beside the GEMM that filled every SM).
No host synchronization anywhere: back-to-back calls and CUDA graph capture work; the barriers
and the in-kernel waits are bounded and fail with an error instead of hanging.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp.configs import AllGatherMatmulConfig, tuned_config
from fluxtp.backends.fused._launch import descriptor, launch_compiled, num_sms, tma_ready, weight_operand
from fluxtp.kernels._all_gather_matmul import all_gather_matmul_kernel

BARRIER_TIMEOUT_MS = 60_000
# In-kernel spin bound: each spin is one atomic read of local memory (well under a microsecond),
# so 2^27 spins is tens of seconds, far past any real wait and short of a hang.
MAX_SPINS = 1 << 27
_OP = "all_gather_matmul"


@dataclass
class _Workspace:
    shard: symm.SymmBuffer  # this rank's published shard, read by the peers
    signals: torch.Tensor  # int32 chunk flags (local memory, written by the copy stream, reset by the GEMM)
    done: torch.Tensor  # int32 [1]: the GEMM's count of finished programs (0 between calls)
    views: dict = dataclasses.field(default_factory=dict)  # (dtype, shape) -> [view of rank r's shard]

    def shard_views(self, dtype, shape, world: int) -> list[torch.Tensor]:
        """Every rank's published shard as a tensor (made once per shape: get_buffer is slow)."""
        key = (dtype, tuple(shape))
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = [self.shard.peer(r, dtype, shape) for r in range(world)]
        return views


_workspaces: dict[tuple[str, int], _Workspace] = {}


def _workspace(info: GroupInfo, device, shard_bytes: int, num_signals: int) -> _Workspace:
    key = (info.name, torch.device(device).index or 0)
    ws = _workspaces.get(key)
    shard = symm.buffer(info, "all_gather_matmul", shard_bytes, device)
    if ws is None or ws.shard is not shard or ws.signals.numel() < num_signals:
        fits = ws is not None and ws.signals.numel() >= num_signals
        if fits:
            signals, done = ws.signals, ws.done
        else:  # zero once; from then on every GEMM leaves them zero
            signals = torch.zeros(max(num_signals, 64), dtype=torch.int32, device=device)
            done = torch.zeros(1, dtype=torch.int32, device=device)
        ws = _workspaces[key] = _Workspace(shard, signals, done)
    return ws


def launch_gemm(
    x_gathered, x_own, weight, bias, y, signals, done, rows_per_rank, chunk_rows, info, config, max_spins=MAX_SPINS,
    signal_reset=0,
):
    """The persistent kernel alone (CPU tensors run it under TRITON_INTERPRET=1).

    x_gathered [W*m, k] (only the peers' rows are read), x_own this rank's shard [m, k]; weight
    [n, k], or a transposed view of a [k, n] tensor (read as it is, not copied). done is an int32
    [1] counter that reads 0 (the kernel leaves it 0); the kernel's last program writes
    signal_reset into the call's W * cdiv(rows_per_rank, chunk_rows) signals."""
    n, k = weight.shape
    sms = num_sms(y.device)
    tiles = info.world_size * triton.cdiv(rows_per_rank, config.block_m) * triton.cdiv(n, config.block_n)
    a_desc = descriptor(x_gathered, [config.block_m, config.block_k])
    own_desc = descriptor(x_own, [config.block_m, config.block_k])
    b, b_kn = weight_operand(weight)
    b_desc = descriptor(b, [config.block_k, config.block_n] if b_kn else [config.block_n, config.block_k])
    # TMA stores need whole tiles inside each segment and 16-byte output rows.
    tma_store = config.tma_store and rows_per_rank % config.block_m == 0 and (y.stride(0) * y.element_size()) % 16 == 0
    store_n = config.block_n // 2 if config.epilogue_subtile else config.block_n
    c_desc = descriptor(y, [config.block_m, store_n]) if tma_store else None
    launch_compiled(
        all_gather_matmul_kernel,
        min(sms, tiles),
        a_desc,
        own_desc,
        b_desc,
        c_desc,
        y,
        y if bias is None else bias,
        signals,
        done,
        rows_per_rank,
        n,
        k,
        y.stride(0),
        chunk_rows,
        triton.cdiv(rows_per_rank, chunk_rows),
        max_spins,
        signal_reset,
        RANK=info.rank,
        WORLD=info.world_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        NUM_SMS=sms,
        HAS_BIAS=bias is not None,
        NUM_STAGES=config.num_stages,
        FLATTEN=config.flatten and triton.cdiv(k, config.block_k) >= config.num_stages,
        TMA_STORE=tma_store,
        EPILOGUE_SUBTILE=config.epilogue_subtile,
        B_KN=b_kn,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _set_signal(signals: torch.Tensor, index: int) -> None:
    """signals[index] = 1 on the current stream, ordered after the copies before it."""
    torch.ops.symm_mem.stream_write_value32_(signals.view(torch.uint32), index, 1)


def _config_for(x_shard, weight, world: int, config: AllGatherMatmulConfig | None) -> AllGatherMatmulConfig:
    """The caller's config, else fluxtp tune's cached one for this shape, else the heuristic."""
    rows_per_rank, k = x_shard.shape
    return config or tuned_config(_OP, x_shard, weight, world) or AllGatherMatmulConfig.heuristic(
        rows_per_rank, weight.shape[0], k, world
    )


def all_gather_matmul(
    x_shard, weight, bias, info: GroupInfo, return_gathered: bool, config: AllGatherMatmulConfig | None = None
):
    x_shard = tma_ready(x_shard)  # the weight: launch_gemm reads either layout as it is
    rows_per_rank, k = x_shard.shape
    n = weight.shape[0]
    world, rank = info.world_size, info.rank
    config = _config_for(x_shard, weight, world, config)
    chunk_rows = config.chunk_rows_for(rows_per_rank)
    chunks_per_rank = triton.cdiv(rows_per_rank, chunk_rows)
    device = x_shard.device

    ws = _workspace(info, device, x_shard.numel() * x_shard.element_size(), world * chunks_per_rank)
    x_gathered = torch.empty(rows_per_rank * world, k, dtype=x_shard.dtype, device=device)
    y = torch.empty(rows_per_rank * world, n, dtype=x_shard.dtype, device=device)

    compute = torch.cuda.current_stream(device)
    copy = symm.copy_stream(device)
    copy.wait_stream(compute)

    def copy_segment(segment: int, source: torch.Tensor) -> None:
        """Rank `segment`'s rows of x_gathered from `source`, chunk by chunk, a signal after each."""
        for c in range(chunks_per_rank):
            r0, r1 = c * chunk_rows, min((c + 1) * chunk_rows, rows_per_rank)
            x_gathered[segment * rows_per_rank + r0 : segment * rows_per_rank + r1].copy_(source[r0:r1])
            _set_signal(ws.signals, segment * chunks_per_rank + c)

    # set_stream rather than `with torch.cuda.stream(copy)`: 1.4 against 9 us of host time per
    # call on the H200 hosts (docs/perf-log.md); compute is the current device's stream.
    torch.cuda.set_stream(copy)
    try:
        shards = ws.shard_views(x_shard.dtype, x_shard.shape, world)
        shards[rank].copy_(x_shard)
        # Before the GEMM: see the module docstring.
        ws.shard.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
    finally:
        torch.cuda.set_stream(compute)
    launch_gemm(x_gathered, x_shard, weight, bias, y, ws.signals, ws.done, rows_per_rank, chunk_rows, info, config)
    torch.cuda.set_stream(copy)
    try:
        for step in range(1, world):
            peer = (rank + step) % world
            copy_segment(peer, shards[peer])
        if return_gathered:  # the GEMM reads this rank's rows from x_shard itself
            x_gathered[rank * rows_per_rank : (rank + 1) * rows_per_rank].copy_(x_shard)
        ws.shard.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
    finally:
        torch.cuda.set_stream(compute)
    compute.wait_stream(copy)
    return y, x_gathered if return_gathered else None


def gemm_only(x_shard, weight, bias, info: GroupInfo, config: AllGatherMatmulConfig | None = None):
    """The fused kernel with every signal preset (no communication), for the benchmark.

    Returns a zero-argument callable that launches exactly the kernel all_gather_matmul
    launches for these inputs, reading an already gathered input.
    """
    x_shard = tma_ready(x_shard)  # the weight: launch_gemm reads either layout as it is
    rows_per_rank = x_shard.shape[0]
    world = info.world_size
    config = _config_for(x_shard, weight, world, config)  # the same config as all_gather_matmul
    chunk_rows = config.chunk_rows_for(rows_per_rank)
    x_gathered = x_shard.repeat(world, 1)
    # Every chunk already there, and the kernel's reset leaves them so (signal_reset=1).
    signals = torch.ones(world * triton.cdiv(rows_per_rank, chunk_rows), dtype=torch.int32, device=x_shard.device)
    done = torch.zeros(1, dtype=torch.int32, device=x_shard.device)
    y = torch.empty(rows_per_rank * world, weight.shape[0], dtype=x_shard.dtype, device=x_shard.device)

    def run():
        launch_gemm(
            x_gathered, x_shard, weight, bias, y, signals, done, rows_per_rank, chunk_rows, info, config, signal_reset=1
        )
        return y

    return run
