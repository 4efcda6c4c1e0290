"""The fused GEMM+ReduceScatter kernel on ONE GPU, W ranks simulated in one process, one after
another (tests/_rs_simulation.py: every rank's peer steps, the copy plan, then every rank's own
rows; the ranks' buffers are local memory behind the same address table the GPUs use).

What peers do not change is tested here with the compiled kernels at real tile shapes, bf16 and
fp16: every transport, ragged rows, N not a tile multiple, bias, poisoned buffers and outputs,
against float64 and bitwise across runs; the interpreter test runs the same simulation at toy
tile sizes on CPU. Waits that really wait (a delayed producer), NVLink, the symmetric barriers,
graphs and two groups need the multi-GPU file.
"""

import dataclasses
import random

import pytest
import torch

from fluxtp.backends.fused import gemm_rs
from fluxtp.backends.fused.gemm_rs import Layout, MatmulReduceScatterConfig
from tests._cases import TOLERANCE, draw, rel_error
from tests._rs_simulation import simulate

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
