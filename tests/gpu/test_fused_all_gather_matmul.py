"""Fused AllGather+GEMM on every local GPU (tests/gpu: WORLD) against the float64 reference.

Tests the synchronization as well as the math: poisoned outputs, ragged rows per rank, many
back-to-back calls with fresh data and no host sync, a copy stream delayed on purpose, CUDA
graph capture and replay, and two process groups used alternately.
"""

import random

import pytest
import torch
import torch.distributed as dist

import fluxtp
from fluxtp import symm
from fluxtp.backends.fused import _all_gather_matmul
from fluxtp.testing import run_on_ranks
from tests._cases import TOLERANCE, check_all_gather_matmul, draw, rel_error
from tests.gpu import WORLD, plan_configs, skip_unless_hopper, stream_k_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

DTYPES = (torch.bfloat16, torch.float16)


def _inputs(seed, world, rank, m, n, k, dtype, with_bias):
    x = draw(seed, (m * world, k), dtype, "cuda")
    w = draw(seed + 1, (n, k), dtype, "cuda", scale=k**-0.5)
    b = draw(seed + 2, (n,), dtype, "cuda") if with_bias else None
    return x, x[rank * m : (rank + 1) * m].contiguous(), w, b


def _check(y, xg, x, w, b, what):
    assert torch.equal(xg, x), f"{what}: the gathered input is not an exact copy"
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    err = rel_error(y, ref)
    assert err <= TOLERANCE[y.dtype], f"{what}: rel err {err:.2e}"


def _shapes_body(rank, world, seed):
    shapes = [(1000, 384, 1024), (128, 256, 128), (64, 8, 8), (37, 4000, 520), (2048, 3584, 4096), (1, 96, 64)]
    for dtype in DTYPES:
        for i, (m, n, k) in enumerate(shapes):
            check_all_gather_matmul(rank, world, seed + 10 * i, m, n, k, dtype, "cuda", "fused", i % 2 == 0)
        # The weight as a transposed view ([k, n] read in place, the backward's layout): ragged,
        # N and K tails, and the large config.
        for i, (m, n, k) in enumerate([(1000, 384, 1024), (37, 4000, 520), (2048, 3584, 4096)]):
            check_all_gather_matmul(
                rank, world, seed + 100 + i, m, n, k, dtype, "cuda", "fused", i % 2 == 1, transposed_weight=True
            )


