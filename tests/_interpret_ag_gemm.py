"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py (a subprocess: the flag must
be set before triton is imported). Checks the persistent AllGather+GEMM kernel body with its
chunk signals preset: every output row of every segment, ragged rows per rank, bias, the weight
as a transposed view (the backward's layout, read without a copy), and that a missing signal
stops the kernel instead of computing on stale rows, recording which rank's chunk it waited for.

float16 only: the interpreter multiplies bfloat16 as raw bits (garbage); bf16 is covered on GPUs.
"""

import dataclasses
import gc
import os
import sys
import weakref

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from fluxtp._dist import GroupInfo  # noqa: E402
from fluxtp.backends.fused._launch import weight_operand  # noqa: E402
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig, launch_gemm  # noqa: E402

TOL = 4 * 2**-11  # fp16 output rounding (u = 2^-11) plus fp32 accumulation, normwise


def case(seed, world, rank, m, n, k, with_bias, cfg, transposed=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * k**-0.5).half()
    if transposed:  # [n, k] with strides (1, n), as ColumnParallelLinear's backward passes W^T
        w = w.t().contiguous().t()
        assert weight_operand(w)[1], "a transposed view must take the kernel's [k, n] path"
    b = torch.randn(n, generator=g).half() if with_bias else None
    y = torch.full((world * m, n), float("nan"), dtype=torch.float16)  # poison: every element must be written
    chunk = cfg.chunk_rows_for(m)
    signals = torch.ones(world * -(-m // chunk) + 3, dtype=torch.int32)  # 3 past the call's: must stay 1
    done = torch.zeros(1, dtype=torch.int32)
    reset = 1 if seed % 2 else 0  # 0 as in a call, 1 as in GEMM-only mode
    # The kernel reads this rank's rows from its shard, never from the gathered input's own rows.
    x_own = x[rank * m : (rank + 1) * m].clone()
    x_gathered = x.clone()
    x_gathered[rank * m : (rank + 1) * m] = float("nan")
    launch_gemm(x_gathered, x_own, w, b, y, signals, done, m, chunk, GroupInfo(None, rank, world), cfg, signal_reset=reset)
    # The last program out leaves the call's signals at `reset` and the counter at 0, nothing else.
    assert signals[:-3].eq(reset).all() and signals[-3:].eq(1).all(), f"signals after the call: {signals.tolist()}"
    assert done.item() == 0, f"the finished-programs counter was left at {done.item()}"
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert not torch.isnan(y).any(), f"unwritten outputs: {torch.isnan(y).sum().item()}"
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"world={world} rank={rank} m={m} n={n} k={k}: rel err {err:.2e}"


def missing_signal_stops_kernel():
    cfg = AllGatherMatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=4, chunk_rows=16)
    x, w = torch.randn(32, 16).half(), torch.randn(16, 16).half()
    y = torch.zeros(32, 16, dtype=torch.float16)
    signals = torch.ones(2, dtype=torch.int32)
    signals[1] = 0  # rank 1's shard never arrives
    report = torch.full((3,), -1, dtype=torch.int32)
    try:
        launch_gemm(x, x[:16], w, None, y, signals, torch.zeros(1, dtype=torch.int32), 16, 16, GroupInfo(None, 0, 2), cfg,
                    max_spins=100, report=report)  # fmt: skip
    except Exception as e:  # the interpreter cannot run the trap's PTX: any error proves it stopped
        # The record is written by the trap's own PTX, which the interpreter cannot run (the
        # one-GPU test reads it: tests/gpu/test_ag_kernel_one_gpu.py).
        assert report.tolist() == [-1, -1, -1], f"timeout record {report.tolist()}"
        return str(e)
    raise AssertionError("the kernel ran past a signal that never arrived")


def launch_keeps_no_reference(cfg):
    """After the launch, nothing holds the call's tensors: a descriptor cache that did kept every
    call's output alive, so its memory was never reused (a cudaMalloc per call on GPUs)."""
    x, w, y = torch.randn(32, 16).half(), torch.randn(16, 16).half(), torch.empty(32, 16, dtype=torch.float16)
    alive = [weakref.ref(t) for t in (x, w, y)]
    launch_gemm(x, x[:16], w, None, y, torch.ones(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16, 16, GroupInfo(None, 0, 2), cfg)
    del x, w, y
    gc.collect()
    assert all(ref() is None for ref in alive), "launch_gemm kept a reference to one of the call's tensors"


def main():
    seed = int(sys.argv[1])
    small = AllGatherMatmulConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=1, num_warps=4, chunk_rows=16)
    odd_chunks = AllGatherMatmulConfig(block_m=16, block_n=16, block_k=32, group_m=3, num_stages=1, num_warps=4, chunk_rows=40)
    flat = dataclasses.replace(small, flatten=True, tma_store=False)
    cases = [
        (2, 0, 32, 64, 32, True, small, False),  # tile multiples: TMA-store epilogue
        (2, 1, 40, 48, 48, False, small, False),  # ragged rows per rank (40 = 2.5 tiles; TMA clips), N not a tile multiple
        (3, 2, 23, 20, 24, True, odd_chunks, False),  # three ranks, chunk not a tile multiple, K tail, 40-byte rows: pointers
        (4, 1, 9, 16, 16, False, odd_chunks, False),  # fewer rows than a tile
        (8, 5, 9, 16, 16, True, small, False),  # TP=8: the ring from rank 5 wraps past rank 7
        (2, 1, 48, 40, 64, True, flat, False),  # flattened loop, pointer-store epilogue
        (2, 0, 32, 64, 32, True, small, True),  # transposed weight view
        (3, 1, 23, 40, 24, False, odd_chunks, True),  # transposed, ragged, N and K tails
        # The peers' tiles in bands across their segments: bands of 2 (3) row tiles span segments.
        (4, 2, 9, 48, 16, True, dataclasses.replace(small, peer_bands=True), False),
        (3, 1, 23, 40, 24, False, dataclasses.replace(odd_chunks, peer_bands=True), True),
        (8, 6, 16, 32, 48, True, dataclasses.replace(flat, peer_bands=True), False),  # flattened: waits a tile ahead
    ]
    for i, (world, rank, m, n, k, with_bias, cfg, transposed) in enumerate(cases):
        case(seed + i, world, rank, m, n, k, with_bias, cfg, transposed)
    launch_keeps_no_reference(small)
    message = missing_signal_stops_kernel()
    print("ok;", message[:80])


if __name__ == "__main__":
    main()
