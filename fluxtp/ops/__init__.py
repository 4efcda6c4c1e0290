"""The public ops (one file each): validate, pick a backend, call it (straight to the call's
cached plan in plain eager code, else through the op's torch.library custom op, which
torch.compile, tracing and autograd see: fluxtp.ops._dispatch; its backward: fluxtp.ops._autograd)."""

from fluxtp.ops._validate import BACKENDS
from fluxtp.ops.all_reduce import all_reduce
from fluxtp.ops.all_gather_matmul import all_gather_matmul
from fluxtp.ops.matmul_all_reduce import matmul_all_reduce
from fluxtp.ops.matmul_reduce_scatter import matmul_reduce_scatter
from fluxtp.ops import _autograd  # noqa: F401, E402 -- registers the backward formulas

# The GEMM ops (x, weight): what the benchmark and tuner iterate over; all_reduce has no GEMM.
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

__all__ = ["BACKENDS", "OPS", "all_gather_matmul", "all_reduce", "matmul_all_reduce", "matmul_reduce_scatter"]
