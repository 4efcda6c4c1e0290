"""Launch helpers shared by the fused ops (host side, kept cheap: they run on every call)."""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import sys
import warnings

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from fluxtp import _driver
from fluxtp.configs import weight_layout_of
from fluxtp.kernels import COMPILE_OPTIONS

try:  # Gluon kernels take descriptors that carry their shared-memory layout
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    _GLUON_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                     torch.float32: gl.float32}  # fmt: skip
except ImportError:  # a Triton without Gluon: no Gluon kernel is launched
    GluonTensorDescriptor = None


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
    fresh allocations are aligned). With `gluon`, Gluon's descriptor, which carries the layout
    its kernel's shared memory has (the default NVMMA layout of the block and dtype)."""

    __slots__ = ("cls", "fields")

    def __init__(self, example: torch.Tensor, block: list[int], gluon: bool = False, swizzled: bool = True):
        if gluon:  # swizzled=False: rows the kernel reads one at a time from shared memory
            self.cls = GluonTensorDescriptor
            dtype = _GLUON_DTYPES[example.dtype]
            shared = (gl.NVMMASharedLayout.get_default_for(block, dtype) if swizzled else
                      gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.primitive_bitwidth, rank=len(block)))
            desc = GluonTensorDescriptor(example, list(example.shape), list(example.stride()), block, shared)
        else:
            self.cls, desc = TensorDescriptor, TensorDescriptor.from_tensor(example, block)  # checked once, here
        self.fields = {name: value for name, value in vars(desc).items() if name != "base"}

    def over(self, base: torch.Tensor):
        desc = object.__new__(self.cls)
        vars(desc).update(self.fields)
        desc.base = base
        return desc


