"""The fused GEMM+ReduceScatter kernel on ONE GPU, W ranks simulated in one process, one after
another (tests/_rs_simulation.py: every rank's peer steps, the copy plan, then every rank's own
rows; the ranks' buffers are local memory behind the same address table the GPUs use).

What peers do not change is tested here with the compiled kernels at real tile shapes, bf16 and
fp16: every transport, ragged rows, N not a tile multiple, bias, poisoned buffers and outputs,
against float64 and bitwise across runs; the interpreter test runs the same simulation at toy
tile sizes on CPU. Waits that really wait: after the peer steps, the owner's partials and flags
are taken back and a copy stream delivers them again, tile by tile (or band by band), each
behind a gate the host opens a few milliseconds apart (tests/_gates.py), while the owner's
kernel runs. NVLink, the symmetric barriers, graphs and two groups need the multi-GPU file.
"""

import dataclasses
import random

import pytest
import torch

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _matmul_reduce_scatter
from fluxtp.backends.fused._matmul_reduce_scatter import Layout, MatmulReduceScatterConfig, launch_kernel, uses_reducer
from fluxtp.configs._classes import NARROW_TILING
from tests._cases import TOLERANCE, draw, rel_error
from tests._rs_simulation import owner_with_late_partials, simulate

pytestmark = pytest.mark.gpus(1)

WIDE = MatmulReduceScatterConfig()  # 128x256x64, 3 stages, 8 warps: the large-M heuristic
NARROW = MatmulReduceScatterConfig(**NARROW_TILING)  # 128x128, 5 stages: the heuristic in few-tile grids
DEEP = MatmulReduceScatterConfig(num_stages=4, group_m=4)  # the shipped table's deepest wide pipeline
REDUCER = MatmulReduceScatterConfig(warp_specialized=True)  # the reducer kernel (bf16 / fp16, Hopper; push, copy engine)
GATE_DELAY_S = 0.003
MAX_SPINS = 1 << 26  # deliveries a few milliseconds apart are far inside it


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


