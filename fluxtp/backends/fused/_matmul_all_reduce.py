"""Fused GEMM+AllReduce and AllReduce launchers: one persistent kernel pushes every tile to every
rank and reduces it there (one-shot), for decode-size calls; larger calls take the two-shot path.

One-shot (fluxtp/kernels/_matmul_all_reduce.py): one launch on the caller's stream, nothing
else: no flag reset, no barrier, no host synchronization. The kernel's flags hold call counts
(epochs) and its data alternates between two slot sets, so back-to-back calls and every replay
of a captured CUDA graph are safe by themselves (the kernel docstring says why). The epoch
lives in this rank's ordinary memory beside the workspace and is advanced by the kernel.
What the host does per call: look up the cached workspace, build (cached) TMA descriptors,
launch. The workspace is created, and its flags zeroed behind a barrier, on the first call and
whenever a larger call outgrows it: do that outside CUDA graph capture (warm up at the largest
shape), on every rank at the same call (SPMD).

Two-shot, for calls of more than ONE_SHOT_MAX_ROWS rows (prefill: the GEMM has enough tiles to
hide a reduce-scatter): the fused GEMM+ReduceScatter (_matmul_reduce_scatter), then an NCCL all-gather of the
reduced rows. At W ranks one-shot moves (W-1)/W more data than reduce-scatter + all-gather but
hides all of it behind the GEMM; which is faster at which M is measured (docs/perf-log.md).

The output is fresh memory owned by the caller; the same sum, bit for bit, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.configs import AllReduceConfig, MatmulAllReduceConfig, all_reduce_one_shot_max_bytes
from fluxtp.backends.fused import _launch
from fluxtp.backends.fused._launch import BARRIER_TIMEOUT_MS, MAX_SPINS_PEER, DescriptorLayout, Launch, _tma_compatible, num_sms, tma_ready
from fluxtp.kernels._matmul_all_reduce import matmul_all_reduce_kernel

MAX_SPINS = MAX_SPINS_PEER  # system-scope reads of flags the peers push
# int32 flags at the start of every workspace, one per (tile, source rank) of a call.
FLAG_CAPACITY = 1 << 16
# GEMM+AllReduce is one-shot up to this many rows (decode; its narrow tiles lost to cuBLAS + NCCL
# at 512 and 1024 rows, 0.68x / 0.64x) and two-shot above when the rows divide over the ranks.
ONE_SHOT_MAX_ROWS = 256
_OP = "matmul_all_reduce"
_ALL_REDUCE_OP = "all_reduce"


@dataclass(frozen=True)
class Layout:
    """Byte layout of a workspace: FLAG_CAPACITY int32 flags, then 2 * W slots of slot_bytes."""

    data_offset: int
    slot_bytes: int
    nbytes: int

    @staticmethod
    def of(numel: int, itemsize: int, world: int) -> Layout:
        slot_bytes = triton.cdiv(numel * itemsize, 16) * 16
        data_offset = 4 * FLAG_CAPACITY
        return Layout(data_offset, slot_bytes, data_offset + 2 * world * slot_bytes)


@dataclass
class _Workspace:
    buffer: symm.SymmBuffer
    buffer_ptrs: torch.Tensor  # int64 [W], every rank's buffer base as this GPU addresses it
    counters: torch.Tensor  # int32 [2] in this rank's memory: (epoch, programs done)


_workspaces: dict[tuple[str, int, str], _Workspace] = symm.op_workspaces()


def _workspace(info: GroupInfo, op: str, device: torch.device, nbytes: int) -> _Workspace:
    """The cached workspace; a new (or grown) buffer gets zero flags and epoch 0 on every rank."""
    buf = symm.buffer(info, op, nbytes, device)
    key = (info.name, torch.device(device).index or 0, op)
    ws = _workspaces.get(key)
    if ws is None or ws.buffer is not buf:
        buf.local(torch.int32, (FLAG_CAPACITY,)).zero_()
        # No peer may push a flag into this buffer before it is zeroed: all ranks create it at
        # the same call, and each zeroes before this barrier and launches only after it.
        buf.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        ptrs = [buf.peer(r, torch.uint8, (buf.nbytes,)).data_ptr() for r in range(info.world_size)]
        ws = _Workspace(
            buf,
            torch.tensor(ptrs, dtype=torch.int64, device=device),
            torch.zeros(2, dtype=torch.int32, device=device),
        )
        _workspaces[key] = ws
    return ws


def timeout_report() -> str | None:
    """Which in-kernel wait of these ops gave up in this process, if one did."""
    return _launch.timeout_report(_OP) or _launch.timeout_report(_ALL_REDUCE_OP)


class _Kernel:
    """The kernel's launch for one call signature: grid, constexprs and scalars resolved once,
    descriptor layouts at the first launch; a launch binds the call's tensors.

    GEMM mode (weight given): x [M, k], weight [N, k] TMA-ready, config a MatmulAllReduceConfig.
    Sum mode (weight None): x contiguous, config an AllReduceConfig. phases: 1 push, 2 reduce, 3 both.
    """

    def __init__(self, x, weight, bias, layout: Layout, rank: int, world: int, config, phases, max_spins, report):
        self.op = op = _ALL_REDUCE_OP if weight is None else _OP
        self.gemm = weight is not None
        if weight is None:
            numel = x.numel()
            n = config.block_n
            m, k = triton.cdiv(numel, n), 0
        else:
            (m, k), n = x.shape, weight.shape[0]
            numel = m * n
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        if tiles * world > FLAG_CAPACITY:
            raise ValueError(f"{op}: {tiles} tiles x {world} ranks exceed the {FLAG_CAPACITY} flags of the workspace")
        self.empty = numel == 0
        self.config = config
        self.layouts = None
        sms = num_sms(x.device)
        report = _launch.timeout_record(op, x.device) if report is None else report
        self.scalars = (m, n, k, numel, layout.data_offset, layout.slot_bytes, max_spins, report)
        self.launch = Launch(
            matmul_all_reduce_kernel,
            min(sms, max(tiles, 1)),
            PHASES=phases,
            RANK=rank,
            WORLD=world,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=getattr(config, "block_k", 16),
            GROUP_M=getattr(config, "group_m", 1),
            NUM_SMS=sms,
            HAS_GEMM=weight is not None,
            HAS_BIAS=bias is not None,
            SWAP_AB=getattr(config, "swap_ab", False),
            NUM_STAGES=getattr(config, "num_stages", 1),
            num_warps=config.num_warps,
            num_stages=getattr(config, "num_stages", 1),
        )

    def __call__(self, x, weight, bias, out, buffer_ptrs, counters):
        if self.empty:
            return
        a_desc = b_desc = None
        if self.gemm:
            layouts = self.layouts
            if layouts is None:
                c = self.config
                layouts = self.layouts = (
                    DescriptorLayout(x, [c.block_m, c.block_k]),
                    DescriptorLayout(weight, [c.block_n, c.block_k]),
                )
            a_desc, b_desc = layouts[0].over(x), layouts[1].over(weight)
        self.launch(a_desc, b_desc, x, out, out if bias is None else bias, buffer_ptrs, counters, *self.scalars)


def launch_kernel(
    x,
    weight,
    bias,
    out,
    buffer_ptrs,
    counters,
    layout: Layout,
    rank: int,
    world: int,
    config,
    phases: int = 3,
    max_spins: int = MAX_SPINS,
    report: torch.Tensor | None = None,
):
    """The kernel alone (CPU tensors run it under TRITON_INTERPRET=1).

    GEMM mode (weight given): x [M, k], weight [N, k] TMA-ready, out [M, N], config a
    MatmulAllReduceConfig. Sum mode (weight None): x and out contiguous with the same numel,
    config an AllReduceConfig. buffer_ptrs int64 [W] of workspaces laid out as `layout`,
    counters this rank's int32 (epoch, done). phases: 1 push, 2 reduce, 3 both.
    """
    _Kernel(x, weight, bias, layout, rank, world, config, phases, max_spins, report)(
        x, weight, bias, out, buffer_ptrs, counters
    )


def one_shot_fits(m: int, n: int, world: int, config: MatmulAllReduceConfig) -> bool:
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    return m <= ONE_SHOT_MAX_ROWS and tiles * world <= FLAG_CAPACITY


class _OneShot:
    """One call signature of the one-shot path, resolved: layout, workspace, the kernel's launch."""

    def __init__(self, op, x, weight, bias, info: GroupInfo, config, out_shape):
        numel = x.numel() if weight is None else x.shape[0] * weight.shape[0]
        layout = Layout.of(numel, x.element_size(), info.world_size)
        self.ws = _workspace(info, op, x.device, layout.nbytes)
        self.out_shape, self.dtype, self.device = out_shape, x.dtype, x.device
        self.kernel = _Kernel(x, weight, bias, layout, info.rank, info.world_size, config, 3, MAX_SPINS, None)

    def __call__(self, x, weight, bias):
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        self.kernel(x, weight, bias, out, self.ws.buffer_ptrs, self.ws.counters)
        return out


