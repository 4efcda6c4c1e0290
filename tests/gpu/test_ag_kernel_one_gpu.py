"""The fused AllGather+GEMM kernel on ONE GPU, its waits really waiting: one simulated rank's
kernel runs while a copy stream delivers the peers' rows chunk by chunk, each chunk held back
by the host for a few milliseconds (tests/_gates.py). Before the last chunk the kernel must still
be running: it cannot finish unless it computed on rows that had not arrived. Every row a tile
could read before its chunk arrives is NaN until the copy, and the output is checked against
float64. NVLink, the symmetric barriers, graphs and two groups need the multi-GPU file.
"""

import dataclasses
import json
import random

import pytest
import torch
import triton

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused._all_gather_matmul import MAX_SPINS as DEFAULT_SPINS
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig, _Gemm, _set_signal, launch_gemm
from tests._cases import TOLERANCE, draw, rel_error
from tests._gates import HostGates
from tests.gpu import run_until_trap, skip_unless_hopper

pytestmark = pytest.mark.gpus(1)

WIDE = AllGatherMatmulConfig()  # 128x256x64, 3 stages, 8 warps: the large-M heuristic
NARROW = AllGatherMatmulConfig(block_n=128, num_stages=4)  # the small-M heuristic
GATE_DELAY_S = 0.004
MAX_SPINS = 1 << 26  # a chunk 4 ms late is far inside it; a lost one still traps
# The kernels a config can launch: the Triton one flattened (one loop over tile and K) or not,
# and the warp-specialized Gluon one (Hopper), its bands within segments or (asked) across them; in
# a grid of one wave it counts them across by itself. Either kernel may count the peers' bands
# across the peers' segments (peer_bands); the warp-specialized one may split its last partial wave
# of tiles by K over every program (stream_k).
KERNELS = {
    "flatten": {"flatten": True},
    "loop": {"flatten": False},
    "flatten_peer_bands": {"flatten": True, "peer_bands": True},
    "loop_peer_bands": {"flatten": False, "peer_bands": True},
    "warp_specialized": {"warp_specialized": True},
    "warp_specialized_bands": {"warp_specialized": True, "bands_across_segments": True},
    "warp_specialized_peer_bands": {"warp_specialized": True, "peer_bands": True},
    "warp_specialized_stream_k": {"warp_specialized": True, "stream_k": True},
}


