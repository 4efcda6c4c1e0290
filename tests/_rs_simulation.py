"""W ranks of the fused GEMM+ReduceScatter simulated in one process, on one device (CPU under the
Triton interpreter, or one GPU): the "symmetric buffers" are ordinary tensors addressed through
the same int64 address table the GPUs use, and a stand-in handle gives the launcher its views of
them. Used by tests/_interpret_gemm_rs.py, tests/_interpret_fp8.py and tests/gpu/test_{rs_kernel,fp8}_one_gpu.py;
owner_with_late_partials (one GPU) makes the owner's waits really wait.
A scaled (FP8) run passes `scaled` (fluxtp.backends.fused._scaled.Scaled) and every rank's
(scale_x, scale_w) as `rank_scales`: its partial slots are in its out_dtype (partial_dtype)."""

from __future__ import annotations

import torch

from fluxtp.backends.fused._matmul_reduce_scatter import Layout, _Workspace, launch_kernel, partial_dtype, uses_reducer
from fluxtp.symm import SymmBuffer
from fluxtp.testing import SimulatedHandle


def make_buffers(world, layout, poison, dtype=torch.float16, device="cpu"):
    """One byte buffer per rank: partial slots poisoned (never-written data must not leak), flags 0."""
    buffers = []
    for _ in range(world):
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        buf[: layout.flags_offset].view(dtype).fill_(poison)
        buffers.append(buf)
    return buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)


def workspace(buffers, ptrs, rank) -> _Workspace:
    """Rank `rank`'s workspace over the simulated buffers, as the launcher builds it."""
    handle = SimulatedHandle(buffers, rank, mark_delivered=False)  # ranks run one after another
    return _Workspace(SymmBuffer(buffers[rank], handle, buffers[rank].numel()), buffers, ptrs)


def flag_views(buffers, layout):
    """Every rank's int32 flags (and, copy engine, tile counters after them)."""
    return [buf[layout.flags_offset : layout.flags_offset + 4 * layout.num_flags].view(torch.int32) for buf in buffers]