class _TwoShot:
    """The fused GEMM+ReduceScatter (_matmul_reduce_scatter, its own plan), then an NCCL all-gather of the rows."""

    def __init__(self, m, n, info: GroupInfo):
        self.m, self.n, self.info = m, n, info

    def __call__(self, x, weight, bias):
        from fluxtp.backends.fused import _matmul_reduce_scatter

        rows = _matmul_reduce_scatter.matmul_reduce_scatter(x, weight, bias, self.info)
        out = rows.new_empty(self.m, self.n)
        dist.all_gather_into_tensor(out, rows, group=self.info.group)
        return out


class _Ready:
    """A plan behind the copies its kernel needs (TMA-ready x and weight, a contiguous bias), each
    decided once for the signature."""

    def __init__(self, run, x, weight, bias):
        self.run = run
        self.copy_x = not _tma_compatible(x)
        self.copy_w = not _tma_compatible(weight)
        self.copy_bias = bias is not None and not bias.is_contiguous()

    def __call__(self, x, weight, bias):
        if self.copy_x:
            x = tma_ready(x)
        if self.copy_w:
            weight = tma_ready(weight)
        if self.copy_bias:
            bias = bias.contiguous()
        return self.run(x, weight, bias)


def _gemm_plan(x, weight, bias, info: GroupInfo, config):
    ready_x, ready_w = tma_ready(x), tma_ready(weight)
    ready_bias = None if bias is None else bias.contiguous()
    m, n = ready_x.shape[0], ready_w.shape[0]
    config = config or MatmulAllReduceConfig.heuristic(m, n, ready_x.shape[1], info.world_size, num_sms(x.device))
    if one_shot_fits(m, n, info.world_size, config) or m % info.world_size:
        run = _OneShot(_OP, ready_x, ready_w, ready_bias, info, config, (m, n))
    else:
        run = _TwoShot(m, n, info)
    return _Ready(run, x, weight, bias)


