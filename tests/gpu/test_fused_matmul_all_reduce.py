"""Fused GEMM+AllReduce and AllReduce on every local GPU (tests/gpu: WORLD) against the float64 reference.

The one-shot kernel keeps no host-side state per call (epoch flags, two slot sets), so the
tests lean on what could break that: poisoned outputs, M from 1 to 4096 (the larger ones take
the two-shot path), N not a tile multiple, bias, both dtypes, the same bits on both ranks, 200
back-to-back calls with changing shapes and no host sync, a peer delayed on purpose (the waits
really wait), 1000 CUDA graph replays with fresh data, two process groups used alternately,
and a peer that never arrives: the wait traps and names the rank and tile.
"""

import random

import pytest
import torch
import torch.distributed as dist

import fluxtp
from fluxtp.configs import all_reduce_one_shot_max_bytes
from fluxtp.testing import run_on_ranks
from tests._cases import TOLERANCE, draw, rel_error
from tests.gpu import WORLD, run_until_trap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

DTYPES = (torch.bfloat16, torch.float16)
NAN = float("nan")
SLEEP_CYCLES = 100_000_000  # ~50 ms


def _inputs(seed, world, rank, m, n, k_local, dtype, with_bias):
    k = k_local * world
    x = draw(seed, (m, k), dtype, "cuda")
    w = draw(seed + 1, (n, k), dtype, "cuda", scale=k**-0.5)
    b = draw(seed + 2, (n,), dtype, "cuda") if with_bias else None
    cols = slice(rank * k_local, (rank + 1) * k_local)
    return x, w, b, x[:, cols].contiguous(), w[:, cols].contiguous()


def _same_on_all_ranks(out, what, group=None):
    outs = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outs, out.contiguous(), group=group)
    assert all(torch.equal(o, out) for o in outs), f"{what}: the ranks hold different bits"


def _check(out, x, w, b, what):
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert out.shape == ref.shape and out.dtype == x.dtype, f"{what}: shape {tuple(out.shape)} dtype {out.dtype}"
    err = rel_error(out, ref)
    assert err <= TOLERANCE[out.dtype], f"{what}: rel err {err:.2e}"
    return err


# (M, N, k per rank): decode rows, N not a tile multiple, K not a multiple of the block, the
# row-parallel decode layer of LLaMA-70B (N 8192, k 14336) at M 1 and 128, outputs wide enough for
# 128-column tiles (N > 64 x the SMs; one ragged), and sizes past the one-shot limit (two-shot:
# fused reduce-scatter + all-gather).
SHAPES = [(1, 8192, 14336), (128, 8192, 14336), (3, 1000, 520), (17, 96, 64), (64, 4104, 1024),
          (64, 12288, 512), (100, 8712, 256), (300, 2048, 256), (4096, 4096, 512)]


def _shapes_body(rank, world, seed):
    case = 0
    for dtype in DTYPES:
        for m, n, k_local in SHAPES:
            with_bias = case % 2 == 0
            x, w, b, xl, wl = _inputs(seed + 10 * case, world, rank, m, n, k_local, dtype, with_bias)
            what = f"{dtype} M={m} N={n} k={k_local} bias={with_bias}"
            torch.full((m, n), NAN, dtype=dtype, device="cuda")  # a NaN block for the op's torch.empty
            out = fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="fused")
            err = _check(out, x, w, b, what)
            _same_on_all_ranks(out, what)
            nccl = fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="nccl")
            err_nccl = _check(nccl, x, w, b, f"{what} (nccl)")
            if out.numel() >= 10_000:
                assert err <= 1.1 * err_nccl, f"{what}: rel err {err:.2e} worse than nccl's {err_nccl:.2e}"
            case += 1
        # The last two: one-shot at its reach at this W, and NCCL's all-reduce one value past it.
        reach = all_reduce_one_shot_max_bytes(world) // dtype.itemsize
        for shape in [(1,), (7, 8192), (3, 5, 1001), (64, 8192), (reach,), (reach + 1,)]:
            xs = [draw(seed + 1000 * case + r, shape, dtype, "cuda") for r in range(world)]
            kept = xs[rank].clone()
            out = fluxtp.all_reduce(xs[rank], backend="fused")
            ref = sum(t.double() for t in xs)
            assert rel_error(out, ref) <= TOLERANCE[dtype], f"all_reduce {dtype} {shape}: rel err {rel_error(out, ref):.2e}"
            assert torch.equal(xs[rank], kept), "all_reduce modified its input"
            _same_on_all_ranks(out, f"all_reduce {dtype} {shape}")
            case += 1


def test_shapes_dtypes_bitwise_same_on_ranks():
    run_on_ranks(_shapes_body, WORLD, random.randrange(1 << 30), backend="nccl", timeout_s=540)


