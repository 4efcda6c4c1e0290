"""Whole fused calls on ONE GPU: the public op as one rank of a world simulated on this
GPU (fluxtp.testing.simulated_world: the peers' symmetric buffers are local tensors holding
their shards), so every host step of a real call runs: the plan, the publish, the pulls and
signals, the kernel's launch (a call that keeps no gathered input: all of it recorded once as one
CUDA graph whose kernel nodes take each call's shard, weight, output and bias).
The pulls are held back on every call (a gate recorded in front of them, or the copy stream
held), so the kernel's waits really wait; the gathered rows it reads are NaN until pulled. The
reduce-scatter's copy-engine pushes are checked where they land. NVLink and the real barriers
need the multi-GPU files.
"""

import dataclasses
import random
import warnings

import pytest
import torch
from triton import knobs

import fluxtp
from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter, _scaled
from fluxtp.backends.fused._matmul_reduce_scatter import copy_plan
from fluxtp.backends.fused._launch import num_sms
from fluxtp.configs import AllGatherMatmulConfig, MatmulReduceScatterConfig
from fluxtp.testing import simulated_world
from tests import _fp8_cases as fp8_cases
from tests._cases import TOLERANCE, draw, rel_error
from tests._gates import HostGates

pytestmark = pytest.mark.gpus(1)

HOLD_CYCLES = 20_000_000  # ~10 ms of the copy stream's time before each call's copies


def _publish_peers(plan, x, rank, world, m):
    """What the peers' calls would have published: each peer's rows in its (simulated) buffer."""
    shards = plan.ws.shard_views(x.dtype, (m, x.shape[1]), world)
    for r in range(world):
        if r != rank:
            shards[r].copy_(x[r * m : (r + 1) * m])


def _hold_copy_stream(device):
    with torch.cuda.stream(symm.copy_stream(device)):
        torch.cuda._sleep(HOLD_CYCLES)


class _PullGate:
    """A host gate (tests._gates.HostGates) that a plan's recorded pulls wait for (queued in front
    of them at the plan's first call), closed before each call and opened after it: the kernel,
    launched in the same graph, must still be waiting for its rows when they are let through."""

    def __init__(self, plan):
        self.gates = HostGates(1)
        pull = plan._pull_peers

        def gated_pull(*args):  # recorded once per graph: a plan may record its pulls twice
            self.gates.hold(0 if self.gates.queued else None)
            pull(*args)

        plan._pull_peers = gated_pull

    def close(self):
        self.gates.words[0] = 0

    def open_later(self, kernel_done: torch.cuda.Event, what: str, delay_s=0.01):
        self.gates.open_slowly(kernel_done, delay_s, what)


