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
    if weight_layout_of(weight) == "transposed" and _tma_compatible(weight.t()):
        return weight.t(), True
    return tma_ready(weight), False


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor for t. Made afresh on every call (about 3 us), never cached: a
    cache keyed by address held every call's tensors alive, so the caching allocator could not
    reuse their memory and each call paid a cudaMalloc per output (~0.1 ms each on the H200
    hosts) while memory grew by up to 256 calls' outputs (docs/perf-log.md)."""
    return TensorDescriptor.from_tensor(t, block)


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

    Triton binds and specializes every argument in Python on each launch: 13-35 us of the
    60-110 us of host time one launch of these kernels costs (H100 and H200 hosts,
    benchmarks/launch_overhead.py, docs/perf-log.md), on every call of a fused op. Here the
    compiled kernel is found by _spec_key of every argument, which is at least as fine as
    Triton's specialization, so it is the kernel Triton would run, launched the way Triton
    launches it (launch hooks included); a key's first call goes through Triton (compiling if
    need be). The interpreter's kernels take their own launch.
    """
    if not isinstance(kernel, JITFunction):
        kernel[(grid,)](*args, **constexprs)
        return
    device = driver.active.get_current_device()
    key = (kernel, device, tuple(map(_spec_key, args)), tuple(constexprs.items()))
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[(grid,)](*args, **constexprs)
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        _compiled[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args) :]))
        return
    compiled, constexpr_values = entry
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


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few under the CPU interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


# int32 [3] per (op, device type), pinned for CUDA: (peer rank, tile, rank) of a wait that gave up.
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
        src, tile, rank = report.tolist()
        if name == op and src >= 0:
            return (
                f"fluxtp {op}: rank {rank} timed out waiting for rank {src}'s partial of tile {tile} "
                "(the peer never signalled: it failed, hung, or called with another shape)"
            )
    return None


def _print_timeout_reports() -> None:
    for op in dict.fromkeys(name for name, _ in _reports):
        report = timeout_report(op)
        if report is not None:
            print(report, file=sys.stderr)
