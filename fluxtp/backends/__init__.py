"""Backend registry: which implementation computes an op, and why one cannot.

A backend is a module with one function per op it implements (same name as the op) and
`unsupported_reason(op, x, weight, info) -> str | None`; it may add
`preferred(op, x, weight, info) -> bool`, which "auto" asks before taking it (where it is
measured slower than the next backend, it says no), and `plan(op, x, weight, bias, info,
*options) -> callable(x, weight, bias)`, what it resolves once per call signature (see
`prepare`). Every backend computes the same function as `reference` (the "nccl" backend).

The scaled (FP8) ops (SCALED_OPS) also pass `details` to both checks (row_wise, out_dtype,
use_fast_accum: what a backend may not run), and their calls carry the two scales:
callable(x, weight, scale_x, scale_w, bias).
"""

from __future__ import annotations

import functools
import importlib

from fluxtp._dist import GroupInfo

_MODULES = {
    "nccl": "fluxtp.backends.reference",
    "torch": "fluxtp.backends.torch_symm",
    "fused": "fluxtp.backends.fused",
}
# "auto" tries these in order and takes the first that can run the call.
AUTO_ORDER = ("fused", "nccl")
SCALED_OPS = ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter")


@functools.cache  # import_module costs ~2 us even for a loaded module, and "auto" asks 4 times a call
def _module(backend: str):
    return importlib.import_module(_MODULES[backend])  # an ImportError is not cached: asked again next time


def unsupported_reason(op: str, backend: str, x, weight, info: GroupInfo, **details) -> str | None:
    """None when `backend` can run `op` on these inputs, else a sentence saying why not."""
    try:
        module = _module(backend)
    except ImportError as e:  # e.g. triton missing
        return f"backend {backend!r} cannot be imported here ({e})"
    check = getattr(module, "unsupported_reason", None)
    reason = None if check is None else check(op, x, weight, info, **details)
    if reason is None and not hasattr(module, op):
        reason = f"backend {backend!r} does not implement {op} yet"
    return reason


def choose(op: str, backend: str, x, weight, info: GroupInfo, **details) -> str:
    """Resolve "auto" and check that an explicitly named backend can run this call."""
    if backend == "auto":
        for name in AUTO_ORDER:
            if unsupported_reason(op, name, x, weight, info, **details) is None:
                preferred = getattr(_module(name), "preferred", None)
                if preferred is None or preferred(op, x, weight, info, **details):
                    return name
        raise RuntimeError(f"no backend can run {op} here")  # unreachable: the reference runs anywhere
    reason = unsupported_reason(op, backend, x, weight, info, **details)
    if reason is not None:
        raise ValueError(f"{op}(backend={backend!r}) cannot run here: {reason}")
    return backend


def implementation(op: str, backend: str):
    return getattr(_module(backend), op)


def prepare(op: str, backend: str, x, weight, bias, info: GroupInfo, *options):
    """`backend`'s implementation of `op` for calls of this signature, as a callable
    (x, weight, bias) -> what the implementation returns (all_reduce ignores weight and bias;
    options: all_gather_matmul's return_gathered). The backend's `plan` resolves what it can
    once, where it has one; else the implementation is called as it is."""
    module = _module(backend)
    planner = getattr(module, "plan", None)
    if planner is not None:
        return planner(op, x, weight, bias, info, *options)
    impl = getattr(module, op)
    if op in SCALED_OPS:
        return lambda x, weight, scale_x, scale_w, bias: impl(x, weight, scale_x, scale_w, bias, info, *options)
    if op == "all_reduce":
        return lambda x, weight, bias: impl(x, info)
    return lambda x, weight, bias: impl(x, weight, bias, info, *options)