@pytest.mark.parametrize("transport", _matmul_reduce_scatter.TRANSPORTS)
@pytest.mark.parametrize(
    "world, m, n, k_local, base, dtype, with_bias",
    [
        (2, 1000, 1000, 2048, WIDE, torch.bfloat16, True),  # ragged rows (7.8 tiles), N not a tile multiple
        (2, 512, 2048, 4096, NARROW, torch.float16, False),
        (4, 384, 1536, 1024, DEEP, torch.bfloat16, True),
        (8, 200, 1024, 512, WIDE, torch.bfloat16, False),  # the unrolled reduction (_matmul_reduce_scatter.REDUCE_UNROLL_MIN_WORLD)
        (2, 1000, 1000, 2048, REDUCER, torch.bfloat16, True),
        (4, 384, 1536, 1024, dataclasses.replace(REDUCER, group_m=2), torch.float16, False),
        (8, 200, 1024, 512, REDUCER, torch.bfloat16, True),
        # 7 x 7 tiles a rank, ragged: ~12 reduction units a program, each taken in turn
        (8, 880, 1792, 256, REDUCER, torch.bfloat16, True),
    ],
)
def test_simulated_ranks_match_float64_and_repeat_bitwise(transport, world, m, n, k_local, base, dtype, with_bias):
    _no_pull_on_the_reducer(base, transport)
    seed = random.randrange(1 << 30)
    x, w, b = _inputs(seed, world, m, n, k_local, dtype, with_bias)
    cfg = dataclasses.replace(base, transport=transport)
    layout = Layout.of(m, n, x.element_size(), world, cfg, uses_reducer(cfg))
    outs, flags = simulate(x, w, b, world, k_local, cfg, float("nan"), max_spins=1 << 20)
    for r in range(world):
        what = f"{transport} world={world} rank={r} seed={seed}"
        err = rel_error(outs[r], _reference(x, w, b, r, world))
        assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"
        complete = layout.complete_flags(cfg.copy_engine).to(flags[r].device)
        set_by_peers = slice(0, layout.num_flags // 2 if cfg.copy_engine else layout.num_flags)
        assert bool((flags[r][set_by_peers] == complete[set_by_peers]).all()), f"{what}: flags never set"
    again, _ = simulate(x, w, b, world, k_local, cfg, 12345.0, max_spins=1 << 20)  # other poison
    for r in range(world):
        assert torch.equal(outs[r], again[r]), f"rank {r}: outputs differ between identical runs ({transport})"


def _no_pull_on_the_reducer(base, transport):
    if base.warp_specialized and transport == "pull":
        pytest.skip("the reducer kernel hands partials over by push or the copy engine (test_reducer_kernel_refuses_...)")


def test_reducer_kernel_refuses_what_it_cannot_run_before_launching():
    x, w, _ = _inputs(1, 2, 256, 512, 256, torch.bfloat16, False)
    for cfg, n, why in ((dataclasses.replace(REDUCER, transport="pull"), 512, "not pull"),
                        (REDUCER, 500, "multiple of 8"),
                        (dataclasses.replace(REDUCER, num_stages=4), 512, "shared memory")):  # fmt: skip
        layout = Layout.of(256, n, 2, 2, cfg, True)
        buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
        ptrs = torch.tensor([buffer.data_ptr()] * 2, dtype=torch.int64, device="cuda")
        out = torch.empty(256, n, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=why):
            launch_kernel(x[:, :256].contiguous(), w[:n, :256].contiguous(), None, out, ptrs, layout.flags_offset, 0, 2, cfg,
                          own_offset=layout.own_offset, buffers=[buffer, buffer])  # fmt: skip


@pytest.mark.parametrize("transport", _matmul_reduce_scatter.TRANSPORTS)
@pytest.mark.parametrize(
    "world, owner, m, n, k_local, base, dtype, with_bias",
    [
        (2, 1, 500, 600, 2048, WIDE, torch.bfloat16, True),  # ragged: 4 x 3 tiles of 128 x 256
        (4, 2, 256, 512, 1024, dataclasses.replace(NARROW, group_m=1), torch.float16, False),  # 2 bands per peer
        (2, 1, 500, 600, 2048, REDUCER, torch.bfloat16, True),
        (4, 2, 256, 512, 1024, dataclasses.replace(REDUCER, group_m=1), torch.float16, False),
        (8, 3, 880, 1792, 256, REDUCER, torch.bfloat16, False),  # ~12 reduction units a program
    ],
)
def test_owner_waits_for_every_late_partial(transport, world, owner, m, n, k_local, base, dtype, with_bias):
    _no_pull_on_the_reducer(base, transport)
    seed = random.randrange(1 << 30)
    what = f"{transport} world={world} owner={owner} seed={seed}"
    x, w, b = _inputs(seed, world, m, n, k_local, dtype, with_bias)
    cfg = dataclasses.replace(base, transport=transport)
    out = owner_with_late_partials(x, w, b, world, k_local, cfg, owner, GATE_DELAY_S, MAX_SPINS, what)
    err = rel_error(out, _reference(x, w, b, owner, world))
    assert err <= TOLERANCE[dtype], f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize(
    "world, m, n, k_local",
    [
        (8, 128, 4096, 1792),  # llama3-8b TP=8, 1024 tokens: one wave, the own rows summed at the end
        (4, 1024, 4096, 3584),  # llama3-8b TP=4, 4096 tokens: own tiles published through the GEMM
    ],
)
def test_back_to_back_calls_over_one_workspace_read_this_calls_partials(world, m, n, k_local):
    """GEMM-only calls of the reducer kernel one after another on one stream, x alternating between
    two inputs (no sync between calls): each output matches float64 and, bitwise, its input's first
    output. Were an own-tile flag released before the partial it publishes had landed (what
    stores_written prevents), the reducer would read the other input's partial of the call before."""
    seed = random.randrange(1 << 30)
    inputs = [draw(seed + i, (world * m, k_local), torch.bfloat16, "cuda") for i in range(2)]
    w = draw(seed + 2, (n, k_local), torch.bfloat16, "cuda", scale=k_local**-0.5)
    x = inputs[0].clone()
    run = _matmul_reduce_scatter.gemm_only(x, w, None, GroupInfo(None, 0, world), REDUCER)
    firsts = []
    for x_i in inputs:
        x.copy_(x_i)
        firsts.append(run().clone())
        err = rel_error(firsts[-1], x_i[:m].double() @ w.double().T)
        assert err <= TOLERANCE[torch.bfloat16], f"world={world} seed={seed}: rel err {err:.2e}"
    differs = torch.zeros((), dtype=torch.int64, device="cuda")
    for call in range(400):
        x.copy_(inputs[call % 2])
        differs += (run() != firsts[call % 2]).any()
    assert differs.item() == 0, f"world={world} seed={seed}: {differs.item()} of 400 calls read another call's partials"
