"""The "fused" backend: Flux-style persistent Triton GEMMs that wait for, or send, each tile's
data themselves. One launcher module per op beside this one, named as the op with a leading
underscore (_matmul_all_reduce also runs all_reduce), as its kernel in fluxtp.kernels is; they
import triton, so they are imported on first use, not when the backend is only considered."""

from __future__ import annotations

import importlib

import torch

from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp.configs import all_reduce_one_shot_max_bytes, by_ranks, measured_verdict

FUSED_DTYPES = (torch.float16, torch.bfloat16)

# "auto" takes a fused kernel only where it measured faster than NCCL-then-cuBLAS: from a number
# of global tokens on; below, host cost and GEMM efficiency lose to NCCL.
# "auto" keeps these thresholds while capturing a CUDA graph (where the bf16 fused ops won from
# the same tokens, 4x and 2x H200): a capture that picked fused after an nccl warm-up would run the
# fused op's first call (allocation, rendezvous, compile) inside the capture; for fewer tokens
# pass backend="fused" and warm up before capture instead. A tuned entry measured at the call's
# exact key decides over them where it is clear (configs.measured_verdict). The measurements:
# docs/perf-log.md, "Where the auto thresholds come from".
# {ranks: least global tokens}, read by by_ranks. At TP 2 and 4 (2x and 4x H200) the reduce-scatter
# won or was level from 512 tokens, eagerly and under CUDA graphs, and lost under graphs at 256
# (TP=2 at one weight, TP=4 at both measured); TP=8 is unmeasured and keeps 1024. The FP8
# all-gather won at 256 and 512 at TP=2 eagerly (graphs unmeasured: the floor the larger).
AUTO_MIN_TOKENS = {
    "matmul_reduce_scatter": {2: 512, 4: 512, 8: 1024},
    "all_gather_scaled_matmul": {2: 512, 8: 1024},
}
# The bf16 / fp16 all-gather alone, by TP degree (2, up to 4, more): (least global tokens, least
# output elements a rank, least tokens where a rank's weight has more than AUTO_WIDE_COLUMNS
# columns). TP 2 and 4 won at every size measured from 1024 tokens x 1024 columns a rank (H200;
# H100 at TP=4) but for wide weights at TP=4 and 1024 tokens (H100 0.95-0.98x, GPT-3 / LLaMA-405B);
# at 512 tokens TP=2 lost at LLaMA-70B's q/k/v (0.91x under CUDA graphs and in one of two eager
# runs, 2x H200). More ranks were never measured and keep the thresholds of before the call plans.
AUTO_ALL_GATHER = {2: (1024, 1 << 20, 1024), 4: (1024, 1 << 20, 2048), 8: (8192, 1 << 25, 8192)}
AUTO_WIDE_COLUMNS = 8192
# An all-gather whose caller keeps the gathered rows is a training layer's (fluxtp.nn keeps them for
# the weight gradient): the bf16 and FP8 training steps at TP 2 and 4 gained with those fused from
# this many global tokens on and lost below, whatever the op alone measured (docs/perf-log.md,
# "Which all-gathers the training step fuses").
AUTO_MIN_TOKENS_KEEPING_ROWS = 4096
# GEMM+AllReduce: "auto" takes the one-shot kernel up to 128 rows and up to this many output bytes
# at up to this many ranks (the kernel pushes its whole output to every peer). Under CUDA graphs on
# H200s at TP 2 and 4 it won up to 128 rows of 16384 columns (4 MB; docs/perf-log.md, "GEMM+AllReduce
# at wider outputs"). Larger outputs and more ranks are not measured; more ranks get a quarter, as
# for the all-reduce alone (fluxtp.configs.ALL_REDUCE_ONE_SHOT_MAX_BYTES, which the fused path
# and "auto" share).
AUTO_MAX_ROWS = {"matmul_all_reduce": 128}
MATMUL_ALL_REDUCE_AUTO_MAX_BYTES = {2: 4 << 20, 4: 4 << 20, 8: 1 << 20}


