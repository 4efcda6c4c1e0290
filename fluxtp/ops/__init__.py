"""The public ops (one file each): validate, pick a backend, call it (straight to the call's
cached plan in plain eager code, else through the op's torch.library custom op, which
torch.compile, tracing and autograd see: fluxtp.ops._dispatch; its backward: fluxtp.ops._autograd)."""

from fluxtp.ops._validate import BACKENDS
from fluxtp.ops.all_reduce import all_reduce
from fluxtp.ops.all_gather_matmul import all_gather_matmul
from fluxtp.ops.all_gather_scaled_matmul import all_gather_scaled_matmul
from fluxtp.ops.matmul_all_reduce import matmul_all_reduce
from fluxtp.ops.matmul_reduce_scatter import matmul_reduce_scatter
from fluxtp.ops.scaled_matmul_reduce_scatter import scaled_matmul_reduce_scatter
from fluxtp.ops import _autograd  # noqa: F401, E402 -- registers the backward formulas

# The GEMM ops (x, weight): what the benchmark and tuner iterate over; all_reduce has no GEMM.
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

# The FP8 ops (x, weight, scale_x, scale_w): torch._scaled_mm's scaling, fluxtp.fp8.
SCALED_OPS = ("all_gather_scaled_matmul", "scaled_matmul_reduce_scatter")

__all__ = [
    "BACKENDS", "OPS", "SCALED_OPS", "all_gather_matmul", "all_gather_scaled_matmul", "all_reduce", "matmul_all_reduce",
    "matmul_reduce_scatter", "scaled_matmul_reduce_scatter",
]  # fmt: skip
