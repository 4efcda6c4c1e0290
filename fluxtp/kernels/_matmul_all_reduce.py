"""Persistent one-shot GEMM+AllReduce (decode): out = sum over ranks of x_r @ w_r^T (+ bias), bitwise
the same on every rank; with HAS_GEMM False the same kernel sums an already computed tensor.

The [M, N] result is cut into BLOCK_M x BLOCK_N tiles (a flat tensor of `numel` values is
viewed as rows of N; values past numel are masked). Two phases, each over this program's
tiles (tile_id = program id, + NUM_SMS, ...):
1. push: compute the tile (a pipelined TMA K loop; or load it from x), round it once to the
   output dtype and store it into slot (parity, RANK) of every rank's workspace, the peers
   first (NVLink stores) and this rank's own last; after a CTA barrier, one release atomic
   (scope "sys") per peer sets flag[tile * WORLD + RANK] in that peer's workspace to epoch + 1.
2. reduce: wait (acquire, bounded) until every peer's flag of the tile has reached epoch + 1,
   then add the W slots of the tile in rank order 0..W-1 in float32 (every rank adds the same
   rounded values in the same order: the same bits everywhere), add the bias once, round once
   into out. Every rank's programs visit the tiles in the same order, so a peer's tile is
   usually there by the time it is needed: the waits overlap the peers' last tiles.
The last program to finish advances the epoch (a counter in this rank's ordinary memory:
counters[0] the epoch, counters[1] the programs done), so the next launch on the stream, and
every replay of a CUDA graph, sees epoch + 1 without any host-side reset or barrier.

Why no reset and no barrier is needed: flags only grow (they hold the call's epoch + 1, and
waits compare with `>=`), and data alternates between two slot sets by epoch parity. A rank
writes parity p of a peer's workspace at call e only after finishing call e-1, whose reduce
phase waited for that peer's every flag of call e-1, which the peer set after finishing its own
call e-2: the last call that read parity p. Workspace layout (bytes from each buffer's base):
int32 flags [FLAG_CAPACITY] at 0 (zeroed once when the buffer is created), then at
data_offset 2 * WORLD slots of slot_bytes bytes each: slot (parity, src) = parity * WORLD + src.

A wait that gives up records (source rank, tile, rank) in host-pinned memory and traps (_sync.give_up); no device_print in the kernel (its printf costs 25%).
"""

import triton
import triton.language as tl

from fluxtp.kernels._sync import give_up, set_flag, wait_flag_at_least
from fluxtp.kernels._tiles import grouped_tile


@triton.jit
def _slot(buffer_ptrs, rank, data_offset, slot, slot_bytes, dtype: tl.constexpr):
    """Base pointer of slot `slot` in `rank`'s workspace (16-byte aligned: slots are padded)."""
    base = tl.load(buffer_ptrs + rank) + data_offset + slot.to(tl.int64) * slot_bytes
    return tl.multiple_of(base.to(tl.pointer_type(dtype)), 16)


@triton.jit
def matmul_all_reduce_kernel(
    a_desc,  # HAS_GEMM: TensorDescriptor over x [M, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # HAS_GEMM: TensorDescriptor over w [N, K] (nn.Linear weight), block [BLOCK_N, BLOCK_K]
    x_ptr,  # not HAS_GEMM: the values to sum, numel contiguous values (viewed as rows of N)
    out_ptr,  # numel values, contiguous
    bias_ptr,  # [N] or a dummy when HAS_BIAS is False
    buffer_ptrs,  # int64 [W]: base address of every rank's workspace
    counters_ptr,  # int32 [2] in this rank's memory: (epoch, programs done)
    M,
    N,
    K,
    numel,
    data_offset,
    slot_bytes,
    max_spins,
    report_ptr,  # int32 [3]: where a timed-out wait records (source rank, tile, rank)
    PHASES: tl.constexpr,  # 1 push, 2 reduce, 3 both (the interpreter test runs them apart)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    HAS_GEMM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr,  # compute the tile as (w @ x^T)^T: small M becomes the MMA's N side
    NUM_STAGES: tl.constexpr,
):
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    epoch = tl.load(counters_ptr, volatile=True)
    parity = epoch & 1
    target = epoch + 1
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    local_flags = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(tl.int32))

    if PHASES & 1:
        for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, num_stages=1):
            pid_m, pid_n = grouped_tile(tile_id, tiles_m, tiles_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            index = offs_m[:, None] * N + offs_n[None, :]  # int32: one-shot calls hold < 2^31 values
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :] & (index < numel)
            if HAS_GEMM:
                if SWAP_AB:
                    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    for ki in tl.range(tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
                        a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                        b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                        acc_t = tl.dot(b, a.T, acc_t)
                    acc = tl.trans(acc_t)
                else:
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for ki in tl.range(tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
                        a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                        b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                        acc = tl.dot(a, b.T, acc)
                value = acc.to(dtype)
            else:
                value = tl.load(x_ptr + index, mask=mask)
            # Peers first (their stores cross NVLink, the slow part), this rank's own slot last.
            for i in tl.static_range(WORLD):
                dst = (RANK + 1 + i) % WORLD
                slot = _slot(buffer_ptrs, dst, data_offset, parity * WORLD + RANK, slot_bytes, dtype)
                tl.store(slot + index, value, mask=mask)
            tl.debug_barrier()  # every thread's stores precede the release below
            for i in tl.static_range(WORLD - 1):
                dst = (RANK + 1 + i) % WORLD
                peer_flags = tl.load(buffer_ptrs + dst).to(tl.pointer_type(tl.int32))
                set_flag(peer_flags + tile_id * WORLD + RANK, target, "sys")

    if PHASES & 2:
        for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, num_stages=1):
            for src in tl.static_range(WORLD):
                if src != RANK:
                    flag_ptr = local_flags + tile_id * WORLD + src
                    if not wait_flag_at_least(flag_ptr, target, max_spins, "sys"):
                        give_up(report_ptr, flag_ptr, src, tile_id, RANK)
            tl.debug_barrier()  # no thread loads a partial before the acquires above
            pid_m, pid_n = grouped_tile(tile_id, tiles_m, tiles_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            index = offs_m[:, None] * N + offs_n[None, :]  # int32: one-shot calls hold < 2^31 values
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :] & (index < numel)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in tl.static_range(WORLD):
                slot = _slot(buffer_ptrs, RANK, data_offset, parity * WORLD + src, slot_bytes, dtype)
                # .cg: from L2, where the peers' stores land, never from a stale L1 line.
                total += tl.load(slot + index, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + index, total.to(dtype), mask=mask)

        # The last program to get here advances the epoch for the next launch on this stream.
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(counters_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(counters_ptr, target, sem="release", scope="gpu")