# The scaled ops run the same kernels with FP8 operands (their FP8 constexprs on): e4m3 both.
FUSED_FP8_DTYPES = (torch.float8_e4m3fn,)
_UNSCALED = {"all_gather_scaled_matmul": "all_gather_matmul", "scaled_matmul_reduce_scatter": "matmul_reduce_scatter"}


def unsupported_reason(op: str, x, weight, info: GroupInfo, **details) -> str | None:
    if x.device.type != "cuda":
        return f"it needs CUDA tensors (got {x.device})"
    if op in _UNSCALED:
        if x.dtype not in FUSED_FP8_DTYPES or weight.dtype not in FUSED_FP8_DTYPES:
            return f"its FP8 kernels take float8_e4m3fn operands, got {x.dtype} and {weight.dtype}"
        if x.shape[1] % 16:
            return f"K={x.shape[1]} must be a multiple of 16 (16-byte FP8 rows for the TMA descriptors)"
    elif x.dtype not in FUSED_DTYPES:
        return f"it supports float16 and bfloat16, got {x.dtype}"
    elif weight is not None and x.shape[1] % 8:
        return f"K={x.shape[1]} must be a multiple of 8 (16-byte rows for the TMA descriptors)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return symm.unsupported_reason(info)


def preferred(op: str, x, weight, info: GroupInfo, **details) -> bool:
    """Whether "auto" should take the fused kernel for this call: where the tuned config it would
    launch was measured for exactly this shape, that measurement decides when it is clear
    (tune.measured_verdict: at least 5% faster than NCCL, or slower); elsewhere the thresholds
    above, measured on the DESIGN.md shapes."""
    if op == "all_reduce":
        return x.numel() * x.element_size() <= all_reduce_one_shot_max_bytes(info.world_size)
    if op == "matmul_all_reduce":
        out_bytes = x.shape[0] * weight.shape[0] * x.element_size()
        return x.shape[0] <= AUTO_MAX_ROWS[op] and out_bytes <= by_ranks(MATMUL_ALL_REDUCE_AUTO_MAX_BYTES, info.world_size)
    tokens = x.shape[0] * info.world_size if op in ("all_gather_matmul", "all_gather_scaled_matmul") else x.shape[0]
    if details.get("return_gathered"):
        return tokens >= AUTO_MIN_TOKENS_KEEPING_ROWS
    if op not in _UNSCALED:  # the scaled ops' rules come from whole-op and training runs only
        verdict = measured_verdict(op, x, weight, info.world_size)
        if verdict is not None:
            return verdict
    return preferred_by_thresholds(op, tokens, weight.shape[0], info.world_size)


def preferred_by_thresholds(op: str, tokens: int, columns: int, world: int) -> bool:
    """What "auto" answers without a clear measurement of the call (preferred): for a call alone
    (nothing kept) of `tokens` global tokens and `columns` output columns a rank, in a group of
    `world` ranks; also what `fluxtp info --configs` reports for a shape."""
    if op == "scaled_matmul_reduce_scatter":
        # The FP8 training step (fluxtp.nn's recipe, LLaMA-70B, TP 2 and 4, H100s) gained with every
        # reduce-scatter fused, of either accumulation (docs/fp8.md). More ranks are taken as TP=4.
        return True
    if op == "all_gather_scaled_matmul":
        # Alone it ran fused 1.02-2.5x faster than NCCL then torch._scaled_mm at 1024-16384 tokens,
        # TP 2 and 4, either scaling and accumulation, and at TP=2 from 512 (docs/fp8.md).
        return tokens >= _least_tokens(op, world)
    if op == "all_gather_matmul":
        return _all_gather_fuses(tokens, columns, world)
    return tokens >= _least_tokens(op, world)


def _least_tokens(op: str, world: int) -> int:
    return by_ranks(AUTO_MIN_TOKENS[op], world)