@pytest.mark.parametrize(
    "world, rank, m, n, k, dtype",
    [
        (2, 1, 300, 1000, 512, torch.bfloat16),  # ragged rows
        (4, 2, 256, 768, 1024, torch.float16),
        (8, 5, 128, 512, 256, torch.bfloat16),  # the ring order wraps
        # 128x256 tiles: the warp-specialized kernel on Hopper
        (2, 1, 2048, 2048, 512, torch.bfloat16),
        (4, 3, 1100, 1536, 512, torch.float16),  # ragged rows: stored without TMA
    ],
)
def test_whole_calls_replay_their_pulls_and_stay_exact(world, rank, m, n, k, dtype):
    seed = random.randrange(1 << 30)
    what = f"world={world} rank={rank} m={m} seed={seed}"
    # Two weights and a bias on every other call: one plan's recorded kernel takes each call's own.
    weights = [draw(seed + i, (n, k), dtype, "cuda", scale=k**-0.5) for i in range(2)]
    bias = draw(seed + 2, (n,), dtype, "cuda")
    side = torch.cuda.Stream()
    gates = {}
    with simulated_world(world, rank) as group, warnings.catch_warnings():
        warnings.simplefilter("error")  # a call that could not be recorded warns
        info = GroupInfo(group, rank, world)
        for call in range(10):
            return_gathered = call % 3 == 2  # both paths, interleaved over one workspace
            w, b = weights[call % 2], bias if call % 4 < 2 else None
            x = draw(seed + 3 + call, (world * m, k), dtype, "cuda")
            x_shard = x[rank * m : (rank + 1) * m].clone()
            plan = _all_gather_matmul.plan(x_shard, w, b, info, return_gathered)
            _publish_peers(plan, x, rank, world, m)
            torch.cuda.synchronize()
            if return_gathered:
                _hold_copy_stream(x.device)
            else:
                plan.gathered.fill_(float("nan"))  # the rows the kernel may read only once pulled
                gate = gates.get(id(plan)) or gates.setdefault(id(plan), _PullGate(plan))
                gate.close()
            stream = side if call == 4 else torch.cuda.current_stream()  # another caller stream once
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = fluxtp.all_gather_matmul(x_shard, w, group=group, bias=b, backend="fused",
                                               return_gathered=return_gathered)  # fmt: skip
                done = torch.cuda.Event()
                done.record()
            if not return_gathered:
                gate.open_later(done, f"{what} call {call}")
            torch.cuda.synchronize()
            y = out[0] if return_gathered else out
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
            err = rel_error(y, ref)
            assert err <= TOLERANCE[dtype], f"{what} call {call}: rel err {err:.2e}"
            if return_gathered:
                assert torch.equal(out[1], x), f"{what} call {call}: gathered rows differ"
            else:
                replayed = plan  # a plan whose calls are one recorded graph
        graph = replayed.call_graph
        assert isinstance(graph.graph, torch.cuda.CUDAGraph), f"{what}: the call was not recorded as one graph"
        # ... launched by driver calls on the caller's raw stream, its kernel node updated per call;
        # the caller's stream changed once, which the plan's event ordered.
        assert graph.graph_exec and graph.params is not None, f"{what}: the kernel node was not updated"
        assert replayed.event.event is not None, f"{what}: the change of caller stream was not ordered"
        # The untuned heuristic: a 128x256 tiling on the warp-specialized kernel on Hopper.
        hopper = torch.cuda.get_device_capability()[0] == 9
        expected = AllGatherMatmulConfig.heuristic(m, n, k, world, num_sms(w.device), hopper)
        assert replayed.config == expected, f"{what}: {replayed.config}"
        warp_specialized = expected.warp_specialized
        launch = replayed.gemm.pingpong.launch if warp_specialized else replayed.gemm.launch
        assert launch._direct is not None, f"{what}: this Triton's launcher was not launched directly"


def test_a_launch_hook_sees_every_kernel_and_the_calls_stay_exact():
    """While a Triton launch hook is set, a call is not one recorded graph (the hook must see
    every launch): its copy stream's steps are replayed and the GEMM launched through Triton,
    which calls the hook. The pulls stay gated, so the kernel still really waits."""
    world, rank, m, n, k, dtype = 4, 2, 256, 768, 512, torch.bfloat16
    seed = random.randrange(1 << 30)
    w = draw(seed, (n, k), dtype, "cuda", scale=k**-0.5)
    launched = []

    def hook(metadata):
        launched.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        with simulated_world(world, rank) as group, warnings.catch_warnings():
            warnings.simplefilter("error")
            info = GroupInfo(group, rank, world)
            x = draw(seed + 1, (world * m, k), dtype, "cuda")
            plan = _all_gather_matmul.plan(x[rank * m : (rank + 1) * m].clone(), w, None, info, False)
            gate = _PullGate(plan)
            for call in range(3):
                x = draw(seed + 1 + call, (world * m, k), dtype, "cuda")
                x_shard = x[rank * m : (rank + 1) * m].clone()
                _publish_peers(plan, x, rank, world, m)
                plan.gathered.fill_(float("nan"))
                gate.close()
                torch.cuda.synchronize()
                before = len(launched)
                y = fluxtp.all_gather_matmul(x_shard, w, group=group, backend="fused")
                done = torch.cuda.Event()
                done.record()
                gate.open_later(done, f"seed={seed} call {call}")
                torch.cuda.synchronize()
                err = rel_error(y, x.double() @ w.double().T)
                assert err <= TOLERANCE[dtype], f"seed={seed} call {call}: rel err {err:.2e}"
                assert any("all_gather_matmul" in name for name in launched[before:]), (
                    f"call {call}: the hook saw {launched[before:]}, not the GEMM"
                )
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert plan.call_graph.graph and plan.copy_steps_replay.graph_exec is not None, "the copy steps were not replayed"


