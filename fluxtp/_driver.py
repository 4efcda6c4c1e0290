"""The few CUDA driver calls the fused ops' hot path makes directly, through ctypes.

Each costs less host time than PyTorch's wrapper of the same operation (docs/perf-log.md) and
takes raw stream handles, so the caller never switches PyTorch's current stream. Only for work
PyTorch need not know about: the streams, events and graphs are PyTorch's, and the caller holds
the memory for as long as the GPU uses it.
"""

from __future__ import annotations

import ctypes
import functools

_P, _U32, _U64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64


@functools.cache
def _lib():
    return ctypes.CDLL("libcuda.so.1")


def _function(*names: str, argtypes: list):
    """The first of `names` that libcuda exports (a versioned name first), typed."""
    lib = _lib()
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            return fn
    raise RuntimeError(f"libcuda.so.1 exports none of {names}")


@functools.cache
def _functions():
    return {
        "record": _function("cuEventRecord", argtypes=[_P, _P]),
        "wait_event": _function("cuStreamWaitEvent", argtypes=[_P, _P, _U32]),
        "copy": _function("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync", argtypes=[_U64, _U64, ctypes.c_size_t, _P]),
        "graph_launch": _function("cuGraphLaunch", argtypes=[_P, _P]),
        "wait_value32": _function("cuStreamWaitValue32_v2", "cuStreamWaitValue32", argtypes=[_P, _U64, ctypes.c_uint32, _U32]),
    }  # fmt: skip


@functools.cache
def _graph_functions():
    """The calls that update a recorded kernel's parameters (CUDA 12.4 or newer)."""
    return {
        "graph_nodes": _function("cuGraphGetNodes", argtypes=[_P, _P, ctypes.POINTER(ctypes.c_size_t)]),
        "node_type": _function("cuGraphNodeGetType", argtypes=[_P, ctypes.POINTER(ctypes.c_int)]),
        "kernel_node_params": _function("cuGraphKernelNodeGetParams_v2", argtypes=[_P, _P]),
        "exec_kernel_node_set": _function("cuGraphExecKernelNodeSetParams_v2", argtypes=[_P, _P, _P]),
        "param_info": _function("cuFuncGetParamInfo", argtypes=[_P, ctypes.c_size_t, _P, _P]),
        "encode_tiled": _function("cuTensorMapEncodeTiled", argtypes=[_P, ctypes.c_int, _U32, _P, _P, _P, _P, _P,
                                                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    }  # fmt: skip


def _check(status: int, what: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {status} ({(name.value or b'?').decode()})")


def stream_wait_event(waiter: int, producer: int, event: int) -> None:
    """Stream `waiter` waits for the work queued on `producer` so far (`event`, reused: a wait
    takes the event's state when it is queued). Raw handles: stream.cuda_stream, event.cuda_event."""
    f = _functions()
    _check(f["record"](event, producer), "cuEventRecord")
    _check(f["wait_event"](waiter, event, 0), "cuStreamWaitEvent")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """nbytes from device address src to dst, queued on `stream`."""
    _check(_functions()["copy"](dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def graph_launch(graph_exec: int, stream: int) -> None:
    """Replay an instantiated graph (torch.cuda.CUDAGraph.raw_cuda_graph_exec()) on `stream`."""
    _check(_functions()["graph_launch"](graph_exec, stream), "cuGraphLaunch")


def stream_wait_value32(stream: int, address: int, value: int) -> None:
    """Hold `stream`'s later work until the int32 at device `address` is >= value (wrapping)."""
    _check(_functions()["wait_value32"](stream, address, value & 0xFFFFFFFF, 0), "cuStreamWaitValue32")  # 0: GEQ


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2: a kernel node's function, launch shape and parameters."""

    _fields_ = [
        ("func", _P),
        ("grid", _U32 * 3),
        ("block", _U32 * 3),
        ("shared_mem_bytes", _U32),
        ("kernel_params", _P),
        ("extra", _P),
        ("kern", _P),
        ("ctx", _P),
    ]


_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


def kernel_nodes(graph: int) -> list[tuple[int, KernelNodeParams]]:
    """(node, its parameters) of every kernel node of a CUDA graph (torch.cuda.CUDAGraph's
    raw_cuda_graph(), kept with keep_graph=True)."""
    f = _graph_functions()
    count = ctypes.c_size_t(0)
    _check(f["graph_nodes"](graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (_P * count.value)()
    _check(f["graph_nodes"](graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    found = []
    for node in nodes[: count.value]:
        kind = ctypes.c_int(-1)
        _check(f["node_type"](node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _KERNEL_NODE:
            params = KernelNodeParams()
            _check(f["kernel_node_params"](node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
            found.append((node, params))
    return found


def graph_call(graph_exec: int, nodes: list):
    """A callable of a raw stream: each kernel node of `nodes`, (node, KernelNodeParams), takes its
    parameters (the driver copies their values then; launches already queued keep theirs), then
    `graph_exec` is launched. Its arguments are bound once: it runs on every fused call."""
    set_node = _graph_functions()["exec_kernel_node_set"]
    updates = [functools.partial(set_node, graph_exec, node, ctypes.byref(params)) for node, params in nodes]
    launch = functools.partial(_functions()["graph_launch"], graph_exec)

    def call(stream: int) -> None:
        for update in updates:
            status = update()
            if status != 0:
                _check(status, "cuGraphExecKernelNodeSetParams")
        status = launch(stream)
        if status != 0:
            _check(status, "cuGraphLaunch")

    return call


def kernel_param_sizes(function: int) -> list[int] | None:
    """The byte size of each parameter of a loaded kernel (cuFuncGetParamInfo), None where this
    driver cannot tell."""
    try:
        info = _graph_functions()["param_info"]
    except (OSError, RuntimeError):
        return None
    sizes = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes


def encode_tiled_tensor_map(out: int, dtype: int, address: int, shape, strides_bytes, box, swizzle: int,
                            nan_fill: bool) -> None:  # fmt: skip
    """Fill the 128-byte CUtensorMap at host address `out` (64-byte aligned) for a row-major tensor
    at device `address`: shape and box outermost first, strides_bytes of every dim but the last;
    element strides 1, no interleave, 128-byte L2 promotion, out-of-bounds reads zero (NaN where
    nan_fill), as Triton encodes its host descriptors."""
    rank = len(shape)
    dims = (ctypes.c_uint64 * rank)(*reversed(shape))
    strides = (ctypes.c_uint64 * rank)(*reversed(strides_bytes), 0)
    boxes = (ctypes.c_uint32 * rank)(*reversed(box))
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    status = _graph_functions()["encode_tiled"](out, dtype, rank, address, dims, strides, boxes, ones, 0, swizzle, 2,
                                          1 if nan_fill else 0)  # fmt: skip
    _check(status, "cuTensorMapEncodeTiled")