def _all_gather_fuses(tokens: int, columns: int, world: int) -> bool:
    """AUTO_ALL_GATHER's verdict for an all-gather alone; `columns`: a rank's output columns (its
    weight's rows)."""
    least_tokens, least_outputs, least_tokens_wide = by_ranks(AUTO_ALL_GATHER, world)
    if columns > AUTO_WIDE_COLUMNS:
        least_tokens = max(least_tokens, least_tokens_wide)
    return tokens >= least_tokens and tokens * columns >= least_outputs


def plan(op: str, x, weight, bias, info: GroupInfo, *options):
    """The launcher's plan for this call signature, a callable (x, weight, bias) (backends.prepare)."""
    if op == "all_gather_matmul":
        from fluxtp.backends.fused import _all_gather_matmul

        return _all_gather_matmul.plan(x, weight, bias, info, *options)
    if op == "matmul_reduce_scatter":
        from fluxtp.backends.fused import _matmul_reduce_scatter

        return _matmul_reduce_scatter.plan(x, weight, bias, info)
    if op == "all_gather_scaled_matmul":
        from fluxtp.backends.fused import _all_gather_matmul

        return _all_gather_matmul.scaled_plan(x, weight, bias, info, *options)
    if op == "scaled_matmul_reduce_scatter":
        from fluxtp.backends.fused import _matmul_reduce_scatter

        return _matmul_reduce_scatter.scaled_plan(x, weight, bias, info, *options)
    from fluxtp.backends.fused import _matmul_all_reduce

    if op == "all_reduce":
        sum_plan = _matmul_all_reduce.plan(x, None, None, info)
        return lambda x, weight, bias: sum_plan(x)
    return _matmul_all_reduce.plan(x, weight, bias, info)


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    from fluxtp.backends.fused import _all_gather_matmul

    return _all_gather_matmul.all_gather_matmul(x_shard, weight, bias, info, return_gathered)


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    from fluxtp.backends.fused import _matmul_reduce_scatter

    return _matmul_reduce_scatter.matmul_reduce_scatter(x, weight, bias, info)


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    from fluxtp.backends.fused import _matmul_all_reduce

    return _matmul_all_reduce.matmul_all_reduce(x, weight, bias, info)


def all_reduce(x, info: GroupInfo):
    from fluxtp.backends.fused import _matmul_all_reduce

    return _matmul_all_reduce.all_reduce(x, info)


def all_gather_scaled_matmul(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum,
                             return_gathered: bool):  # fmt: skip
    from fluxtp.backends.fused import _all_gather_matmul

    run = _all_gather_matmul.scaled_plan(x_shard, weight, bias, info, out_dtype, use_fast_accum, return_gathered)
    return run(x_shard, weight, scale_x, scale_w, bias)


def scaled_matmul_reduce_scatter(x, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum):
    from fluxtp.backends.fused import _matmul_reduce_scatter

    run = _matmul_reduce_scatter.scaled_plan(x, weight, bias, info, out_dtype, use_fast_accum)
    return run(x, weight, scale_x, scale_w, bias)


_GEMM_ONLY_OPS = ("all_gather_matmul", "matmul_reduce_scatter", *_UNSCALED)


def gemm_only(op: str, x, weight, bias, info: GroupInfo, scales=None, out_dtype=torch.bfloat16,
              use_fast_accum: bool = False):  # fmt: skip
    """A zero-argument callable running op's fused kernel with communication switched off; a
    scaled op's takes scales=(scale_x, scale_w), out_dtype and use_fast_accum as the op does."""
    if op not in _GEMM_ONLY_OPS:
        raise ValueError(f"the fused backend has no GEMM-only mode for {op}")
    if (op in _UNSCALED) != (scales is not None):
        raise ValueError(f"{op}'s GEMM-only mode takes scales exactly when the op is scaled")
    module = importlib.import_module(f"fluxtp.backends.fused._{_UNSCALED.get(op, op)}")
    return module.gemm_only(x, weight, bias, info, scales=scales, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
