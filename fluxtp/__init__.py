"""fluxtp: tensor-parallel communication hidden behind the GEMMs that depend on it.

    y = fluxtp.all_gather_matmul(x_shard, w_shard, group=tp_group)        # column-parallel
    out = fluxtp.matmul_reduce_scatter(x, w_shard, group=tp_group)        # row-parallel (SP)
    out = fluxtp.matmul_all_reduce(x, w_shard, group=tp_group)            # row-parallel (decode)
    total = fluxtp.all_reduce(t, group=tp_group)                          # a sum, no GEMM
"""

from fluxtp.ops import BACKENDS, OPS, all_gather_matmul, all_reduce, matmul_all_reduce, matmul_reduce_scatter

__version__ = "0.1.0"

__all__ = ["BACKENDS", "OPS", "__version__", "all_gather_matmul", "all_reduce", "matmul_all_reduce", "matmul_reduce_scatter"]
