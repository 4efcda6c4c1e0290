"""Tensor + sequence-parallel modules built on the fused ops (see fluxtp.nn.linear for the layout).

    ColumnParallelLinear, RowParallelLinear   the two linears, with overlapped backward
    column_parallel_linears(x, [q, k, v])     column linears of one input: one all-gather
    parallelize(model, group)                 TP + SP for a LLaMA-style transformers decoder
    set_backend(model, backend)               switch what all of a model's communication runs through
    scatter_tokens, gather_tokens             enter / leave the sequence-parallel region
    sum_grads_over_group                      replicated parameters used on row shards
    ColwiseParallel, RowwiseParallel          DTensor parallel styles running the fused ops
                                              (drop-ins for torch's, see fluxtp.nn.styles)
"""

from fluxtp.nn.decoder import TensorParallelPlan, default_plan, parallelize, set_backend
from fluxtp.nn.linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from fluxtp.nn.sequence import gather_tokens, scatter_tokens, sum_grads_over_group
from fluxtp.nn.styles import ColwiseParallel, RowwiseParallel, tp_submesh

__all__ = [
    "ColumnParallelLinear",
    "ColwiseParallel",
    "RowParallelLinear",
    "RowwiseParallel",
    "TensorParallelPlan",
    "column_parallel_linears",
    "default_plan",
    "gather_tokens",
    "parallelize",
    "scatter_tokens",
    "set_backend",
    "sum_grads_over_group",
    "tp_submesh",
]