def test_a_captured_call_gathers_afresh_on_every_replay():
    """The op inside the caller's own CUDA graph: its copies are captured as they are (no graph
    in a graph), and each replay computes on the inputs and peers' rows of that moment."""
    world, rank, m, n, k, dtype = 4, 1, 256, 512, 512, torch.bfloat16
    seed = random.randrange(1 << 30)
    w = draw(seed, (n, k), dtype, "cuda", scale=k**-0.5)
    with simulated_world(world, rank) as group:
        info = GroupInfo(group, rank, world)
        x = draw(seed + 1, (world * m, k), dtype, "cuda")
        x_static = x[rank * m : (rank + 1) * m].clone()
        plan = _all_gather_matmul.plan(x_static, w, None, info, False)
        _publish_peers(plan, x, rank, world, m)
        fluxtp.all_gather_matmul(x_static, w, group=group, backend="fused")  # warm up outside the capture
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            y_static = fluxtp.all_gather_matmul(x_static, w, group=group, backend="fused")
        for replay in range(3):
            x = draw(seed + 2 + replay, (world * m, k), dtype, "cuda")
            x_static.copy_(x[rank * m : (rank + 1) * m])
            _publish_peers(plan, x, rank, world, m)
            plan.gathered.fill_(float("nan"))
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            err = rel_error(y_static, x.double() @ w.double().T)
            assert err <= TOLERANCE[dtype], f"replay {replay} seed={seed}: rel err {err:.2e}"


