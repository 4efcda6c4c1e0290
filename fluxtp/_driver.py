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