def _spec_key(arg):
    """What of one argument can decide Triton's specialization, or more: a scalar's exact type and
    value (Triton: ==1, divisible by 16, 32 or 64 bits), a tensor's dtype and 16-byte alignment
    (Triton: dtype, aligned or not), a descriptor's dtype, alignment, shape, strides and block."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, TensorDescriptor) or (GluonTensorDescriptor is not None and isinstance(arg, GluonTensorDescriptor)):
        base, layout = arg.base, (tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape))
        return (base.dtype, base.data_ptr() % 16 == 0, layout, getattr(arg, "padding", None), getattr(arg, "layout", None))
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
    key = _compiled_key(kernel, device, args, constexprs)
    entry = _compiled.get(key)
    if entry is None:
        entry = _remember(key, kernel[(grid,)](*args, **constexprs, **COMPILE_OPTIONS), kernel, args, constexprs)
        return (*entry, device)
    _run(entry[0], entry[1], device, grid, args)
    return (*entry, device)


def _compiled_key(kernel, device: int, args: tuple, constexprs: dict) -> tuple:
    return (kernel, device, tuple(map(_spec_key, args)), tuple(constexprs.items()))


def _remember(key: tuple, compiled, kernel, args: tuple, constexprs: dict) -> tuple:
    """_compiled[key] = (compiled, its constexpr values in signature order); returns the entry."""
    if len(_compiled) >= _MAX_COMPILED:
        _compiled.clear()
    entry = _compiled[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args) :]))
    return entry


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


class _Direct:
    """A compiled kernel's launch through its C launcher alone, each host TMA descriptor filled once
    per address. Triton fills every descriptor of a launch afresh (cuTensorMapEncodeTiled, ~1.6 us
    each on H200 hosts) and wraps the launcher in Python; a descriptor is a pure function of its
    base address and its position's layout (fixed for one Launch), so a filled one is reused
    whenever the caching allocator hands back the same address.

    Two launcher layouts are known: Triton 3.6's, one C launcher per kernel taking the arguments
    spread out, and Triton 3.8's, one C launcher for every kernel taking them as one list after the
    kernel's argument annotations and signature. `of` returns None for any other (then Triton's own
    `run` launches), and `__call__` is used only while no launch hook is set."""

    __slots__ = ("launcher", "head", "packed", "segments", "descs", "fill", "tail")

    MAX_ADDRESSES = 16  # filled descriptors kept per position (an eager model reuses a few)

    @classmethod
    def of(cls, compiled, constexpr_values: tuple, num_args: int):
        try:
            run = compiled.run
            wrapped = run.launch
            closure = getattr(wrapped, "__closure__", None) or ()
            free = dict(zip(wrapped.__code__.co_freevars, (c.cell_contents for c in closure))) if closure else {}
            packed = hasattr(run, "kernel_signature")
            if packed:  # Triton 3.8: wrap_handle_tensordesc_impl's inner, or the bare launcher
                launcher, paths = free.get("launcher", wrapped), free.get("relevant_paths", {})
                if any(paths.values()) or getattr(run, "gsan_enabled", False):
                    return None  # descriptors inside tuples, or instrumented launches
                positions = sorted(paths)
                metas = free.get("tensordesc_meta") or [None] * len(positions)
                make = free.get("make_tensordesc_arg")  # (descriptor, metadata, base arguments it ignores)
                fill = None if make is None else (lambda desc, meta: make(desc, meta, None))
                # the launcher's 15 leading arguments: grid (3), stream, function, cooperative, PDL,
                # kernel and launch metadata, 2 hooks, global and profile scratch, annotations, signature
                head = (run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata, None, None, None,
                        None, None, run.arg_annotations, run.kernel_signature)  # fmt: skip
            else:  # Triton 3.6
                names = {**wrapped.__globals__, **free}
                if "launcher" in free:  # wrap_handle_tensordesc's inner: the C launcher and the descriptors
                    launcher, positions = free["launcher"], sorted(free["tensordesc_indices"])
                    metas = free["tensordesc_meta"] or [None] * len(positions)
                    fill = names["make_tensordesc_arg"]
                else:
                    launcher, positions, metas, fill = wrapped, [], [], None
                # The launcher's 13 leading arguments: grid (3), stream, function, cooperative, PDL,
                # global and profile scratch, kernel metadata, launch metadata, 2 hooks.
                if names.get("_BASE_ARGS_FORMAT_LEN") != 13:
                    return None
                head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
            layout_ok = (
                run.global_scratch_size == 0
                and run.profile_scratch_size == 0
                and all(p < num_args for p in positions)
                and (fill is not None or not positions)
            )
            if not layout_ok:
                return None
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        return cls(launcher, head, packed, positions, metas, fill, constexpr_values)

    def __init__(self, launcher, head, packed, positions, metas, fill, constexpr_values):
        self.launcher, self.head, self.packed, self.fill = launcher, head, packed, fill
        # (start, descriptor position, its metadata): args[start:position] as they are, then the
        # descriptor at `position` expanded; the last segment (position None) runs to the end, and
        # the constexprs close the argument list.
        starts = [0, *(p + 1 for p in positions)]
        self.segments = [*zip(starts, positions, metas), (starts[-1], None, None)]
        self.descs = [{} for _ in positions]
        self.tail = constexpr_values

    def __call__(self, grid: int, stream: int, function, args: tuple) -> None:
        flat = []
        for i, (start, position, meta) in enumerate(self.segments):
            flat += args[start:position]
            if position is not None:
                desc = args[position]
                filled = self.descs[i]
                address = desc.base.data_ptr()
                expanded = filled.get(address)
                if expanded is None:
                    if len(filled) >= self.MAX_ADDRESSES:
                        filled.clear()
                    expanded = filled[address] = self.fill(desc, meta)
                flat += expanded
        flat += self.tail
        if self.packed:
            self.launcher(grid, 1, 1, stream, function, *self.head, flat)
        else:
            self.launcher(grid, 1, 1, stream, function, *self.head, *flat)


_PARAM_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}
_PARAM_CTYPES = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}
_TENSOR_MAP_BYTES, _TENSOR_MAP_ALIGN = 128, 64


class KernelParams:
    """A compiled Triton kernel's parameter array (cuLaunchKernel's kernelParams) for one call
    signature, built from its first launch's arguments; a call rebinds only the arguments that
    change (`binder`): a tensor's address, or a TMA descriptor's base, each descriptor encoded
    once per address as Triton encodes it (a pure function of the address for one layout).

    The array follows Triton's launcher: each argument that is not a constexpr in the kernel's
    signature, a host descriptor expanded to its 128-byte CUtensorMap, shape (i32) and strides
    (i64), then the global and profile scratch pointers (null). `of` returns None where that
    layout cannot be checked or does not match what the loaded kernel declares (cuFuncGetParamInfo).
    """

    MAX_ADDRESSES = 256  # encoded descriptors kept per argument (a model's weights and outputs cycle)

    def __init__(self, function: int, slots: dict, descriptors: dict, cells: list, array):
        self.function, self.slots, self.descriptors = function, slots, descriptors
        self.cells, self.array = cells, array  # kept alive: the array points into them

    @classmethod
    def of(cls, compiled, args: tuple):
        try:
            signature = list(compiled.src.signature.values())
            metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
            function = compiled.function
        except AttributeError:
            return None
        cells, sizes, slots, descriptors = [], [], {}, {}

        def add(cell, size):
            cells.append(cell)
            sizes.append(size)
            return len(cells) - 1

        for index, (arg, kind) in enumerate(zip(args, signature)):
            if kind == "constexpr":
                continue
            if isinstance(kind, str) and kind.startswith("tensordesc"):
                if not metas:
                    return None  # not lowered to a TMA descriptor
                meta = metas.pop(0)
                layout = _TensorMapLayout(arg, meta)
                slot = add(layout.encoded(arg.base.data_ptr()), _TENSOR_MAP_BYTES)
                for value in arg.shape:
                    add(ctypes.c_int32(value), 4)
                for value in arg.strides:
                    add(ctypes.c_int64(value), 8)
                slots[index], descriptors[index] = slot, layout
            elif isinstance(kind, str) and kind.startswith("*"):
                slots[index] = add(ctypes.c_uint64(0 if arg is None else arg.data_ptr()), 8)
            elif kind in _PARAM_SIZES and isinstance(arg, int):
                size = _PARAM_SIZES[kind]
                slots[index] = add(_PARAM_CTYPES[size](arg), size)
            else:
                return None
        for _ in range(2):  # global and profile scratch
            add(ctypes.c_uint64(0), 8)
        if metas or _driver.kernel_param_sizes(function) != sizes:
            return None
        array = (ctypes.c_void_p * len(cells))(*(c if isinstance(c, int) else ctypes.addressof(c) for c in cells))
        return cls(function, slots, descriptors, cells, array)

    def binder(self, indices: tuple):
        """A function of a tuple of tensors that makes argument indices[i] (a pointer or
        descriptor argument of the first launch) read tensors[i]; constexpr (None) arguments are
        not passed and stay unbound. Resolved once: it runs on every call."""
        array, steps = self.array, []
        for i, index in enumerate(indices):
            slot = self.slots.get(index)
            if slot is not None:
                layout = self.descriptors.get(index)
                steps.append((i, slot, None if layout is None else layout.encoded, self.cells[slot]))

        def bind(tensors) -> None:
            for i, slot, encoded, cell in steps:
                tensor = tensors[i]
                if encoded is not None:
                    array[slot] = encoded(tensor.data_ptr())
                else:
                    cell.value = 0 if tensor is None else tensor.data_ptr()

        return bind


class _TensorMapLayout:
    """One descriptor argument's fixed layout (dtype, shape, strides, block, swizzle); `encoded`
    returns the host address of its CUtensorMap for a base address, encoding it at first use."""

    def __init__(self, desc, meta):
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        if meta.get("fp4_padded"):
            raise ValueError("fp4-padded descriptors are not supported")
        self.dtype = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
        size = meta["elem_size"]
        self.shape, self.box, self.swizzle = list(desc.shape), list(meta["block_size"]), meta["swizzle"]
        self.strides_bytes = [stride * size for stride in list(desc.strides)[:-1]]
        self.nan_fill = getattr(desc, "padding", None) == "nan"
        self.maps: dict[int, int] = {}
        self.buffers: list = []

    def encoded(self, address: int) -> int:
        found = self.maps.get(address)
        if found is None:
            if len(self.maps) >= KernelParams.MAX_ADDRESSES:
                self.maps.clear()
                self.buffers.clear()
            buffer = ctypes.create_string_buffer(_TENSOR_MAP_BYTES + _TENSOR_MAP_ALIGN)
            found = -(-ctypes.addressof(buffer) // _TENSOR_MAP_ALIGN) * _TENSOR_MAP_ALIGN
            _driver.encode_tiled_tensor_map(found, self.dtype, address, self.shape, self.strides_bytes, self.box,
                                            self.swizzle, self.nan_fill)  # fmt: skip
            self.buffers.append(buffer)
            self.maps[address] = found
        return found


def _hooks_set() -> bool:
    """Whether a launch hook is set (Triton's hooks are a HookChain of `calls`, or a plain callable)."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


class Launch:
    """One kernel's launch for one call signature: the grid and constexprs fixed, the compiled
    kernel found at the first launch (launch_compiled) and launched directly from then on
    (_Direct while no launch hook is set, else as Triton launches it).

    The caller guarantees that every later call's arguments specialize as the first call's did
    (same dtypes, 16-byte alignments, descriptor layouts and scalars): a plan's key does.
    """

    __slots__ = ("kernel", "grid", "constexprs", "_entry", "_direct")

    def __init__(self, kernel, grid: int, **constexprs):
        self.kernel, self.grid, self.constexprs = kernel, grid, constexprs
        self._entry = self._direct = None

    def compile(self, *args):
        """The compiled kernel for these arguments, compiled and loaded without a launch, so that
        a first launch can be recorded in a CUDA graph (loading a module is no stream operation
        a graph can hold). None for the interpreter's kernels."""
        if self._entry is None:
            if not isinstance(self.kernel, JITFunction):
                return None
            device = driver.active.get_current_device()
            key = _compiled_key(self.kernel, device, args, self.constexprs)
            entry = _compiled.get(key)  # another plan's launch of the same key: no trip through Triton
            if entry is None:
                compiled = self.kernel.warmup(*args, grid=(self.grid,), **self.constexprs, **COMPILE_OPTIONS)
                entry = _remember(key, compiled, self.kernel, args, self.constexprs)
            entry[0].run  # noqa: B018 -- loads the module: the launcher and the function handle
            self._entry = (*entry, device)
            self._direct = _Direct.of(entry[0], entry[1], len(args))
        return self._entry[0]

    def __call__(self, *args) -> None:
        entry = self._entry
        if entry is not None and driver.active.get_current_device() == entry[2]:
            direct = self._direct
            if direct is not None and not _hooks_set():
                direct(self.grid, driver.active.get_current_stream(entry[2]), entry[0].function, args)
            else:
                _run(entry[0], entry[1], entry[2], self.grid, args)
        else:
            self._entry = entry = _launch(self.kernel, self.grid, args, self.constexprs)
            self._direct = None if entry is None else _Direct.of(entry[0], entry[1], len(args))


def on_stream(stream: torch.cuda.Stream, steps, restore: torch.cuda.Stream) -> None:
    """steps() issued with `stream` current, then `restore` current again. set_stream rather than
    `with torch.cuda.stream(...)`: a fraction of its host time (docs/perf-log.md)."""
    torch.cuda.set_stream(stream)
    try:
        steps()
    finally:
        torch.cuda.set_stream(restore)


def _recorded_on(stream: torch.cuda.Stream, graph: torch.cuda.CUDAGraph, record) -> torch.cuda.CUDAGraph:
    """`graph` with what `record()` issues on `stream` (made current meanwhile) captured into it;
    raises where CUDA cannot capture an operation. thread_local: other threads' CUDA work (a data
    loader's copies) may go on meanwhile. Python's cyclic garbage collector is off meanwhile: a
    collection that frees a symmetric allocation (the caller's garbage may hold one) unmaps it,
    which CUDA refuses during a capture, and the process aborts."""

    def capture():
        collecting = gc.isenabled()
        gc.disable()
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                record()
            finally:
                graph.capture_end()
        finally:
            if collecting:
                gc.enable()

    on_stream(stream, capture, torch.cuda.current_stream(stream.device))
    return graph


class StreamReplay:
    """A fixed run of stream operations (copies, flag writes and waits, barriers: every address
    the same on every call) recorded once as a CUDA graph, then issued with one graph launch.
    Each eager operation costs several microseconds of host time; one replay costs about what two
    or three of them do (docs/perf-log.md).

    `record()` issues the operations on the current stream; the owner passes it to each call
    (held here, its bound method would make owner and replay a reference cycle, which only
    Python's collector frees, at whatever moment, a CUDA graph capture's included). A call first
    makes the graph ready (`ready`, before it issues any work of its own: recording may wait for
    the device, and the call's kernel may wait for the recorded operations), then issues them
    (`__call__`) on the current stream, replayed, or eagerly while the caller captures its own
    graph (`capturing`: that graph then holds them); or replays them on a raw stream handle with
    _driver.graph_launch(graph_exec, stream). If CUDA cannot record one of the operations, a
    warning says so and every call issues them eagerly (graph_exec stays None)."""

    __slots__ = ("stream", "graph", "graph_exec")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream, self.graph = stream, None
        self.graph_exec = None  # the instantiated graph's raw handle, for _driver.graph_launch

    def ready(self, record, capturing: bool) -> None:
        if self.graph is not None or capturing:
            return
        try:
            graph = _recorded_on(self.stream, torch.cuda.CUDAGraph(), record)
        except RuntimeError as error:
            warnings.warn(f"fluxtp: a copy sequence could not be recorded as a CUDA graph, issued eagerly: {error}",
                          stacklevel=3)  # fmt: skip
            graph = False
        self.graph = graph
        self.graph_exec = graph.raw_cuda_graph_exec() if graph else None

    def __call__(self, record, capturing: bool) -> None:
        graph = self.graph
        if capturing or not graph:
            record()
        else:
            graph.replay()


class CallGraph:
    """A whole call recorded once as one CUDA graph, its kernels included: later calls rebind the
    kernels' changing arguments (KernelParams.binder), hand their nodes the parameters and launch
    the graph on the caller's stream, so that copies, flags, barriers and kernels cost one driver
    call and no stream switch or fork and join of PyTorch's (a graph's branches join at its end).

    `ready(kernels, record)` records the graph at the first call, outside the caller's graph
    capture: `kernels()` returns [(Launch, arguments)] of the call's kernels (each its own
    function), compiled before anything is recorded, and `record(launches)` issues the call's
    operations on the current stream (forking a side stream where they overlap), those launches
    among them (passed, not held: StreamReplay says why).
    `ready` says whether the graph can be used: where CUDA cannot record an operation, a kernel's
    parameters cannot be laid out, or a launch hook wants to see every launch, the caller takes
    its stream-by-stream path instead."""

    __slots__ = ("stream", "indices", "graph", "graph_exec", "params", "binders", "launch")

    def __init__(self, stream: torch.cuda.Stream, indices: tuple):
        """indices: per kernel, the arguments a call rebinds, in the order __call__ gets their tensors."""
        self.stream, self.indices = stream, indices
        self.graph = None  # False once recording failed
        self.graph_exec = self.params = self.binders = self.launch = None

    def ready(self, kernels, record) -> bool:
        if self.graph is None:
            self.graph = self._recorded(kernels, record) or False
        return bool(self.graph) and not _hooks_set()

    def _recorded(self, kernels, record):
        launches = kernels()
        params = []
        for launch, args in launches:
            compiled = launch.compile(*args)
            try:
                params.append(None if compiled is None else KernelParams.of(compiled, args))
            except (RuntimeError, OSError, ValueError) as error:
                warnings.warn(f"fluxtp: a kernel's parameters could not be laid out, the call issued step by step: "
                              f"{error}", stacklevel=4)  # fmt: skip
                return None
        if None in params:
            return None  # the interpreter, or a Triton whose parameter layout KernelParams does not know
        try:
            graph = _recorded_on(self.stream, torch.cuda.CUDAGraph(keep_graph=True), lambda: record(launches))
            graph.instantiate()
            recorded = _driver.kernel_nodes(graph.raw_cuda_graph())
        except (RuntimeError, OSError, ValueError, AttributeError) as error:
            warnings.warn(f"fluxtp: a call could not be recorded as one CUDA graph, issued step by step: {error}",
                          stacklevel=4)  # fmt: skip
            return None
        nodes = []
        for p in params:
            found = [(node, node_params) for node, node_params in recorded if node_params.func == p.function]
            if len(found) != 1:
                return None
            node, node_params = found[0]
            node_params.kernel_params = ctypes.addressof(p.array)
            node_params.extra = None
            nodes.append((node, node_params))
        self.params, self.graph_exec = params, graph.raw_cuda_graph_exec()
        self.binders = [p.binder(indices) for p, indices in zip(params, self.indices)]
        self.launch = _driver.graph_call(self.graph_exec, nodes)
        return graph

    def __call__(self, tensors: tuple, stream: int) -> None:
        """Launch on raw stream `stream`, kernel i's argument indices[i][j] reading tensors[i][j]."""
        for bind, kernel_tensors in zip(self.binders, tensors):
            bind(kernel_tensors)
        self.launch(stream)


_side_streams: dict[int, torch.cuda.Stream] = {}


def launch_beside(device: torch.device, launch, args: tuple, alongside) -> None:
    """For a recorded call: `launch(*args)` on a side branch forked from the current stream,
    `alongside()` on the current stream meanwhile; the branches join on the current stream."""
    index = torch.device(device).index or 0
    side = _side_streams.get(index)
    if side is None:  # a second stream of the device, only ever captured
        side = _side_streams[index] = torch.cuda.Stream(device=index)
    current = torch.cuda.current_stream(index)
    side.wait_stream(current)
    on_stream(side, lambda: launch(*args), current)
    alongside()
    current.wait_stream(side)


class DriverEvent:
    """One event for a plan's forks and joins by driver calls (_driver.stream_wait_event; reused:
    a wait takes the event's state when it is queued), made at its first wait, outside graph
    capture: PyTorch makes an event at its first record, on `stream`'s device."""

    __slots__ = ("stream", "event")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream, self.event = stream, None

    def wait(self, waiter: int, producer: int) -> None:
        """Raw stream `waiter` waits for the work queued on raw stream `producer` so far."""
        event = self.event
        if event is None:
            event = self.event = torch.cuda.Event()
            event.record(self.stream)
        _driver.stream_wait_event(waiter, producer, event.cuda_event)


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
            if index < 0:  # a stream-K tile's piece from another program of the same kernel
                what = f"program {src}'s part of stream-K tile {-1 - index}"
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
