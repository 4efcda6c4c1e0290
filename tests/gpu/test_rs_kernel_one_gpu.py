"""The fused GEMM+ReduceScatter kernel and launcher on ONE GPU, W ranks simulated in one process
(tests/_rs_simulation.py: the ranks' buffers are local memory behind the same address table).

What peers do not change is tested here at the real tile configs with bf16/fp16 on the GPU: every
transport, ragged rows, N not a tile multiple, bias, poisoned buffers and outputs, against
float64 and bitwise across runs. And the flag protocol under real waiting: two simulated ranks
launched by the launcher itself, concurrently on two streams (small shapes, so both persistent
kernels fit on the GPU at once), the producer delayed on purpose so the owner's in-kernel waits
really wait; poisoned partial slots show any read before its flag. The multi-GPU file covers
the rest (NVLink, the symmetric barriers, graphs, two groups).
"""

import dataclasses
import random

import pytest
import torch

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import gemm_rs
from fluxtp.backends.fused.gemm_rs import Call, Layout, MatmulReduceScatterConfig
from tests._cases import TOLERANCE, draw, rel_error
from tests._rs_simulation import make_buffers, shards, simulate, workspace

pytestmark = pytest.mark.gpus(1)

WIDE = MatmulReduceScatterConfig()  # 128x256x64, 3 stages, 8 warps: the large-M heuristic
NARROW = MatmulReduceScatterConfig(block_n=128, num_stages=4, epilogue_split=2)  # the small-M heuristic
DEEP = MatmulReduceScatterConfig(num_stages=4, group_m=4)  # the shipped table's deepest wide pipeline


def _inputs(seed, world, m, n, k_local, dtype, with_bias):
    k = world * k_local
    x = draw(seed, (world * m, k), dtype, "cuda")
    w = draw(seed + 1, (n, k), dtype, "cuda", scale=k**-0.5)
    b = draw(seed + 2, (n,), dtype, "cuda") if with_bias else None
    return x, w, b


def _reference(x, w, b, rank, world):
    rows = x.shape[0] // world
    ref = x[rank * rows : (rank + 1) * rows].double() @ w.double().T
    return ref + b.double() if b is not None else ref


@pytest.mark.parametrize("transport", gemm_rs.TRANSPORTS)
@pytest.mark.parametrize(
    "world, m, n, k_local, base, dtype, with_bias",
    [
        (2, 1000, 1000, 2048, WIDE, torch.bfloat16, True),  # ragged rows (7.8 tiles), N not a tile multiple
        (2, 512, 2048, 4096, NARROW, torch.float16, False),
        (4, 384, 1536, 1024, DEEP, torch.bfloat16, True),
    ],
)
def test_simulated_ranks_match_float64_and_repeat_bitwise(transport, world, m, n, k_local, base, dtype, with_bias):
    seed = random.randrange(1 << 30)
    x, w, b = _inputs(seed, world, m, n, k_local, dtype, with_bias)
    cfg = dataclasses.replace(base, transport=transport)
    layout = Layout.of(m, n, x.element_size(), world, cfg)
    outs, flags = simulate(x, w, b, world, k_local, cfg, float("nan"), max_spins=1 << 20)
    for r in range(world):
        what = f"{transport} world={world} rank={r} seed={seed}"
        err = rel_error(outs[r], _reference(x, w, b, r, world))
        assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"
        set_by_peers = flags[r][: layout.num_flags // 2] if cfg.copy_engine else flags[r]
        assert bool((set_by_peers == 1).all()), f"{what}: flags never set"
    again, _ = simulate(x, w, b, world, k_local, cfg, 12345.0, max_spins=1 << 20)  # other poison
    for r in range(world):
        assert torch.equal(outs[r], again[r]), f"rank {r}: outputs differ between identical runs ({transport})"


@pytest.mark.parametrize("transport", gemm_rs.TRANSPORTS)
def test_owner_waits_for_a_delayed_producer(transport):
    """Rank 0's kernel runs its peer step, then waits in-kernel for rank 1's partials of its rows;
    rank 1 starts ~50 ms later on another stream. Both through gemm_rs.launch (copy stream and
    all), several calls over the same buffers with fresh data each time."""
    world, m, n, k_local, dtype = 2, 200, 1024, 1024, torch.bfloat16  # 16 tiles per kernel: both fit at once
    cfg = dataclasses.replace(WIDE, transport=transport)
    layout = Layout.of(m, n, 2, world, cfg)
    buffers, ptrs = make_buffers(world, layout, float("nan"), dtype, "cuda")
    calls = [Call(workspace(buffers, ptrs, r), layout, cfg, GroupInfo(None, r, world)) for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    # Every rank's kernel compiled and loaded first, by the same launch on local memory: one
    # process's first launch of a module waits for the GPU's running kernels (one GPU per
    # process, as in real use, never meets this), and rank 0's would be spinning for rank 1's.
    x, w, b = _inputs(0, world, m, n, k_local, dtype, with_bias=True)
    for r in range(world):
        xr, wr = shards(x, w, r, k_local)
        for bias in (None, b):
            gemm_rs.gemm_only(xr, wr, bias, GroupInfo(None, r, world), cfg)()
    torch.cuda.synchronize()
    for i in range(4):
        seed = random.randrange(1 << 30)
        x, w, b = _inputs(seed, world, m, n, k_local, dtype, with_bias=i % 2 == 1)
        for r in range(world):
            calls[r].ws.flags(layout).zero_()  # the launcher's step 1 (prepare), before either kernel
            buffers[r][: layout.flags_offset].view(dtype).fill_(float("nan"))  # stale partials read as NaN
        torch.cuda.synchronize()
        outs = [None] * world
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                if r > 0:
                    torch.cuda._sleep(100_000_000)  # ~50 ms: the owner's waits really wait
                xr, wr = shards(x, w, r, k_local)
                outs[r] = gemm_rs.launch(calls[r], xr, wr, b)
        torch.cuda.synchronize()
        for r in range(world):
            err = rel_error(outs[r], _reference(x, w, b, r, world))
            assert err <= TOLERANCE[dtype], f"call {i} rank {r} {transport} seed={seed}: rel err {err:.2e}"
