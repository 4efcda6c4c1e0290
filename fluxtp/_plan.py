"""Call plans: what a call resolves once per call signature and reuses (fluxtp.ops and the fused
launchers; DESIGN.md: an eager call should cost about a cuBLAS call plus a few stream operations).

A signature holds every property of a call's tensors that a plan may depend on (type, dtype,
device, shape, strides, 16-byte alignment) beside the op's other arguments; a plan never holds
the call's tensors themselves (the caching allocator must be free to reuse their memory). A plan
is valid while fluxtp._generation has the value it was built under.
"""

from __future__ import annotations

import atexit
import weakref

from fluxtp import _generation

_caches: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _clear_all() -> None:
    """Drop every plan before the interpreter shuts down: plans hold process groups, and a gloo
    group first released during interpreter teardown aborted the process at exit
    ("terminate called without an active exception", after torch's destroy_process_group)."""
    for cache in list(_caches):
        cache.clear()


def tensor_key(t) -> tuple:
    """What of one tensor a plan may depend on (None stays None)."""
    if t is None:
        return None
    return (type(t), t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16)


class PlanCache:
    """signature -> plan, each valid while the generation it was built under lasts."""

    def __init__(self, max_size: int = 1024):
        self._plans: dict = {}
        self._max_size = max_size
        self._generation = _generation.value
        _caches.add(self)

    def get(self, key):
        entry = self._plans.get(key)
        if entry is not None and entry[0] == _generation.value:
            return entry[1]
        return None

    def put(self, key, plan):
        """Keep `plan` for `key` (built under the current generation); returns it."""
        if len(self._plans) >= self._max_size or self._generation != _generation.value:
            self._plans.clear()  # stale plans go at once: they may hold groups and buffers
            self._generation = _generation.value
        self._plans[key] = (_generation.value, plan)
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