@pytest.mark.parametrize("world, rank", [(2, 0), (4, 3)])
def test_reduce_scatter_band_pushes_replay_after_their_tiles(world, rank):
    """The copy engine's band pushes (wait for a band's tiles, copy it to its owner, set the
    owner's flag), replayed from a graph: each owner's incoming slot must hold exactly this
    rank's partial of the owner's rows, and every owner flag be set, call after call. The
    stand-in barrier marks only the incoming flags delivered (the tile counters stay the
    kernel's), so the kernel's own rows never wait."""
    m_total, n, k, dtype = 1024 * world // 2, 1024, 512, torch.bfloat16
    seed = random.randrange(1 << 30)
    w = draw(seed, (n, k), dtype, "cuda", scale=k**-0.5)
    rows = m_total // world
    with simulated_world(world, rank) as group, warnings.catch_warnings():
        warnings.simplefilter("error")
        info = GroupInfo(group, rank, world)
        x = draw(seed + 1, (m_total, k), dtype, "cuda")
        config = dataclasses.replace(MatmulReduceScatterConfig.heuristic(m_total, n, k, world), transport="copy_engine")
        plan = _matmul_reduce_scatter.plan(x, w, None, info, config)
        incoming = plan.flags[: plan.layout.num_flags // 2]
        plan.barrier = lambda channel=0, timeout_ms=0: incoming.fill_(1)
        order = copy_plan(plan.layout, rank, world)
        for call in range(4):
            x = draw(seed + 1 + call, (m_total, k), dtype, "cuda")
            for step in plan.steps:
                step.target.fill_(float("nan"))
                step.owner_flags.zero_()
            plan(x, w, None)
            torch.cuda.synchronize()
            for owner in {o for o, *_ in order}:
                steps = [s for (o, *_), s in zip(order, plan.steps) if o == owner]
                assert all(s.owner_flags[s.flag].item() == 1 for s in steps), f"call {call}: owner {owner} flag unset"
                assert all(torch.equal(s.target, s.source) for s in steps), f"call {call}: owner {owner}'s band differs"
                partial = torch.cat([s.target for s in steps])
                ref = x[owner * rows : (owner + 1) * rows].double() @ w.double().T
                err = rel_error(partial, ref)
                assert err <= TOLERANCE[dtype], f"call {call} owner {owner} seed={seed}: rel err {err:.2e}"
        # The pushes are recorded with the kernel: one graph launch per call, its node updated.
        assert isinstance(plan.call_graph.graph, torch.cuda.CUDAGraph), "the call was not recorded as one graph"
        assert plan.call_graph.params is not None, "the kernel node was not updated"


@pytest.mark.parametrize(
    "world, rank, m, n, k, row_wise",
    [
        (2, 1, 300, 1000, 512, True),  # ragged rows, row scales published after the shard
        (8, 5, 128, 512, 256, False),  # per tensor; the ring order wraps
    ],
)
def test_fp8_whole_calls_through_the_public_ops(world, rank, m, n, k, row_wise):
    """backend="fused" FP8 calls of the public ops, both paths of the all-gather: the gathered
    FP8 rows (and row scales) NaN until pulled, the copy stream held back, the product against
    float64 on the dequantized inputs and the gathered bytes exact. The reduce-scatter's sums are
    not checkable here (the stand-in barrier marks its flags delivered): it must run and keep its
    shape and dtype."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    seed = random.randrange(1 << 30)
    what = f"world={world} rank={rank} m={m} row_wise={row_wise} seed={seed}"
    x = fp8_cases.draw(seed, (world * m, k))
    xq, sx = fp8_cases.quantize(x, row_wise)
    wq, sw = fp8_cases.quantize(fp8_cases.draw(seed + 1, (n, k), k**-0.5), row_wise)
    sw = fp8_cases.weight_scale(sw, row_wise)
    ref = fp8_cases.dequantized(xq, sx) @ fp8_cases.dequantized(wq, sw.reshape(-1, 1)).T
    rows = slice(rank * m, (rank + 1) * m)
    x_shard, w = xq[rows].cuda(), wq.cuda()
    scale_x, scale_w = (sx[rows] if row_wise else sx).cuda(), sw.cuda()
    gates = {}
    with simulated_world(world, rank) as group:
        info = GroupInfo(group, rank, world)
        scaled = _scaled.Scaled.of(scale_x, scale_w, torch.bfloat16, False)
        for call, return_gathered in enumerate((False, True, False)):
            plan = _all_gather_matmul.plan(x_shard, w, None, info, return_gathered, None, scaled)
            _publish_peers(plan, xq, rank, world, m)
            for rows_of_peer, published in plan.scale_pulls if row_wise else ():  # the peers' row scales
                published.copy_(sx[rows_of_peer].reshape(-1))
            if not return_gathered:
                plan.gathered.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
                if row_wise:
                    plan.gathered_scales.fill_(float("nan"))
                gate = gates.get(id(plan)) or gates.setdefault(id(plan), _PullGate(plan))
                gate.close()
            torch.cuda.synchronize()
            _hold_copy_stream(x_shard.device)
            out = fluxtp.all_gather_scaled_matmul(x_shard, w, scale_x, scale_w, group=group, backend="fused",
                                                  return_gathered=return_gathered)  # fmt: skip
            if not return_gathered:
                done = torch.cuda.Event()
                done.record()
                gate.open_later(done, f"{what} call {call}")
            torch.cuda.synchronize()
            y = out[0] if return_gathered else out
            err = fp8_cases.rel_error(y, ref)
            allowed = fp8_cases.tolerance(torch.bfloat16, k, False, hopper=True)
            assert err <= allowed, f"{what} call {call}: all-gather rel err {err:.2e}"
            if return_gathered:
                assert torch.equal(out[1].cpu().view(torch.uint8), xq.view(torch.uint8)), f"{what}: gathered rows differ"
                assert torch.equal(out[2].cpu().reshape(-1), sx.reshape(-1)), f"{what}: gathered scales differ"
        # [world * m, k] x [n, k]: this rank's whole x and its K slice of the weight, its own scales.
        out = fluxtp.scaled_matmul_reduce_scatter(xq.cuda(), w, sx.cuda(), scale_w, group=group, backend="fused")
        torch.cuda.synchronize()
        assert out.shape == (m, n) and out.dtype == torch.bfloat16, f"{what}: reduce-scatter gave {tuple(out.shape)} {out.dtype}"


def _garbage_during_recording_body(rank, world):
    """Cyclic garbage holding a symmetric allocation (as stale call plans hold views of a replaced
    workspace), young, and a collection due within the recording's allocations: a call recorded as
    a CUDA graph must not free it during the capture (CUDA refuses the unmapping there and the
    process aborts: out of this guard, one collection in a capture did), and the garbage goes once
    the capture is over."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    from fluxtp.backends.fused import _launch

    class Holder:
        pass

    group_name = dist.group.WORLD.group_name
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    x = torch.zeros(16, device="cuda")

    def record():
        kept = [[] for _ in range(1000)]  # container allocations kept alive: a collection is due
        x.add_(len(kept) // 1000)

    freed = []
    thresholds = gc.get_threshold()
    gc.collect()
    gc.disable()  # no collection until the recording's: the garbage stays in the youngest generation
    holder = Holder()
    holder.cycle = holder
    holder.buffer = symm_mem.empty(1 << 20, dtype=torch.uint8, device="cuda")
    holder.handle = symm_mem.rendezvous(holder.buffer, group_name)
    weakref.finalize(holder, freed.append, True)
    del holder
    gc.set_threshold(gc.get_count()[0] + 200, *thresholds[1:])  # due within record's allocations only
    gc.enable()
    try:
        _launch._recorded_on(stream, graph, record)
        assert not freed, "the garbage was collected during the capture"
        graph.replay()
        torch.cuda.synchronize()
        gc.collect()
    finally:
        gc.set_threshold(*thresholds)
    assert freed and x.eq(1).all(), (freed, x)


def test_garbage_holding_a_symmetric_allocation_is_not_collected_while_a_call_records():
    from fluxtp.testing import run_on_ranks

    run_on_ranks(_garbage_during_recording_body, 1, backend="nccl")


def _freed_workspaces_body(world, rank, m, n, k, dtype, seed):
    """The calls of the test below, inside its simulated world; returns weak references to every
    plan and workspace buffer they made (the caller holds nothing else of them)."""
    import weakref

    def weakly(*kept):
        return [weakref.ref(obj) for obj in kept]

    w = draw(seed, (n, k), dtype, "cuda", scale=k**-0.5)
    x = draw(seed + 1, (world * m, k), dtype, "cuda")
    x_shard = x[rank * m : (rank + 1) * m].clone()
    with simulated_world(world, rank) as group, warnings.catch_warnings():
        warnings.simplefilter("error")
        info = GroupInfo(group, rank, world)
        key = (group.group_name, x.device.index)
        for return_gathered in (False, True):
            fluxtp.all_gather_matmul(x_shard, w, group=group, backend="fused", return_gathered=return_gathered)
        hook = lambda metadata: None  # noqa: E731 -- a launch hook: the copy steps are replayed apart
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            fluxtp.all_gather_matmul(x_shard, w, group=group, backend="fused")
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        torch.cuda.synchronize()
        gathering = _all_gather_matmul.plan(x_shard, w, None, info, False)
        assert gathering.call_graph.graph and gathering.copy_steps_replay.graph, "the all-gather's paths were not recorded"
        ws = _all_gather_matmul._workspaces[key]
        refs = weakly(*_all_gather_matmul._plans._plans.values(), ws.shard.tensor, ws.gathered)
        assert len(refs) == 4, f"{len(refs) - 2} all-gather plans: expected both paths'"
        del gathering, ws
        # The reduce-scatter's first call makes its workspace: every plan is rebuilt after, the
        # all-gather's freed at once.
        fluxtp.matmul_reduce_scatter(x, w, group=group, backend="fused")
        assert all(ref() is None for ref in refs[:2]), "a new workspace left the all-gather's stale plans alive"
        refs += weakly(*_matmul_reduce_scatter._plans._plans.values())
        assert len(refs) == 5, f"{len(refs) - 4} reduce-scatter plans after the op's call: expected 1"
        config = dataclasses.replace(MatmulReduceScatterConfig.heuristic(world * m, n, k, world), transport="copy_engine")
        pushed = _matmul_reduce_scatter.plan(x, w, None, info, config)
        incoming = pushed.flags[: pushed.layout.num_flags // 2]
        pushed.barrier = lambda channel=0, timeout_ms=0: incoming.fill_(1)  # as the band pushes' test does
        pushed(x, w, None)
        torch.cuda.synchronize()
        assert pushed.call_graph.graph, "the copy engine's call (its band pushes within) was not recorded"
        refs += weakly(pushed, _matmul_reduce_scatter._workspaces[key].buffer.tensor)
        del pushed
        assert all(ref() is not None for ref in refs[-2:]), "a reduce-scatter plan or workspace went while in use"
    return refs  # the world's exit freed its workspaces (symm.free_workspaces)


def test_freed_workspaces_go_at_once_with_every_plan_over_them():
    """symm.free_workspaces frees a group's workspaces then and there, with the call plans over
    them and no garbage collection: a plan (its recorded call, its replayed copy steps, its copy
    engine's pushes) holds nothing that refers back to it. Otherwise a replaced workspace waits
    for Python's collector, which may run inside a caller's CUDA graph capture, where freeing
    symmetric memory aborts the process."""
    import gc

    seed = random.randrange(1 << 30)
    gc.collect()
    gc.disable()
    try:
        refs = _freed_workspaces_body(4, 1, 256, 512, 512, torch.bfloat16, seed)
        alive = [type(ref()).__name__ for ref in refs if ref() is not None]
        assert not alive, f"still alive after free_workspaces, with no collection: {alive}"
    finally:
        gc.enable()
