"""Launch helpers shared by the fused ops (host side, kept cheap: they run on every call)."""

from __future__ import annotations

import atexit
import functools
import sys

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from fluxtp.configs import weight_layout_of


def _tma_compatible(t: torch.Tensor) -> bool:
    """TMA needs a unit last stride and a 16-byte aligned base and row stride."""
    size = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself if TMA can read it, else a row-major copy (callers check the last dim is a
    multiple of 16 bytes, so the copy's rows are aligned)."""
    if _tma_compatible(t):
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def weight_operand(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what the B descriptor reads, kn) for an nn.Linear-layout weight [n, k] (y = x @ weight^T).

    A transposed view (strides (1, n): the W^T of a [k, n] weight that the backward passes)
    is read through its row-major [k, n] base with kn=True, not copied: a copy cost a read and
    a write of every weight on every backward step. If TMA cannot read that base (n not a
    multiple of 16 bytes), and for any other layout, the weight is read as a row-major [n, k].
    """
    operand = WeightOperand(weight)
    return operand.of(weight), operand.kn


class WeightOperand:
    """weight_operand's choice for one call signature, made once; `of` applies it to a call's
    weight. row_major_only: FP8 weights, which FP8 tensor cores read K-major only."""

    __slots__ = ("kn", "copy")

    def __init__(self, weight: torch.Tensor, row_major_only: bool = False):
        self.kn = not row_major_only and weight_layout_of(weight) == "transposed" and _tma_compatible(weight.t())
        self.copy = not self.kn and not _tma_compatible(weight)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """What the B descriptor reads: the [k, n] base of a transposed view, else the [n, k] rows."""
        return weight.t() if self.kn else (tma_ready(weight) if self.copy else weight)

    def block(self, config) -> list[int]:
        """The B descriptor's block for `config`'s tiles."""
        return [config.block_k, config.block_n] if self.kn else [config.block_n, config.block_k]


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor for t, made afresh on every call, never cached by address: a cache
    that held the calls' tensors kept the caching allocator from reusing their memory
    (docs/perf-log.md). Plans cache a descriptor's layout instead (DescriptorLayout)."""
    return TensorDescriptor.from_tensor(t, block)


class DescriptorLayout:
    """Everything of a TensorDescriptor but its base tensor, for one call signature: a call
    rebinds it to its own tensor (`over`) without keeping that tensor (the trap `descriptor`
    names). `over` skips TensorDescriptor's checks: the caller guarantees a tensor of the
    layout's dtype, shape and strides, 16-byte aligned (a plan's key holds all of them, and
    fresh allocations are aligned)."""

    __slots__ = ("fields",)

    def __init__(self, example: torch.Tensor, block: list[int]):
        desc = TensorDescriptor.from_tensor(example, block)  # checked once, here
        self.fields = {name: value for name, value in vars(desc).items() if name != "base"}

    def over(self, base: torch.Tensor) -> TensorDescriptor:
        desc = object.__new__(TensorDescriptor)
        vars(desc).update(self.fields)
        desc.base = base
        return desc


def _spec_key(arg):
    """What of one argument can decide Triton's specialization, or more: a scalar's exact type and
    value (Triton: ==1, divisible by 16, 32 or 64 bits), a tensor's dtype and 16-byte alignment
    (Triton: dtype, aligned or not), a descriptor's dtype, alignment, shape, strides and block."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, TensorDescriptor):
        base, layout = arg.base, (tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape))
        return (base.dtype, base.data_ptr() % 16 == 0, layout, getattr(arg, "padding", None))
    return (type(arg), arg)


# (kernel, device, argument keys, constexprs) -> (compiled kernel, its constexpr values in signature order)
_compiled: dict[tuple, tuple] = {}
_MAX_COMPILED = 1024  # distinct launch keys kept (scalars are keyed exactly: one per shape)


def launch_compiled(kernel, grid: int, *args, **constexprs) -> None:
    """kernel[(grid,)](*args, **constexprs) without Triton's per-call argument binding.

    Triton binds and specializes every argument in Python on each launch, a large share of a
    launch's host time (docs/perf-log.md). Here the compiled kernel is found by _spec_key of
    every argument, at least as fine as Triton's specialization, so it is the kernel Triton
    would run, launched the way Triton launches it (launch hooks included); a key's first call
    goes through Triton (compiling if need be). The interpreter's kernels take their own launch.
    """
    _launch(kernel, grid, args, constexprs)


def _launch(kernel, grid: int, args: tuple, constexprs: dict):
    """launch_compiled; returns (compiled kernel, constexpr values, device), None for a kernel
    that is not compiled (the interpreter's)."""
    if not isinstance(kernel, JITFunction):
        kernel[(grid,)](*args, **constexprs)
        return None
    device = driver.active.get_current_device()
    key = (kernel, device, tuple(map(_spec_key, args)), tuple(constexprs.items()))
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[(grid,)](*args, **constexprs)
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        entry = _compiled[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args) :]))
        return (*entry, device)
    _run(entry[0], entry[1], device, grid, args)
    return (*entry, device)


