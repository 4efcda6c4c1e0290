"""Workspaces on PyTorch symmetric memory: buffers every rank can address, side streams.

Invariants:
- A buffer is keyed by (group name, device, tag); one tag belongs to one op, so two ops never
  share a buffer. Every rank asks for the same sizes in the same order (SPMD), because
  allocation and rendezvous are collective.
- Buffers only grow. Growing waits for the device first (the old buffer may still be read by
  queued work), so do it outside CUDA graph capture: warm up once at the largest shape.
- symm knows nothing of GEMMs; the ops say how many bytes they need.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from fluxtp import _driver, _generation
from fluxtp._dist import GroupInfo, backend_name

# fluxtp never uses NVLink multicast; keep torch from creating multicast objects for our
# buffers (multicast can take a shared host's GPUs out of service). A user may still override.
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

_MIN_BYTES = 1 << 20


@dataclass
class SymmBuffer:
    """One rendezvoused symmetric allocation of `nbytes` bytes on every rank of a group."""

    tensor: torch.Tensor  # uint8, this rank's part
    handle: object  # torch's _SymmetricMemory handle
    nbytes: int

    def local(self, dtype: torch.dtype, shape, offset_bytes: int = 0) -> torch.Tensor:
        """A typed view of this rank's buffer."""
        return self.peer(self.handle.rank, dtype, shape, offset_bytes)

    def peer(self, rank: int, dtype: torch.dtype, shape, offset_bytes: int = 0) -> torch.Tensor:
        """A typed view of `rank`'s buffer (peer memory mapped into this GPU's address space)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if offset_bytes % itemsize or offset_bytes + numel * itemsize > self.nbytes:
            raise ValueError(f"view of {numel} x {dtype} at byte {offset_bytes} does not fit a {self.nbytes}-byte buffer")
        return self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // itemsize)


_buffers: dict[tuple[str, int, str], SymmBuffer] = {}
_op_workspaces: list[dict] = []  # each op's state over its buffers (op_workspaces)
_streams: dict[int, torch.cuda.Stream] = {}
_enabled_groups: set[str] = set()
_reasons: dict[str, str | None] = {}


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def unsupported_reason(info: GroupInfo) -> str | None:
    """None when the group's GPUs can share symmetric memory (same host, peer access)."""
    if info.name in _reasons:
        return _reasons[info.name]
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU is visible"
    elif backend_name(info) != "nccl":
        reason = f"the group's backend is {backend_name(info)!r}, not 'nccl'"
    elif torch.cuda.device_count() < info.world_size:
        reason = (
            f"the group has {info.world_size} ranks but this host shows {torch.cuda.device_count()} GPUs; "
            "symmetric memory needs all ranks on one host"
        )
    else:
        n = info.world_size
        blocked = [(a, b) for a in range(n) for b in range(n) if a != b and not torch.cuda.can_device_access_peer(a, b)]
        if blocked:
            reason = f"GPUs {blocked[0][0]} and {blocked[0][1]} cannot access each other's memory peer-to-peer"
        else:
            try:
                _symm_mem()
            except ImportError as e:
                reason = f"torch symmetric memory is unavailable ({e})"
    _reasons[info.name] = reason
    return reason


def enable_for_group(info: GroupInfo) -> None:
    """torch 2.11's async-TP ops still look for this per-group registration."""
    if info.name in _enabled_groups:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _symm_mem().enable_symm_mem_for_group(info.name)
    _enabled_groups.add(info.name)


def buffer(info: GroupInfo, tag: str, nbytes: int, device: torch.device) -> SymmBuffer:
    """This rank's symmetric buffer of at least `nbytes` bytes for (group, device, tag)."""
    key = (info.name, torch.device(device).index or 0, tag)
    buf = _buffers.get(key)
    if buf is not None and buf.nbytes >= nbytes:
        return buf
    if buf is not None:
        torch.cuda.synchronize(device)  # queued work may still read the old buffer
    size = max(_MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
    symm_mem = _symm_mem()
    enable_for_group(info)
    tensor = symm_mem.empty(size, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(tensor, info.name)
    buf = SymmBuffer(tensor, handle, size)
    _buffers[key] = buf
    _generation.bump()  # plans holding views of the old buffer (or none) are rebuilt
    return buf


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A high-priority side stream per device for copy-engine transfers and signals."""
    index = torch.device(device).index or 0
    stream = _streams.get(index)
    if stream is None:
        _, highest = torch.cuda.Stream.priority_range()
        stream = torch.cuda.Stream(device=index, priority=highest)
        _streams[index] = stream
    return stream


_current: dict[int, torch.cuda.Stream] = {}  # device index -> the Stream object last returned
_wait_events: dict[tuple[int, int, int], torch.cuda.Event] = {}  # (device, waiter, producer) -> event


def current_stream(index: int) -> torch.cuda.Stream:
    """torch.cuda.current_stream(index), its Stream object reused while the current stream stays
    the same: building one costs 5-7 us of host time on every call (H100 and H200 hosts)."""
    stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(index)
    stream = _current.get(index)
    if stream is None or stream.stream_id != stream_id:
        stream = _current[index] = torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                                                     device_type=device_type)  # fmt: skip
    return stream


def stream_wait(waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
    """waiter.wait_stream(producer) with an event kept per pair of streams: wait_stream makes a
    new event on every call (7 us against 3.3 us of host time on one H100 host). Reusing it is
    safe: a wait takes the event's state when it is queued."""
    key = (waiter.device_index, waiter.stream_id, producer.stream_id)
    event = _wait_events.get(key)
    if event is None:
        event = _wait_events[key] = torch.cuda.Event()
    event.record(producer)
    waiter.wait_event(event)


def stream_wait_at_least(flags: torch.Tensor, index: int, value: int) -> None:
    """Hold the current stream's later work until int32 flags[index] reaches `value`.

    The GPU's front end polls the word (no SM is used, so it can wait beside a persistent kernel
    that fills every SM); "reached" is (flags[index] - value) >= 0 in wrapping int32 arithmetic.
    There is no timeout: wait only for a word that work already queued on this GPU will write
    (a failing kernel fails the whole context, and the wait with it). Queue that work first,
    then the wait: streams may share a hardware queue, and work queued behind the wait waits too.
    """
    if flags.dtype != torch.int32 or not flags.is_cuda:
        raise TypeError(f"flags must be an int32 CUDA tensor, got {flags.dtype} on {flags.device}")
    stream = current_stream(flags.device.index or 0)
    _driver.stream_wait_value32(stream.cuda_stream, flags.data_ptr() + index * flags.element_size(), value)


def op_workspaces() -> dict:
    """A dict for an op's state kept over its symmetric buffers (views, flags, peer addresses),
    keyed by tuples that start with the group's name: free_workspaces drops a group's entries
    with its buffers."""
    workspaces: dict = {}
    _op_workspaces.append(workspaces)
    return workspaces


def free_workspaces(group_name: str | None = None) -> None:
    """Free the symmetric buffers of one group (or all) now: drop them, the ops' state over them
    and every cached call plan (plans hold views of them). Call on every rank, after a device
    sync, outside CUDA graph capture."""
    for cache in (_buffers, *_op_workspaces):
        for key in [k for k in cache if group_name is None or k[0] == group_name]:
            del cache[key]
    _generation.bump()
    if group_name is None:
        _reasons.clear()
    else:
        _reasons.pop(group_name, None)
