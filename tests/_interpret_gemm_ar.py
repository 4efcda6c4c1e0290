"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py (a subprocess: the flag must
be set before triton is imported). Checks the one-shot GEMM+AllReduce / AllReduce kernel with W
ranks simulated in one process: the "symmetric buffers" are CPU tensors addressed through the
same int64 address table the GPUs use; every rank runs its push phase, then every rank its
reduce phase. Several calls in a row on the same workspaces (epochs 0, 1, 2, ...: both slot
parities, flags never reset, shapes changing between calls), worlds of 2, 3 and 4, M and N not
tile multiples, M = 1, bias, swapped operands, poisoned outputs and slots, the same bits on
every rank, the sum mode, and that a missing flag stops the kernel.

float16 only: the interpreter multiplies bfloat16 as raw bits (garbage); bf16 is covered on GPUs.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch

from fluxtp.backends.fused._matmul_all_reduce import AllReduceConfig, Layout, MatmulAllReduceConfig, launch_kernel

# fp16 output rounding (u = 2^-11), plus every rank's partial rounded to fp16 before the sum
# (partials can be larger than their sum), plus fp32 accumulation: normwise.
TOL = 4 * 2**-11


class World:
    """W ranks' workspaces (flags zeroed once, slots poisoned) and epoch counters, kept across calls."""

    def __init__(self, world, max_numel):
        self.world = world
        self.layout_bytes = Layout.of(max_numel, 2, world).nbytes
        self.buffers = []
        for _ in range(world):
            buf = torch.zeros(self.layout_bytes, dtype=torch.uint8)
            data = Layout.of(max_numel, 2, world).data_offset
            buf[data:].view(torch.float16).fill_(float("nan"))
            self.buffers.append(buf)
        self.ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.counters = [torch.zeros(2, dtype=torch.int32) for _ in range(world)]

    def call(self, xs, ws, bias, config, numel, out_shape, skip_push=None, max_spins=1 << 20):
        layout = Layout.of(numel, 2, self.world)
        assert layout.nbytes <= self.layout_bytes
        outs = [torch.full(out_shape, float("nan"), dtype=torch.float16) for _ in range(self.world)]
        for phase in (1, 2):
            for r in range(self.world):
                if phase == 1 and r == skip_push:
                    continue
                w = None if ws is None else ws[r]
                launch_kernel(xs[r], w, bias, outs[r], self.ptrs, self.counters[r], layout, r, self.world, config,
                              phases=phase, max_spins=max_spins)
        return outs


def check_sum(outs, ref, what):
    for r, out in enumerate(outs):
        assert not torch.isnan(out).any(), f"{what}: rank {r} has unwritten outputs: {torch.isnan(out).sum().item()}"
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < TOL, f"{what}: rank {r} rel err {err:.2e}"
        assert torch.equal(out, outs[0]), f"{what}: rank {r} holds other bits than rank 0"


def gemm_call(world_sim, g, m, n, k_local, with_bias, config):
    world = world_sim.world
    k = k_local * world
    x = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * k**-0.5).half()
    b = torch.randn(n, generator=g).half() if with_bias else None
    xs = [x[:, r * k_local : (r + 1) * k_local].contiguous() for r in range(world)]
    ws = [w[:, r * k_local : (r + 1) * k_local].contiguous() for r in range(world)]
    outs = world_sim.call(xs, ws, b, config, m * n, (m, n))
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0)
    check_sum(outs, ref, f"gemm world={world} m={m} n={n} k_local={k_local} {config}")


def sum_call(world_sim, g, shape, config):
    xs = [torch.randn(shape, generator=g).half() for _ in range(world_sim.world)]
    kept = [x.clone() for x in xs]
    numel = xs[0].numel()
    outs = world_sim.call(xs, None, None, config, numel, shape)
    check_sum(outs, sum(x.double() for x in xs), f"sum world={world_sim.world} shape={shape}")
    assert all(torch.equal(x, k) for x, k in zip(xs, kept)), "all_reduce modified its input"


def missing_flag_stops_kernel():
    """Rank 1 never pushes: rank 0's first wait gives up, records (1, tile, 0), then traps."""
    sim = World(2, 64)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=g).half() for _ in range(2)]
    report = torch.full((3,), -1, dtype=torch.int32)
    layout = Layout.of(64, 2, 2)
    config = AllReduceConfig(block_m=2, block_n=16)
    launch_kernel(xs[0], None, None, torch.empty(64, dtype=torch.float16), sim.ptrs, sim.counters[0], layout, 0, 2,
                  config, phases=1)
    try:
        launch_kernel(xs[0], None, None, torch.empty(64, dtype=torch.float16), sim.ptrs, sim.counters[0], layout, 0,
                      2, config, phases=2, max_spins=100, report=report)
    except Exception as e:  # noqa: BLE001 -- the interpreter cannot run the trap's PTX: any error proves it stopped
        assert report.tolist() == [1, 0, 0], f"timeout record {report.tolist()}, expected [1, 0, 0]"
        return str(e)
    raise AssertionError("the kernel ran past a flag that never arrived")


def main():
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    small = MatmulAllReduceConfig(block_m=16, block_n=16, block_k=16, num_stages=1, swap_ab=False)
    swapped = MatmulAllReduceConfig(block_m=16, block_n=32, block_k=16, num_stages=1, swap_ab=True)
    wide = MatmulAllReduceConfig(block_m=32, block_n=16, block_k=32, group_m=2, num_stages=1, swap_ab=False)
    for world in (2, 3, 4, 8):
        sim = World(world, 64 * 80)
        # Six calls on the same workspaces: epochs 0..5, both parities twice, shapes changing.
        gemm_call(sim, g, 1, 48, 32, True, small)  # decode: one row
        gemm_call(sim, g, 37, 40, 24, False, swapped)  # ragged M and N, K tail of a block
        gemm_call(sim, g, 64, 80, 16, True, wide)
        gemm_call(sim, g, 5, 16, 16, False, small)
        sum_call(sim, g, (3, 7, 11), AllReduceConfig(block_m=2, block_n=16))  # numel 231: a ragged last row
        sum_call(sim, g, (64,), AllReduceConfig(block_m=4, block_n=32))
        assert all(int(c[0]) == 6 and int(c[1]) == 0 for c in sim.counters), f"epochs {[c.tolist() for c in sim.counters]}"
    message = missing_flag_stops_kernel()
    print("ok;", message[:80])


if __name__ == "__main__":
    main()
