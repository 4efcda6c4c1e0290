"""fluxtp: tensor-parallel communication hidden behind the GEMMs that depend on it.

    y = fluxtp.all_gather_matmul(x_shard, w_shard, group=tp_group)        # column-parallel
    out = fluxtp.matmul_reduce_scatter(x, w_shard, group=tp_group)        # row-parallel (SP)
    out = fluxtp.matmul_all_reduce(x, w_shard, group=tp_group)            # row-parallel (decode)
    total = fluxtp.all_reduce(t, group=tp_group)                          # a sum, no GEMM
    y = fluxtp.all_gather_scaled_matmul(x_fp8, w_fp8, scale_x, scale_w)   # FP8 (docs/fp8.md)
    out = fluxtp.scaled_matmul_reduce_scatter(x_fp8, w_fp8, scale_x, scale_w)
"""

from fluxtp.ops import (
    BACKENDS,
    OPS,
    SCALED_OPS,
    all_gather_matmul,
    all_gather_scaled_matmul,
    all_reduce,
    matmul_all_reduce,
    matmul_reduce_scatter,
    scaled_matmul_reduce_scatter,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "OPS", "SCALED_OPS", "__version__", "all_gather_matmul", "all_gather_scaled_matmul", "all_reduce",
    "matmul_all_reduce", "matmul_reduce_scatter", "scaled_matmul_reduce_scatter",
]  # fmt: skip