def _back_to_back_body(rank, world, seed):
    shapes = [(128, 2048, 1024), (1, 1000, 512), (40, 4096, 256)]
    for m, n, k_local in shapes:  # warm-up: compile, allocate the workspace at its largest
        _, _, b, xl, wl = _inputs(seed, world, rank, m, n, k_local, torch.bfloat16, True)
        fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="fused")
        fluxtp.all_reduce(xl, backend="fused")
    torch.cuda.synchronize()
    inputs = [_inputs(seed + 3 * i, world, rank, *shapes[i % 3], torch.bfloat16, i % 2 == 0) for i in range(200)]
    sums = [draw(seed + 5000 + 7 * i + rank, (i % 5 + 1, 333), torch.bfloat16, "cuda") for i in range(200)]
    torch.cuda.synchronize()
    outputs, totals = [], []
    for i, (_, _, b, xl, wl) in enumerate(inputs):  # no host synchronization until the checks
        outputs.append(fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="fused"))
        totals.append(fluxtp.all_reduce(sums[i], backend="fused"))
    for i, ((x, w, b, _, _), out) in enumerate(zip(inputs, outputs)):
        _check(out, x, w, b, f"call {i}")
    for i, total in enumerate(totals):
        ref = sum(draw(seed + 5000 + 7 * i + r, (i % 5 + 1, 333), torch.bfloat16, "cpu").double() for r in range(world))
        assert rel_error(total.cpu(), ref) <= TOLERANCE[torch.bfloat16], f"all_reduce call {i}"


def test_back_to_back_without_sync():
    run_on_ranks(_back_to_back_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _delayed_body(rank, world, seed):
    for i, (m, n, k_local) in enumerate([(1, 8192, 4096), (128, 4096, 2048)]):
        for delay_rank in (0, 1):
            x, w, b, xl, wl = _inputs(seed + 10 * i + delay_rank, world, rank, m, n, k_local, torch.bfloat16, True)
            fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="fused")  # warm-up
            torch.cuda.synchronize()
            dist.barrier()
            if rank == delay_rank:  # the peer's kernel runs first and waits in its reduce phase
                torch.cuda._sleep(SLEEP_CYCLES)
            out = fluxtp.matmul_all_reduce(xl, wl, bias=b, backend="fused")
            _check(out, x, w, b, f"M={m} delayed rank {delay_rank}")


def test_delayed_peer():
    run_on_ranks(_delayed_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _graph_body(rank, world, seed):
    m, n, k_local, replays = 4, 8192, 2048, 1000
    k = k_local * world
    for d, dtype in enumerate(DTYPES):
        x, w, b, xl, wl = _inputs(seed + 10 * d, world, rank, m, n, k_local, dtype, True)
        static_x = xl.clone()
        static_t = torch.randn(8, 1024, device="cuda", dtype=dtype)
        for _ in range(2):  # warm-up outside capture: compile, workspaces
            fluxtp.matmul_all_reduce(static_x, wl, bias=b, backend="fused")
            fluxtp.all_reduce(static_t, backend="fused")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fluxtp.matmul_all_reduce(static_x, wl, bias=b, backend="fused")
            static_sum = fluxtp.all_reduce(static_t, backend="fused")
        torch.cuda.synchronize()
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        worst = 0.0
        for i in range(replays):
            x_full = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)  # the same on both ranks
            t_all = torch.randn(world, 8, 1024, device="cuda", dtype=dtype, generator=g)
            static_x.copy_(x_full[:, rank * k_local : (rank + 1) * k_local])
            static_t.copy_(t_all[rank])
            graph.replay()
            ref = x_full.double() @ w.double().T + b.double()
            worst = max(worst, rel_error(static_out, ref))
            err = rel_error(static_sum, t_all.double().sum(0))
            assert err <= TOLERANCE[dtype], f"{dtype} replay {i}: all_reduce rel err {err:.2e}"
            if i % 100 == 0:
                _same_on_all_ranks(static_out, f"{dtype} replay {i}")
        assert worst <= TOLERANCE[dtype], f"{dtype} graph replays: worst rel err {worst:.2e}"
        del graph  # holds no NCCL work, but free it before the next capture all the same


def test_cuda_graph_replays():
    run_on_ranks(_graph_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _two_groups_body(rank, world, seed):
    groups = [dist.new_group(list(range(world))), dist.new_group(list(range(world)))]
    for i in range(20):
        group = groups[i % 2]
        x, w, b, xl, wl = _inputs(seed + i, world, rank, 16 + i, 1024, 512, torch.bfloat16, i % 3 == 0)
        _check(fluxtp.matmul_all_reduce(xl, wl, bias=b, group=group, backend="fused"), x, w, b, f"call {i}")


def test_two_groups_alternating():
    run_on_ranks(_two_groups_body, WORLD, random.randrange(1 << 30), backend="nccl")


# One process, one GPU, rank 0 of a world of 2 whose "peer" never pushes: the reduce phase's wait
# must give up (trap: a CUDA error at the next synchronization) and name rank 1 and tile 0.
_TIMEOUT_SCRIPT = """
import torch
from fluxtp.backends.fused import _matmul_all_reduce

config = _matmul_all_reduce.MatmulAllReduceConfig()
m, n, k = 1, 64, 128  # one tile: one program waits, one record
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
layout = _matmul_all_reduce.Layout.of(m * n, 2, 2)
bufs = [torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
counters = torch.zeros(2, dtype=torch.int32, device="cuda")
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
_matmul_all_reduce.launch_kernel(x, w, None, out, ptrs, counters, layout, 0, 2, config, max_spins=100_000)
"""


def test_missing_peer_traps_and_names_rank_and_tile():
    proc = run_until_trap(_TIMEOUT_SCRIPT, "_matmul_all_reduce")
    out = proc.stdout
    assert "rank 0 timed out waiting for rank 1's partial of tile 0" in out, out[-2000:] + proc.stderr[-2000:]
