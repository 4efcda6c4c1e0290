"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py (a subprocess: the flag must
be set before triton is imported). Checks the persistent GEMM+ReduceScatter kernel body with W
ranks simulated in one process: the "symmetric buffers" are CPU tensors addressed through the
same int64 address table the GPUs use; every rank runs its peer steps (push or pull stores and
flags, or local stores and band counts) first, then (copy engine) the launcher's copy plan moves
the counted bands and sets their flags, then every rank runs its own-rows step (waits,
fixed-order reduction, bias, output). Worlds of 2, 3, 4 and 8, push, pull and copy engine,
ragged rows per rank, N and K not tile multiples, bias, the weight as a transposed view (the
backward's layout, read without a copy), poisoned outputs and buffers, determinism, the GEMM-only mode, and that a missing flag stops the kernel.

float16 only: the interpreter multiplies bfloat16 as raw bits (garbage); bf16 is covered on GPUs.
"""

import dataclasses
import gc
import os
import sys
import weakref

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch

from fluxtp._dist import GroupInfo
import fluxtp.backends.fused._matmul_reduce_scatter as _matmul_reduce_scatter
from fluxtp.backends.fused._matmul_reduce_scatter import Layout, MatmulReduceScatterConfig, gemm_only, launch_kernel
from _rs_simulation import make_buffers, peer_steps, shards, simulate, workspace  # a sibling: this script runs as a file

# fp16 output rounding (u = 2^-11), plus the peers' partials rounded to fp16 before the sum
# (partials can be larger than their sum), plus fp32 accumulation: normwise.
TOL = 4 * 2**-11


def draw(seed, world, m, n, k_local, with_bias):
    g = torch.Generator().manual_seed(seed)
    k = world * k_local
    x = torch.randn(world * m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * k**-0.5).half()
    b = torch.randn(n, generator=g).half() if with_bias else None
    return x, w, b


def reference(x, w, b):
    return x.double() @ w.double().T + (b.double() if b is not None else 0)


def check(out, ref, what):
    assert not torch.isnan(out).any(), f"{what}: unwritten outputs: {torch.isnan(out).sum().item()}"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"{what}: rel err {err:.2e}"


def layout_of(x, w, world, cfg):
    return Layout.of(x.shape[0] // world, w.shape[0], 2, world, cfg)


def case(seed, world, m, n, k_local, with_bias, cfg, transposed=False):
    x, w, b = draw(seed, world, m, n, k_local, with_bias)
    ref = reference(x, w, b)
    what = f"world={world} m={m} n={n} k_local={k_local} {cfg.transport} transposed={transposed}"
    outs, flags = simulate(x, w, b, world, k_local, cfg, float("nan"), transposed=transposed)
    for r in range(world):
        check(outs[r], ref[r * m : (r + 1) * m], f"{what} rank={r}")
        set_by_peers = flags[r][: layout_of(x, w, world, cfg).num_flags // 2] if cfg.copy_engine else flags[r]
        assert bool((set_by_peers == 1).all()), f"{what}: rank {r} has flags never set: {flags[r].tolist()}"
    # Determinism and no stale reads: other poison in the buffers, bitwise the same outputs.
    again, _ = simulate(x, w, b, world, k_local, cfg, 12345.0, transposed=transposed)
    for r in range(world):
        assert torch.equal(outs[r], again[r]), f"{what} rank={r}: outputs differ between identical runs"
    # GEMM-only mode: the same kernel on local memory gives this rank's own partial plus bias.
    for r in range(world):
        xr, wr = shards(x, w, r, k_local, transposed)
        own = gemm_only(xr, wr, b, GroupInfo(None, r, world), cfg)()
        part = reference(xr[r * m : (r + 1) * m], wr, b)
        check(own, part, f"{what} gemm_only rank={r}")


def missing_flag_stops_kernel(transport):
    """Every flag but one arrives: the owner's wait for that tile must give up (then trap)."""
    cfg = MatmulReduceScatterConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=4, transport=transport)
    cfg = dataclasses.replace(cfg, epilogue_split=1 if transport == "push" else 4)
    world, m, n, k_local = 2, 32, 32, 16
    x, w, _ = draw(0, world, m, n, k_local, False)
    layout = Layout.of(m, n, 2, world, cfg)
    buffers, ptrs = make_buffers(world, layout, 0.0)
    out = torch.zeros(m, n, dtype=torch.float16)
    x1, w1 = shards(x, w, 1, k_local)
    launch_kernel(x1, w1, None, torch.zeros_like(out), ptrs, layout.flags_offset, 1, world, cfg, 0, 0)
    holder = buffers[0] if transport == "push" else buffers[1]
    flags = holder[layout.flags_offset :].view(torch.int32)
    assert bool((flags == 1).all()), f"rank 1 did not set every flag of rank 0's rows: {flags.tolist()}"
    flags[2] = 0  # tile 2 of rank 1's partial of rank 0's rows never arrives
    x0, w0 = shards(x, w, 0, k_local)
    report = torch.full((3,), -1, dtype=torch.int32)
    try:
        launch_kernel(x0, w0, None, out, ptrs, layout.flags_offset, 0, world, cfg, 1, 1, max_spins=100, report=report)
    except Exception as e:  # noqa: BLE001 -- the interpreter cannot run the trap's PTX: any error proves it stopped
        # It recorded which wait gave up: source rank 1, tile 2, on rank 0.
        assert report.tolist() == [1, 2, 0], f"timeout record {report.tolist()}, expected [1, 2, 0]"
        return str(e)
    raise AssertionError("the kernel ran past a flag that never arrived")


