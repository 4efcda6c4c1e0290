"""The public ops (one file each): validate, pick a backend, call it (through the op's
torch.library custom op wherever torch.compile, tracing or autograd could see the call)."""

from fluxtp.ops._validate import BACKENDS
from fluxtp.ops.all_reduce import all_reduce
from fluxtp.ops.all_gather_matmul import all_gather_matmul
from fluxtp.ops.matmul_all_reduce import matmul_all_reduce
from fluxtp.ops.matmul_reduce_scatter import matmul_reduce_scatter

# The GEMM ops (x, weight): what the benchmark and tuner iterate over; all_reduce has no GEMM.
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

__all__ = ["BACKENDS", "OPS", "all_gather_matmul", "all_reduce", "matmul_all_reduce", "matmul_reduce_scatter"]