def _deliver(x_gathered, source, signals, gates, rank, world, m, chunk_rows):
    """On the current stream: each peer's rows in ring order, chunk by chunk, each behind a gate."""
    chunks = triton.cdiv(m, chunk_rows)
    for step in range(1, world):
        segment = (rank + step) % world
        for c in range(chunks):
            r0, r1 = segment * m + c * chunk_rows, segment * m + min((c + 1) * chunk_rows, m)
            gates.hold()
            x_gathered[r0:r1].copy_(source[r0:r1])
            _set_signal(signals, segment * chunks + c)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "world, rank, m, n, k, base, chunk_rows, dtype, with_bias, transposed",
    [
        (2, 1, 1000, 1000, 2048, WIDE, 256, torch.bfloat16, True, False),  # ragged rows, 4 chunks, N not a tile multiple
        (2, 0, 512, 2048, 4096, NARROW, 512, torch.float16, False, False),  # one chunk per rank (the small-M default)
        (4, 2, 384, 1536, 1024, NARROW, 128, torch.bfloat16, True, False),  # a chunk per tile row, ring order wraps
        # The backward's weight: a transposed view of a [k, n] tensor, read K x N as it is.
        (2, 1, 1000, 1024, 2048, WIDE, 256, torch.bfloat16, True, True),
        (4, 3, 256, 512, 1024, NARROW, 128, torch.float16, False, True),
        # 4 x 8 x 32 = 1024 tiles: several waves, each program's tiles from several chunks
        (4, 1, 1024, 4096, 512, NARROW, 256, torch.bfloat16, False, False),
    ],
)
def test_waits_hold_tiles_until_their_chunk_arrives(kernel, world, rank, m, n, k, base, chunk_rows, dtype, with_bias,
                                                    transposed):  # fmt: skip
    if kernel.startswith("warp_specialized"):
        skip_unless_hopper()
    seed = random.randrange(1 << 30)
    what = f"world={world} rank={rank} m={m} kernel={kernel} transposed={transposed} seed={seed}"
    cfg = dataclasses.replace(base, chunk_rows=chunk_rows, **KERNELS[kernel])
    x = draw(seed, (world * m, k), dtype, "cuda")
    w = draw(seed + 1, (k, n) if transposed else (n, k), dtype, "cuda", scale=k**-0.5)
    w = w.t() if transposed else w
    b = draw(seed + 2, (n,), dtype, "cuda") if with_bias else None
    x_own = x[rank * m : (rank + 1) * m].clone()
    x_gathered = torch.full_like(x, float("nan"))  # the kernel reads its own rows from x_own, the rest once copied
    y = torch.full((world * m, n), float("nan"), dtype=dtype, device="cuda")
    chunk_rows = cfg.chunk_rows_for(m)
    chunks = triton.cdiv(m, chunk_rows)
    signals = torch.zeros(world * chunks, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    gates = HostGates((world - 1) * chunks)
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    finished = torch.cuda.Event()
    copy.wait_stream(compute)  # the poison is in place before any copy
    info = GroupInfo(None, rank, world)
    launch_gemm(x_gathered, x_own, w, b, y, signals, done, m, chunk_rows, info, cfg, max_spins=MAX_SPINS)
    finished.record(compute)
    with torch.cuda.stream(copy):
        _deliver(x_gathered, x, signals, gates, rank, world, m, chunk_rows)
    gates.open_slowly(finished, GATE_DELAY_S, what)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    err = rel_error(y, ref)
    assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"
    peers = [r for r in range(world) if r != rank]
    for r in peers:
        rows = slice(r * m, (r + 1) * m)
        assert torch.equal(x_gathered[rows], x[rows]), f"{what}: rank {r}'s rows were not copied exactly"
    assert signals.eq(0).all() and done.item() == 0, f"{what}: the kernel left signals {signals.tolist()}, done {done.item()}"


# One process (a trap poisons its CUDA context): rank 1 of a world of 4 whose chunk 1 of rank 3's
# rows never arrives; every other chunk is there. The wait must give up and name the chunk.
_TIMEOUT_SCRIPT = """
import json
import sys
import torch
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig, launch_gemm

world, rank, m, n, k, chunk_rows = 4, 1, 256, 512, 1024, 128
config = AllGatherMatmulConfig(block_n=128, num_stages=4, chunk_rows=chunk_rows, **json.loads(sys.argv[1]))
x = torch.randn(world * m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
y = torch.empty(world * m, n, device="cuda", dtype=torch.bfloat16)
signals = torch.ones(world * (m // chunk_rows), dtype=torch.int32, device="cuda")
signals[3 * (m // chunk_rows) + 1] = 0
done = torch.zeros(1, dtype=torch.int32, device="cuda")
launch_gemm(x, x[rank * m : (rank + 1) * m], w, None, y, signals, done, m, chunk_rows, GroupInfo(None, rank, world), config,
            max_spins=100_000)
"""


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_chunk_that_never_arrives_traps_and_is_named(kernel):
    if kernel.startswith("warp_specialized"):
        skip_unless_hopper()
    proc = run_until_trap(_TIMEOUT_SCRIPT, "_all_gather_matmul", json.dumps(KERNELS[kernel]))
    out = proc.stdout
    assert "rank 1 timed out waiting for chunk 1 of rank 3's rows" in out, out[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize(
    "world, m, n, k, dtype, with_bias",
    [
        (8, 128, 3584, 4096, torch.bfloat16, False),  # llama3-70b TP=8, 1024 tokens: 112 tiles, all split
        (4, 500, 1000, 2048, torch.float16, True),  # ragged rows and columns: 64 tiles over 131 programs
        (2, 1000, 7000, 1024, torch.bfloat16, True),  # 448 tiles: the 55 past three waves split, 16 K blocks each
    ],
)
def test_stream_k_over_reused_buffers(world, m, n, k, dtype, with_bias):
    """One launch plan called again and again on fresh data (GEMM-only mode: every chunk there): the
    split tiles' sums match float64 each time, and every program's flags read zero after each call;
    then calls one after another, no sync between, alternating two inputs: each bitwise its input's
    first output (a partial flagged before its stores landed would carry the call before's)."""
    skip_unless_hopper()
    cfg = dataclasses.replace(WIDE, warp_specialized=True, stream_k=True)
    rank = world - 1
    seed = random.randrange(1 << 30)
    w = draw(seed, (n, k), dtype, "cuda", scale=k**-0.5)
    b = draw(seed + 1, (n,), dtype, "cuda") if with_bias else None
    chunk_rows = cfg.chunk_rows_for(m)
    signals = torch.ones(world * triton.cdiv(m, chunk_rows), dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    y = torch.empty(world * m, n, dtype=dtype, device="cuda")
    gemm = _Gemm(w, b, y.stride(0), y.device, m, chunk_rows, GroupInfo(None, rank, world), cfg, DEFAULT_SPINS, 1, None)
    sk_tiles, _, flags = gemm.pingpong.stream_k
    assert sk_tiles > 0
    inputs, outputs = [], []
    for call in range(4):
        what = f"world={world} m={m} n={n} k={k} call={call} seed={seed}"
        x = draw(seed + 2 + call, (world * m, k), dtype, "cuda")
        y.fill_(float("nan"))
        gemm(x, x[rank * m : (rank + 1) * m].clone(), w, b, y, signals, done)
        torch.cuda.synchronize()
        ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
        err = rel_error(y, ref)
        assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"
        assert flags.eq(0).all(), f"{what}: the kernel left stream-K flags {flags.nonzero().flatten().tolist()} set"
        assert signals.eq(1).all() and done.item() == 0, f"{what}: signals or count not left as found"
        inputs.append((x, x[rank * m : (rank + 1) * m].clone()))
        outputs.append(y.clone())
    differs = torch.zeros((), dtype=torch.int64, device="cuda")
    for call in range(400):
        gemm(*inputs[call % 2], w, b, y, signals, done)
        differs += (y != outputs[call % 2]).any()
    assert differs.item() == 0, f"world={world} seed={seed}: {differs.item()} of 400 back-to-back calls differ"