def _sum_plan(x, info: GroupInfo, config):
    config = config or AllReduceConfig()
    copy_x = not x.is_contiguous()
    x = x.contiguous()
    tiles = triton.cdiv(triton.cdiv(x.numel(), config.block_n), config.block_m)
    one_shot_bytes = all_reduce_one_shot_max_bytes(info.world_size)  # the workspace holds 2 * W such slots
    if x.numel() * x.element_size() <= one_shot_bytes and tiles * info.world_size <= FLAG_CAPACITY:
        one_shot = _OneShot(_ALL_REDUCE_OP, x, None, None, info, config, x.shape)
        return lambda t: one_shot(t.contiguous() if copy_x else t, None, None)

    def nccl(t):
        out = t.contiguous().clone()
        dist.all_reduce(out, group=info.group)
        return out

    return nccl


_plans = PlanCache()


def plan(x, weight, bias, info: GroupInfo, config=None):
    """The cached plan of this call signature: a callable (x, weight, bias) for GEMM+AllReduce,
    (x) for AllReduce (weight None)."""
    key = (tensor_key(x), tensor_key(weight), tensor_key(bias), info, config)
    found = _plans.get(key)
    if found is None:
        found = _plans.put(key, _sum_plan(x, info, config) if weight is None else _gemm_plan(x, weight, bias, info, config))
    return found


def matmul_all_reduce(x, weight, bias, info: GroupInfo, config: MatmulAllReduceConfig | None = None):
    """[M, n]: sum over ranks of x @ weight^T, plus bias; bitwise the same on every rank."""
    return plan(x, weight, bias, info, config)(x, weight, bias)


def all_reduce(x, info: GroupInfo, config: AllReduceConfig | None = None):
    """The sum of x over the ranks, a new tensor; bitwise the same on every rank.

    One-shot up to all_reduce_one_shot_max_bytes(W); a larger tensor is bandwidth-bound, where
    one-shot moves W-1 times the data: it goes to NCCL's all-reduce instead (the same sum within
    rounding)."""
    return plan(x, None, None, info, config)(x)