def copy_engine(buffers, ptrs, layout, world, dtype=torch.float16):
    """What the copy streams do after the peer steps, by the launcher's own steps (its views of
    the buffers): every band counted full by its producer's kernel goes into its owner's
    incoming slot, then its flag."""
    flags = flag_views(buffers, layout)
    for rank in range(world):
        counters, steps = workspace(buffers, ptrs, rank).copy_engine_steps(layout, dtype, rank, world)
        assert len(steps) == (world - 1) * layout.bands
        for step in steps:
            count = counters[step.counter].item()
            assert count == step.count, f"rank {rank} counted {count} arrivals at counter {step.counter}, not {step.count}"
            owner_flags = step.owner_flags.view(torch.int32)
            assert owner_flags[step.flag] == 0, f"rank {rank}: the owner's flag {step.flag} was set before its band came"
            step.target.copy_(step.source)
            owner_flags[step.flag] = 1
    assert all(bool((f[: layout.num_flags // 2] == 1).all()) for f in flags), "a band never copied"


def shards(x, w, rank, k_local, transposed=False):
    """Rank `rank`'s columns of x and w (its part of K)."""
    cols = slice(rank * k_local, (rank + 1) * k_local)
    # transposed: [n, k_local] with strides (1, n), as ColumnParallelLinear's backward passes W^T
    wr = w[:, cols].t().contiguous().t() if transposed else w[:, cols].contiguous()
    return x[:, cols].contiguous(), wr


def _scaling(scaled, rank_scales, rank):
    """launch_kernel's scaled and scales arguments for `rank` (None, (None, None) unscaled)."""
    return (scaled, rank_scales[rank]) if scaled is not None else (None, (None, None))


def peer_steps(x, w, b, world, k_local, cfg, poison, max_spins=1000, transposed=False, scaled=None, rank_scales=None):
    """Every rank's peer steps (0..W-2), then (copy engine) the copy plan: returns the layout,
    the buffers, their address table and every rank's output [M/W, N], still NaN."""
    m, n = x.shape[0] // world, w.shape[0]
    part = partial_dtype(x, scaled)
    out_dtype = x.dtype if scaled is None else scaled.out_dtype
    layout = Layout.of(m, n, part.itemsize, world, cfg, uses_reducer(cfg))
    buffers, ptrs = make_buffers(world, layout, poison, part, x.device)
    outs = [torch.full((m, n), float("nan"), dtype=out_dtype, device=x.device) for _ in range(world)]
    for r in range(world):
        xr, wr = shards(x, w, r, k_local, transposed)
        launch_kernel(xr, wr, b, outs[r], ptrs, layout.flags_offset, r, world, cfg, 0, world - 2, max_spins,
                      None, *_scaling(scaled, rank_scales, r), layout.own_offset, buffers)  # fmt: skip
    if cfg.copy_engine:
        copy_engine(buffers, ptrs, layout, world, part)
    return layout, buffers, ptrs, outs


def simulate(x, w, b, world, k_local, cfg, poison, max_spins=1000, transposed=False, scaled=None, rank_scales=None):
    """peer_steps, then every rank's own-rows step (W-1): returns every rank's output [M/W, N]
    and int32 flags."""
    layout, buffers, ptrs, outs = peer_steps(x, w, b, world, k_local, cfg, poison, max_spins, transposed, scaled, rank_scales)
    for r in range(world):
        xr, wr = shards(x, w, r, k_local, transposed)
        launch_kernel(xr, wr, b, outs[r], ptrs, layout.flags_offset, r, world, cfg, world - 1, world - 1, max_spins,
                      None, *_scaling(scaled, rank_scales, r), layout.own_offset, buffers)  # fmt: skip
    return outs, flag_views(buffers, layout)


def _deliveries(layout, cfg, owner, world):
    """What the owner's own-rows step waits for: (holder, slot, flag index, rows, cols) per
    (peer, tile), or per (peer, band) with the copy engine and the reducer kernel's push; rows
    and cols within the slot."""
    out = []
    for src in range(world):
        if src == owner:
            continue
        holder, slot = (src, owner - (owner > src)) if cfg.transport == "pull" else (owner, src - (src > owner))
        if cfg.copy_engine or layout.counts_bands:
            for band in range(layout.bands):
                first, end, _ = layout.band(band)
                out.append((holder, slot, slot * layout.bands + band, slice(first, end), slice(0, layout.n)))
        else:
            for pid_m in range(layout.tiles_m):
                for pid_n in range(layout.tiles_n):
                    rows = slice(pid_m * cfg.block_m, min((pid_m + 1) * cfg.block_m, layout.rows_per_rank))
                    cols = slice(pid_n * cfg.block_n, min((pid_n + 1) * cfg.block_n, layout.n))
                    flag = slot * layout.tiles_m * layout.tiles_n + pid_m * layout.tiles_n + pid_n
                    out.append((holder, slot, flag, rows, cols))
    return out


def owner_with_late_partials(x, w, b, world, k_local, cfg, owner, delay_s, max_spins, what, scaled=None, rank_scales=None):
    """One GPU, waits that really wait: every rank's peer steps, then the owner's partials and
    flags taken back (NaN, flag 0) and delivered again by a copy stream, last first, each behind a
    host gate opened `delay_s` apart (tests/_gates.py), while the owner's own-rows step runs.
    Returns the owner's output [M/W, N]."""
    # Imported here: the interpreter scripts run this module from tests/ by path, outside the package.
    from tests._gates import HostGates

    m, n = x.shape[0] // world, w.shape[0]
    part = partial_dtype(x, scaled)
    layout, buffers, ptrs, outs = peer_steps(x, w, b, world, k_local, cfg, float("nan"), 1 << 20, False, scaled, rank_scales)
    parts = [buf[: layout.slots * m * n * part.itemsize].view(part).view(layout.slots, m, n) for buf in buffers]
    flags = flag_views(buffers, layout)
    complete = layout.complete_flags(cfg.copy_engine).tolist()
    owed = _deliveries(layout, cfg, owner, world)
    saved = []
    for holder, slot, flag, rows, cols in owed:  # take them back: NaN and flag 0 until delivered again
        assert flags[holder][flag].item() == complete[flag], f"{what}: flag {flag} of rank {holder} was never set"
        saved.append(parts[holder][slot, rows, cols].clone())
        parts[holder][slot, rows, cols] = float("nan")
        flags[holder][flag] = 0
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    copy.wait_stream(compute)
    finished = torch.cuda.Event()
    xr, wr = shards(x, w, owner, k_local)
    launch_kernel(xr, wr, b, outs[owner], ptrs, layout.flags_offset, owner, world, cfg, world - 1, world - 1, max_spins,
                  None, *_scaling(scaled, rank_scales, owner), layout.own_offset, buffers)  # fmt: skip
    finished.record(compute)
    gates = HostGates(len(owed))
    with torch.cuda.stream(copy):  # last tile first: every program of the kernel waits for a while
        for (holder, slot, flag, rows, cols), data in reversed(list(zip(owed, saved))):
            gates.hold()
            parts[holder][slot, rows, cols].copy_(data)
            torch.ops.symm_mem.stream_write_value32_(flags[holder].view(torch.uint32), flag, complete[flag])
    gates.open_slowly(finished, delay_s, what)
    torch.cuda.synchronize()
    return outs[owner]