def launch_keeps_no_reference(cfg):
    """After the launch, nothing holds the call's input, weight or output (see the AG script)."""
    world, m, n, k_local = 2, 32, 32, 16
    x, w, _ = draw(0, world, m, n, k_local, False)
    x0, w0 = shards(x, w, 0, k_local)
    out = torch.empty(m, n, dtype=torch.float16)
    layout = Layout.of(m, n, 2, world, cfg)
    buffers, ptrs = make_buffers(world, layout, 0.0)
    alive = [weakref.ref(t) for t in (x0, w0, out)]
    launch_kernel(x0, w0, None, out, ptrs, layout.flags_offset, 0, world, cfg, 0, 0)  # the peer step: no waits
    del x0, w0, out
    gc.collect()
    assert all(ref() is None for ref in alive), "launch_kernel kept a reference to one of the call's tensors"


def plan_launch(seed, world, m, n, k_local, cfg):
    """The launcher's plan (_matmul_reduce_scatter.Plan) on the simulated buffers: after every rank's peer steps,
    each rank's planned launch (steps 0..W-1 again, then its own rows) gives its rows of the sum,
    on the call that builds the plan and on a second call that reuses it."""
    x, w, b = draw(seed, world, m, n, k_local, True)
    ref = reference(x, w, b)
    layout, buffers, ptrs, _ = peer_steps(x, w, b, world, k_local, cfg, float("nan"))
    workspace_of = _matmul_reduce_scatter._workspace
    _matmul_reduce_scatter._workspace = lambda info, device, nbytes: workspace(buffers, ptrs, info.rank)
    try:
        for r in range(world):
            info = GroupInfo(None, r, world)
            xr, wr = shards(x, w, r, k_local)
            plan = _matmul_reduce_scatter.plan(xr, wr, b, info, cfg)
            assert plan.layout == layout and plan.flags.numel() == layout.num_flags
            for call in range(2):
                assert _matmul_reduce_scatter.plan(xr, wr, b, info, cfg) is plan, "the second call built another plan"
                out = plan.launch(*plan.ready(xr, wr, b))
                check(out, ref[r * m : (r + 1) * m], f"plan world={world} {cfg.transport} rank={r} call={call}")
    finally:
        _matmul_reduce_scatter._workspace = workspace_of


def main():
    seed = int(sys.argv[1])
    small = MatmulReduceScatterConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=1, num_warps=4, transport="push")
    odd = MatmulReduceScatterConfig(
        block_m=16, block_n=16, block_k=32, group_m=3, num_stages=1, num_warps=4, transport="push", epilogue_split=1
    )
    pull = dataclasses.replace(small, transport="pull", epilogue_split=2)
    odd_pull = dataclasses.replace(odd, transport="pull", epilogue_split=2)
    ce, odd_ce = (dataclasses.replace(c, transport="copy_engine") for c in (small, odd))
    cases = [
        (2, 32, 64, 32, True, small),  # tile multiples
        (2, 40, 48, 48, False, small),  # ragged rows per rank (40 = 2.5 tiles), N not a tile multiple
        (2, 40, 48, 48, True, pull),
        (3, 23, 20, 24, True, odd),  # three ranks, K tail (24 of a 32 block)
        (3, 17, 40, 16, False, pull),
        (4, 9, 16, 16, True, odd_pull),  # fewer rows than a tile
        (4, 21, 40, 24, False, odd),
        (8, 9, 16, 16, True, odd_pull),  # TP=8: seven peer slots per owner, one tile per rank
        (8, 5, 40, 16, False, small),
        (2, 40, 48, 48, True, ce),  # copy engine: bands of 2 tile rows (the last one short)
        (3, 70, 20, 24, False, odd_ce),  # 5 tile rows: bands of 3 and 2, three ranks
        (4, 9, 40, 16, True, ce),
    ]
    for i, (world, m, n, k_local, with_bias, cfg) in enumerate(cases):
        case(seed + i, world, m, n, k_local, with_bias, cfg)
    case(seed + len(cases), 2, 40, 48, 48, True, small, transposed=True)  # N not a tile multiple
    case(seed + len(cases) + 1, 3, 17, 40, 24, False, odd_pull, transposed=True)  # K tail, pull
    launch_keeps_no_reference(small)
    plan_launch(seed, 3, 17, 40, 24, small)
    plan_launch(seed + 1, 2, 40, 48, 48, pull)
    messages = [missing_flag_stops_kernel(transport) for transport in ("push", "pull")]
    print("ok;", messages[0][:80])


if __name__ == "__main__":
    main()
