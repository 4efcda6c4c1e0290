"""The fused AllGather+GEMM kernel on ONE GPU, its waits really waiting: one simulated rank's
kernel runs while a copy stream delivers the peers' rows chunk by chunk, each chunk held back
by the host for a few milliseconds.

The copy stream waits on gate words in host-pinned memory (cuStreamWaitValue32: the GPU's front
end polls them, no SM is used, so the gates work beside a persistent kernel that fills every
SM; a sleep kernel would need an SM the GEMM holds). The host opens the gates one by one and
checks, before the last one, that the kernel has not finished: it cannot, unless it computed on
rows that had not arrived. Every row a tile could read before its chunk arrives is NaN until
the copy, and the output is checked against float64. NVLink, the symmetric barriers, graphs and
two groups need the multi-GPU file.
"""

import dataclasses
import random
import time

import pytest
import torch
import triton

from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused.ag_gemm import AllGatherMatmulConfig, launch_gemm
from tests._cases import TOLERANCE, draw, rel_error

pytestmark = pytest.mark.gpus(1)

WIDE = AllGatherMatmulConfig()  # 128x256x64, 3 stages, 8 warps: the large-M heuristic
NARROW = AllGatherMatmulConfig(block_n=128, num_stages=4)  # the small-M heuristic
GATE_DELAY_S = 0.004
MAX_SPINS = 1 << 26  # a chunk 4 ms late is far inside it; a lost one still traps


def _deliver(x_gathered, source, signals, gates, rank, world, m, chunk_rows):
    """On the current stream: each peer's rows in ring order, chunk by chunk, each behind its gate."""
    chunks = triton.cdiv(m, chunk_rows)
    wait_value32 = symm._driver_wait_value32()
    stream = torch.cuda.current_stream().cuda_stream
    gate = 0
    for step in range(1, world):
        segment = (rank + step) % world
        for c in range(chunks):
            r0, r1 = segment * m + c * chunk_rows, segment * m + min((c + 1) * chunk_rows, m)
            status = wait_value32(stream, gates.data_ptr() + 4 * gate, 1, 0)  # 0: until >= 1
            assert status == 0, f"cuStreamWaitValue32 on host memory failed: CUDA driver error {status}"
            x_gathered[r0:r1].copy_(source[r0:r1])
            torch.ops.symm_mem.stream_write_value32_(signals.view(torch.uint32), segment * chunks + c, 1)
            gate += 1
    return gate


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize(
    "world, rank, m, n, k, base, chunk_rows, dtype, with_bias",
    [
        (2, 1, 1000, 1000, 2048, WIDE, 256, torch.bfloat16, True),  # ragged rows, 4 chunks, N not a tile multiple
        (2, 0, 512, 2048, 4096, NARROW, 512, torch.float16, False),  # one chunk per rank (the small-M default)
        (4, 2, 384, 1536, 1024, NARROW, 128, torch.bfloat16, True),  # a chunk per tile row, ring order wraps
    ],
)
def test_waits_hold_tiles_until_their_chunk_arrives(flatten, world, rank, m, n, k, base, chunk_rows, dtype, with_bias):
    seed = random.randrange(1 << 30)
    what = f"world={world} rank={rank} m={m} flatten={flatten} seed={seed}"
    cfg = dataclasses.replace(base, chunk_rows=chunk_rows, flatten=flatten)
    x = draw(seed, (world * m, k), dtype, "cuda")
    w = draw(seed + 1, (n, k), dtype, "cuda", scale=k**-0.5)
    b = draw(seed + 2, (n,), dtype, "cuda") if with_bias else None
    x_own = x[rank * m : (rank + 1) * m].clone()
    x_gathered = torch.full_like(x, float("nan"))  # the kernel reads its own rows from x_own, the rest once copied
    y = torch.full((world * m, n), float("nan"), dtype=dtype, device="cuda")
    chunks = triton.cdiv(m, cfg.chunk_rows_for(m))
    signals = torch.zeros(world * chunks, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    gates = torch.zeros(world * chunks, dtype=torch.int32, pin_memory=True)
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    finished = torch.cuda.Event()
    copy.wait_stream(compute)  # the poison is in place before any copy
    info = GroupInfo(None, rank, world)
    launch_gemm(x_gathered, x_own, w, b, y, signals, done, m, cfg.chunk_rows_for(m), info, cfg, max_spins=MAX_SPINS)
    finished.record(compute)
    with torch.cuda.stream(copy):
        num_gates = _deliver(x_gathered, x, signals, gates, rank, world, m, cfg.chunk_rows_for(m))
    try:
        for gate in range(num_gates):
            time.sleep(GATE_DELAY_S)
            if gate == num_gates - 1:
                assert not finished.query(), f"{what}: the kernel finished before the last chunk arrived"
            gates[gate] = 1
    finally:
        gates.fill_(1)  # never leave the copy stream waiting
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    err = rel_error(y, ref)
    assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"
    peers = [r for r in range(world) if r != rank]
    for r in peers:
        rows = slice(r * m, (r + 1) * m)
        assert torch.equal(x_gathered[rows], x[rows]), f"{what}: rank {r}'s rows were not copied exactly"
    assert signals.eq(0).all() and done.item() == 0, f"{what}: the kernel left signals {signals.tolist()}, done {done.item()}"
