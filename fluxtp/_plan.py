"""Call plans: what a call resolves once per call signature and reuses (fluxtp.ops and the fused
launchers; DESIGN.md: an eager call should cost about a cuBLAS call plus a few stream operations).

A signature holds every property of a call's tensors that a plan may depend on (type, dtype,
device, shape, strides, 16-byte alignment) beside the op's other arguments; a plan never holds
the call's tensors themselves (the caching allocator must be free to reuse their memory), nor
anything that refers back to it (a plan is freed the moment its cache drops it, not when Python's
collector finds a cycle). A plan is valid until fluxtp._generation.bump() drops it.
"""

from __future__ import annotations

import atexit

from fluxtp import _generation


@atexit.register
def _clear_all() -> None:
    """Drop every plan before the interpreter shuts down: plans hold process groups, and a gloo
    group first released during interpreter teardown aborted the process at exit
    ("terminate called without an active exception", after torch's destroy_process_group)."""
    for cache in list(_generation.caches):
        cache.clear()


def tensor_key(t) -> tuple:
    """What of one tensor a plan may depend on (None stays None)."""
    if t is None:
        return None
    return (type(t), t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16)


class PlanCache:
    """signature -> plan; _generation.bump() empties every cache at once (plans are valid while
    nothing they resolved changes)."""

    def __init__(self, max_size: int = 1024):
        self._plans: dict = {}
        self._max_size = max_size
        _generation.caches.add(self)

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan):
        """Keep `plan` for `key`; returns it."""
        if len(self._plans) >= self._max_size:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