def test_shapes_and_dtypes():
    run_on_ranks(_shapes_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _back_to_back_body(rank, world, seed):
    m, n, k, calls = 300, 512, 768, 200
    inputs = [_inputs(seed + 3 * i, world, rank, m, n, k, torch.bfloat16, i % 3 == 0) for i in range(calls)]
    outputs = [fluxtp.all_gather_matmul(xs, w, bias=b, backend="fused", return_gathered=True) for _, xs, w, b in inputs]
    for i, ((x, _, w, b), (y, xg)) in enumerate(zip(inputs, outputs)):
        _check(y, xg, x, w, b, f"call {i}")


def test_back_to_back_without_sync():
    run_on_ranks(_back_to_back_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _delayed_body(rank, world, seed):
    m, n, k = 1024, 1024, 2048
    for i, (delay_copy, delay_rank) in enumerate([(True, 0), (True, 1), (False, 0), (False, 1)]):
        x, xs, w, b = _inputs(seed + 5 * i, world, rank, m, n, k, torch.bfloat16, True)
        if rank == delay_rank:
            # ~50 ms: the GEMM must wait for data that arrives late (copy stream delayed), or
            # for a peer that arrives late (the peer's whole stream delayed).
            stream = symm.copy_stream(xs.device) if delay_copy else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(100_000_000)
        y, xg = fluxtp.all_gather_matmul(xs, w, bias=b, backend="fused", return_gathered=True)
        _check(y, xg, x, w, b, f"delay copy={delay_copy} rank={delay_rank}")


def test_delayed_copy_stream_and_late_peer():
    run_on_ranks(_delayed_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _graph_body(rank, world, seed):
    m, n, k = 512, 768, 1024
    x, xs, w, b = _inputs(seed, world, rank, m, n, k, torch.bfloat16, True)
    static_x = xs.clone()
    for _ in range(2):  # warm-up: compile, allocate and rendezvous the workspace outside capture
        fluxtp.all_gather_matmul(static_x, w, bias=b, backend="fused")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y, static_xg = fluxtp.all_gather_matmul(static_x, w, bias=b, backend="fused", return_gathered=True)
    for i in range(50):
        x, xs, _, _ = _inputs(seed + 7 * (i + 1), world, rank, m, n, k, torch.bfloat16, False)
        static_x.copy_(xs)
        static_y.fill_(float("nan"))
        graph.replay()
        _check(static_y, static_xg, x, w, b, f"replay {i}")


def test_cuda_graph_replay():
    run_on_ranks(_graph_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _two_groups_body(rank, world, seed):
    other = dist.new_group(list(range(world)))
    for i in range(20):
        group = other if i % 2 else None
        m, k = (256, 512) if i % 4 < 2 else (96, 256)  # alternating shapes too
        x, xs, w, b = _inputs(seed + 11 * i, world, rank, m, 640, k, torch.float16, i % 3 == 0)
        y, xg = fluxtp.all_gather_matmul(xs, w, bias=b, group=group, backend="fused", return_gathered=True)
        _check(y, xg, x, w, b, f"call {i} group={'other' if group else 'world'}")


def test_two_groups_alternating():
    run_on_ranks(_two_groups_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _stream_k_body(rank, world, seed):
    shape = stream_k_shape(world)
    assert shape is not None, f"no candidate shape takes stream-K at world {world}: widen stream_k_shape's search"
    m, n, k = shape
    configs = plan_configs(_all_gather_matmul)
    for i in range(6):
        x, xs, w, b = _inputs(seed + 13 * i, world, rank, m, n, k, torch.bfloat16, i % 2 == 0)
        if i == 3 and rank == world - 1:  # this rank's peer rows, the split tiles' among them, arrive late
            with torch.cuda.stream(symm.copy_stream(xs.device)):
                torch.cuda._sleep(100_000_000)
        y, xg = fluxtp.all_gather_matmul(xs, w, bias=b, backend="fused", return_gathered=True)
        _check(y, xg, x, w, b, f"call {i}, {m}x{n}x{k} a rank")
    assert configs and all(config.stream_k for config in configs), f"the calls did not launch stream-K: {configs}"


def test_stream_k_split_calls():
    """The stream-K rule's split (the last partial wave's tiles split by K over every program)
    with the peers' rows arriving over the interconnect, one of them late: the one-GPU tests gate
    the waits; this runs them against real peers."""
    skip_unless_hopper()
    run_on_ranks(_stream_k_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _auto_body(rank, world, seed):
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    from fluxtp import backends
    from fluxtp._dist import resolve_group

    assert backends.choose("all_gather_matmul", "auto", x, w, resolve_group(None)) == "nccl"  # small M: measured slower
    big = torch.empty(2048, x.shape[1], device="cuda", dtype=x.dtype)
    wide = torch.empty(14336, x.shape[1], device="cuda", dtype=x.dtype)  # enough output per rank
    assert backends.choose("all_gather_matmul", "auto", big, wide, resolve_group(None)) == "fused"
    assert backends.choose("all_gather_matmul", "auto", big, w, resolve_group(None)) == "nccl"  # narrow N: slower
    with pytest.raises(ValueError, match="multiple of 8"):
        fluxtp.all_gather_matmul(torch.randn(4, 12, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(8, 12, device="cuda", dtype=torch.bfloat16), backend="fused")


def test_auto_policy_and_k_must_be_multiple_of_8():
    run_on_ranks(_auto_body, WORLD, random.randrange(1 << 30), backend="nccl")
