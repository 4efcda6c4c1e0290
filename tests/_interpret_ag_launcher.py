"""Run under TRITON_INTERPRET=1 by tests/test_kernels_interpret.py: the fused AllGather+GEMM
launcher's host logic (own rows, ring-order pulls, chunking and signals, then the kernel) on
CPU, with the CUDA-only pieces (streams, the symmetric buffer and its barrier, stream writes)
replaced by stand-ins. The peers' shards are already published, as the barrier guarantees.
The gathered input must be an exact copy and the product within fp16 rounding, for every rank,
on the call that builds the call plan and on a second call with other data that reuses it; and
a call that keeps no gathered input (it gathers into the workspace's rows, its barriers and pulls
issued as they are recorded, before the GEMM: the CPU has no graphs) must compute the same product.
A plan dropped by its cache is freed at once, with no collection (it holds nothing that refers
back to it).
"""

import gc
import os
import sys
import types
import weakref

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch

import fluxtp.backends.fused._all_gather_matmul as ag
from fluxtp._dist import GroupInfo

TOL = 4 * 2**-11


def main():
    seed = int(sys.argv[1])
    world, m, n, k = 3, 40, 24, 32  # ragged: 40 rows per rank in chunks of 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) * k**-0.5).half()
    published = [x[r * m : (r + 1) * m].clone() for r in range(world)]
    shard_buffers = [torch.empty(m, k, dtype=torch.float16) for _ in range(world)]
    signals_seen = []

    class Workspace:
        signals = torch.zeros(64, dtype=torch.int32)
        done = torch.zeros(1, dtype=torch.int32)
        shard = types.SimpleNamespace(handle=types.SimpleNamespace(barrier=lambda **kw: None))
        gathered = torch.full((world * m, k), torch.nan, dtype=torch.float16)
        last_stream = None

        def shard_views(self, dtype, shape, world):
            return shard_buffers  # every rank's symmetric buffer, the views a plan keeps

        def gathered_rows(self, dtype, shape, scales_rows=0):
            return self.gathered, None

    def write_value32(signals, index, value):
        signals_seen.append(index)
        signals[index] = value

    small = ag.AllGatherMatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=4, chunk_rows=16)
    # The interpreter runs a kernel at its launch, to the end: the GEMM, launched before the
    # peers' rows are copied (it computes this rank's rows meanwhile), would wait for ever. So
    # the launch is held back and run when the caller's stream joins the copy stream.
    held = []
    gemm_call = ag._Gemm.__call__

    def join(stream):
        for args in held:
            gemm_call(*args)
        held.clear()

    stream = types.SimpleNamespace(wait_stream=join)

    def hold(*args):
        signals_seen.append("gemm")
        held.append(args)

    built, plans = [], []
    plan_init = ag.Plan.__init__

    def counted_init(self, *args, **kwargs):
        built.append(args[3].rank)
        plans.append(weakref.ref(self))
        plan_init(self, *args, **kwargs)

    ag._Gemm.__call__ = hold
    ag.Plan.__init__ = counted_init
    ag._workspace = lambda *args: Workspace()
    ag._write_value32 = write_value32
    ag.tuned_config = lambda *args: None
    ag.symm.copy_stream = lambda device: stream
    ag.symm.current_stream = lambda index: stream
    ag.symm.stream_wait = lambda waiter, producer: join(producer)
    torch.cuda.set_stream = lambda s: None
    torch.cuda.is_current_stream_capturing = lambda: True  # no CUDA graph: the pulls are issued eagerly

    chunks = 3  # cdiv(40, 16)
    for call in range(3):  # the first call builds each rank's plan, the second reuses it with new data
        if call:
            x = torch.randn(world * m, k, generator=g).half()
            published[:] = [x[r * m : (r + 1) * m].clone() for r in range(world)]
        for rank in range(world):
            for r in range(world):  # every peer has published its shard (the first barrier)
                shard_buffers[r].copy_(published[r] if r != rank else torch.nan)
            signals_seen.clear()
            keep = call < 2  # the third call keeps no gathered input
            Workspace.gathered.fill_(torch.nan)
            y, xg = ag.all_gather_matmul(published[rank], w, None, GroupInfo(None, rank, world), keep, config=small)
            if keep:
                assert torch.equal(xg, x), f"call {call} rank {rank}: the gathered input is not an exact copy"
            else:
                assert xg is None, f"rank {rank}: a gathered input came back unasked"
            order = [(rank + s) % world for s in range(world)]  # own rows, then ring order rank+1, ...
            # The GEMM (it reads this rank's rows from its shard: no signal for them) goes in after
            # the publish and the barrier: before the peers' rows where they are issued eagerly
            # (a returned gathered input), after them where they are one recorded sequence.
            pulls = [seg * chunks + c for seg in order[1:] for c in range(chunks)]
            expected = ["gemm", *pulls] if keep else [*pulls, "gemm"]
            assert signals_seen == expected, f"rank {rank}: signals {signals_seen}, expected {expected}"
            # No host reset between calls: the kernel's last program left every signal 0 for the next.
            assert not Workspace.signals.any() and Workspace.done.item() == 0, f"rank {rank}: signals left set"
            ref = x.double() @ w.double().T
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < TOL, f"call {call} rank {rank}: rel err {err:.2e}"
    assert built == [*range(world)] * 2, f"plans built for ranks {built}: two per rank, reused by the second call"
    gc.collect()
    gc.disable()
    try:
        assert all(ref() is not None for ref in plans), "a cached plan was freed"
        ag._plans.clear()
        alive = sum(ref() is not None for ref in plans)
        assert not alive, f"{alive} of {len(plans)} plans outlived their cache: something refers back to them"
    finally:
        gc.enable()
    print("ok")


if __name__ == "__main__":
    main()
