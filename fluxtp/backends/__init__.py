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

A backend may also implement the plain collectives that fluxtp.nn and fluxtp.inference issue
beside the ops (COLLECTIVES; `collective`); where it has none, the reference's run.

Beside the built-in backends, `register(name, module)` adds one under a name of its own (the
benchmarks' stand-ins, fluxtp/bench/__init__.py): from then on backend=name selects it wherever
a backend is taken. "auto" never picks a registered backend.
"""

from __future__ import annotations

import functools
import importlib
import types

from fluxtp._dist import GroupInfo

# Backend name -> the import path of a built-in module, or a registered module itself.
_MODULES: dict[str, str | types.ModuleType] = {
    "nccl": "fluxtp.backends.reference",
    "torch": "fluxtp.backends.torch_symm",
    "fused": "fluxtp.backends.fused",
}
BUILT_IN = tuple(_MODULES)
# "auto" tries these in order and takes the first that can run the call.
AUTO_ORDER = ("fused", "nccl")
SCALED_OPS = ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter")
# The plain collectives beside the ops (the reference's signatures):
#   gather_rows(x_shard [m, *], info) -> [m*W, *], rank r's rows at r*m
#   all_reduce_sum(t, info, async_op=False): t summed over the group in place; with async_op,
#       the work handle to wait on (or None when there is nothing to wait for)
COLLECTIVES = ("gather_rows", "all_reduce_sum")


@functools.cache  # import_module costs ~2 us even for a loaded module, and "auto" asks 4 times a call
def _module(backend: str):
    where = _MODULES[backend]  # a name registered later is not cached as missing: KeyError is not cached
    return importlib.import_module(where) if isinstance(where, str) else where  # nor an ImportError


def register(name: str, module: types.ModuleType | str) -> None:
    """Make `module` (a module, or its import path) the backend `name`: from then on backend=name
    selects it in the ops, fluxtp.nn's layers and fluxtp.inference's models, in this process.

    The module follows this file's contract: `unsupported_reason`, one function per op it
    implements, optionally `preferred`, `plan` and the COLLECTIVES. Registering the same module
    under the same name again does nothing.

    Raises TypeError when `name` is not a string or the module has no callable
    unsupported_reason; ValueError when `name` is empty, "auto", a built-in backend's, or taken
    by another module; ImportError when the path does not import.
    """
    if not isinstance(name, str):
        raise TypeError(f"a backend name must be a str, got {type(name).__name__}")
    if not name or name == "auto" or name in BUILT_IN:
        reserved = ", ".join(map(repr, ("auto", *BUILT_IN)))
        raise ValueError(f"cannot register a backend as {name!r}: a backend needs a name other than {reserved} and ''")
    if isinstance(module, str):
        module = importlib.import_module(module)
    if not isinstance(module, types.ModuleType):
        raise TypeError(f"backend {name!r} must be a module or its import path, got {type(module).__name__}")
    if not callable(getattr(module, "unsupported_reason", None)):
        raise TypeError(
            f"backend {name!r}: module {module.__name__} has no unsupported_reason(op, x, weight, info, **details) "
            "function, which every backend needs (fluxtp.backends)"
        )
    taken = _MODULES.get(name)
    if taken is not None and taken is not module:
        raise ValueError(f"backend {name!r} is already registered as module {taken.__name__}")
    _MODULES[name] = module


def registered() -> tuple[str, ...]:
    """The names of the backends `register` added, in the order they were added."""
    return tuple(name for name in _MODULES if name not in BUILT_IN)


def collective(name: str, backend: str):
    """The plain collective `name` (COLLECTIVES) as `backend` runs it: its own where it has one,
    else the reference's (torch.distributed), which every built-in backend and "auto" use."""
    own = None if backend == "auto" else getattr(_module(backend), name, None)
    return own if own is not None else getattr(_module("nccl"), name)


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