def _run(compiled, constexpr_values: tuple, device: int, grid: int, args: tuple) -> None:
    """Launch an already compiled kernel as Triton does (its launcher, its hooks)."""
    stream = driver.active.get_current_stream(device)
    all_args = (*args, *constexpr_values)
    hooks = knobs.runtime
    compiled.run(
        grid,
        1,
        1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        compiled.launch_metadata((grid,), stream, *all_args),
        hooks.launch_enter_hook,
        hooks.launch_exit_hook,
        *all_args,
    )


class Launch:
    """One kernel's launch for one call signature: the grid and constexprs fixed, the compiled
    kernel found at the first launch (launch_compiled) and launched directly from then on.

    The caller guarantees that every later call's arguments specialize as the first call's did
    (same dtypes, 16-byte alignments, descriptor layouts and scalars): a plan's key does.
    """

    __slots__ = ("kernel", "grid", "constexprs", "_entry")

    def __init__(self, kernel, grid: int, **constexprs):
        self.kernel, self.grid, self.constexprs = kernel, grid, constexprs
        self._entry = None

    def __call__(self, *args) -> None:
        entry = self._entry
        if entry is not None and driver.active.get_current_device() == entry[2]:
            _run(entry[0], entry[1], entry[2], self.grid, args)
        else:
            self._entry = _launch(self.kernel, self.grid, args, self.constexprs)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few under the CPU interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


# Bounds of every wait, so that a peer that never signals fails the call instead of hanging it.
BARRIER_TIMEOUT_MS = 60_000  # symmetric-memory barriers on the host's streams
# In-kernel spin bounds, far past any real wait (a peer still compiling its first launch
# included) and short of a hang. A spin on local memory (the all-gather's chunk signals) is one
# atomic read, well under a microsecond: 2^27 spins is tens of seconds. A system-scope read,
# maybe of a peer's memory over NVLink (the reduce-scatter's and all-reduce's flags), costs a
# microsecond or two: 2^26 spins is a minute or more.
MAX_SPINS_LOCAL = 1 << 27
MAX_SPINS_PEER = 1 << 26

# What a kernel's timeout record (source rank, index, this rank) names, per op.
_WAITED_FOR = {
    "all_gather_matmul": "chunk {index} of rank {src}'s rows",
    "matmul_reduce_scatter": "rank {src}'s partial of tile {index}",
    "matmul_all_reduce": "rank {src}'s partial of tile {index}",
    "all_reduce": "rank {src}'s partial of tile {index}",
}
# int32 [3] per (op, device type), pinned for CUDA: (source rank, chunk or tile, rank) of a wait
# that gave up; -1 while none has.
_reports: dict[tuple[str, str], torch.Tensor] = {}


def timeout_record(op: str, device: torch.device) -> torch.Tensor:
    """Host memory op's kernels can write (pinned on CUDA), created on first use (outside capture)."""
    key = (op, torch.device(device).type)
    if key not in _reports:
        if not _reports:
            atexit.register(_print_timeout_reports)
        _reports[key] = torch.full((3,), -1, dtype=torch.int32, pin_memory=key[1] == "cuda")
    return _reports[key]


def timeout_report(op: str) -> str | None:
    """Which in-kernel wait of `op` gave up in this process, if one did (readable after the trap)."""
    for (name, _), report in _reports.items():
        src, index, rank = report.tolist()
        if name == op and src >= 0:
            what = _WAITED_FOR.get(op, "rank {src}'s data {index}").format(src=src, index=index)
            return (
                f"fluxtp {op}: rank {rank} timed out waiting for {what} "
                "(the peer never signalled: it failed, hung, or called with another shape)"
            )
    return None


def _print_timeout_reports() -> None:
    for op in dict.fromkeys(name for name, _ in _reports):
        report = timeout_report(op)
        if report is not None:
            print(report, file=sys.stderr)
