"""The "fused" backend: Flux-style persistent Triton GEMMs that wait for, or send, each tile's
data themselves. One launcher module per op beside this one (ag_gemm: AllGather+GEMM,
gemm_rs: GEMM+ReduceScatter, gemm_ar: GEMM+AllReduce and AllReduce); they import triton, so they are imported on first use, not when
the backend is only considered."""

from __future__ import annotations

import importlib

import torch

from fluxtp import symm
from fluxtp._dist import GroupInfo
from fluxtp.configs import measured_verdict

FUSED_DTYPES = (torch.float16, torch.bfloat16)

# "auto" takes a fused kernel only where it measured faster than NCCL-then-cuBLAS on H200s,
# from a number of global tokens on: one for TP=2, one for TP >= 4. All-gather at TP=2 from 4096
# (1.01-1.06x at both model dims: ops-h200-x2-2026-11-22-*.json); at TP=4 from 8192 (4096 read
# 0.98x, 8192 1.20x: ops-h200-x4-2026-11-22-*.json). Reduce-scatter at TP=2 from 2048 with the
# copy-engine transport (1.02-1.17x at every measured shape of LLaMA-70B, GPT-3, Qwen2-72B and
# Mixtral dims from 2048 tokens; 1024 read 0.97-1.04x:
# ops-h200-x2-2026-11-22-matmul_reduce_scatter-copy-engine.json,
# tune-h200-x2-2026-11-22-matmul_reduce_scatter-transport.json); at TP=4 from 8192 (measured
# with the older SM push: 4096 read 0.99x, 8192 1.05x). Below: host launch cost and GEMM
# efficiency lose to NCCL. GEMM+AllReduce: the one-shot decode kernel up to 128 rows (1.16-1.29x over
# cuBLAS + NCCL under CUDA graphs at N 8192, k 14336, M 1-128); prefill sizes lost (0.64-0.997x,
# M 512-8192: ops-h200-x2-2026-11-22-matmul_all_reduce-*.json). AllReduce: up to 8 MB (16 KB:
# 8.9 vs 12.5 us, 1 MB: 11.8 vs 20.0, 8 MB: 50.6 vs 55.1; 16 MB lost, 106 vs 88:
# all_reduce-h200-x2-2026-11-22.json).
AUTO_MIN_TOKENS = {"all_gather_matmul": (4096, 8192), "matmul_reduce_scatter": (2048, 8192)}  # (TP=2, TP>=4)
# ... and an all-gather GEMM of at least 2^25 output elements per rank (tokens x N/W): at 4096
# tokens and N/W = 4096 (the q projection, the o projection's backward at LLaMA-70B dims) the
# fused op lost, 0.73x (host cost and the two barriers per call, docs/perf-log.md); from
# 8192 x 4096 and 4096 x 14336 on it won, 1.03-1.13x, except 8192 x 14336 with the backward's
# transposed weight view, 0.94x (ops-h200-x2-2026-11-22-all_gather_matmul-train-*.json).
AUTO_MIN_OUTPUTS = {"all_gather_matmul": 1 << 25}
# Under CUDA graphs the fused ops win from fewer tokens (ops-h200-x{2,4}-2026-11-22-*-graphs.json:
# from 1024-2048 tokens at TP=2, 4096 at TP=4), but "auto" keeps these thresholds while capturing
# too: a warm-up with "auto" runs such a call through nccl, so a capture that picked fused would
# make the fused op's first call (symmetric-memory allocation and rendezvous, Triton compile)
# inside the capture. To get the graph speedups, pass backend="fused" and warm up before capture.
# Over all of these, a tuned entry measured at the call's exact key decides where it is clear
# (tune.measured_verdict): at 2x H200 that takes fused for the all-gather at 2048 tokens
# (LLaMA-70B dims, 1.06x), for the o projection's backward at 4096 (1.21x) and at Mixtral dims
# (4096 tokens 1.13x; reduce-scatter 1024 tokens 1.07x) (fluxtp/configs/default.json).
AUTO_MAX_ROWS = {"matmul_all_reduce": 128}
AUTO_MAX_BYTES = {"all_reduce": 8 << 20}


def unsupported_reason(op: str, x, weight, info: GroupInfo) -> str | None:
    if x.device.type != "cuda":
        return f"it needs CUDA tensors (got {x.device})"
    if x.dtype not in FUSED_DTYPES:
        return f"it supports float16 and bfloat16, got {x.dtype}"
    if weight is not None and x.shape[1] % 8:
        return f"K={x.shape[1]} must be a multiple of 8 (16-byte rows for the TMA descriptors)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return symm.unsupported_reason(info)


def preferred(op: str, x, weight, info: GroupInfo) -> bool:
    """Whether "auto" should take the fused kernel for this call: where the tuned config it would
    launch was measured for exactly this shape, that measurement decides when it is clear
    (tune.measured_verdict: at least 5% faster than NCCL, or slower); elsewhere the thresholds
    above, measured on the DESIGN.md shapes."""
    if op == "all_reduce":
        return x.numel() * x.element_size() <= AUTO_MAX_BYTES[op]
    if op == "matmul_all_reduce":
        return x.shape[0] <= AUTO_MAX_ROWS[op]
    verdict = measured_verdict(op, x, weight, info.world_size)
    if verdict is not None:
        return verdict
    tokens = x.shape[0] * info.world_size if op == "all_gather_matmul" else x.shape[0]
    two, more = AUTO_MIN_TOKENS[op]
    return tokens >= (two if info.world_size <= 2 else more) and tokens * weight.shape[0] >= AUTO_MIN_OUTPUTS.get(op, 0)


def plan(op: str, x, weight, bias, info: GroupInfo, *options):
    """The launcher's plan for this call signature, a callable (x, weight, bias) (backends.prepare)."""
    if op == "all_gather_matmul":
        from fluxtp.backends.fused import ag_gemm

        return ag_gemm.plan(x, weight, bias, info, *options)
    if op == "matmul_reduce_scatter":
        from fluxtp.backends.fused import gemm_rs

        return gemm_rs.plan(x, weight, bias, info)
    from fluxtp.backends.fused import gemm_ar

    if op == "all_reduce":
        sum_plan = gemm_ar.plan(x, None, None, info)
        return lambda x, weight, bias: sum_plan(x)
    return gemm_ar.plan(x, weight, bias, info)


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    from fluxtp.backends.fused import ag_gemm

    return ag_gemm.all_gather_matmul(x_shard, weight, bias, info, return_gathered)


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    from fluxtp.backends.fused import gemm_rs

    return gemm_rs.matmul_reduce_scatter(x, weight, bias, info)


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    from fluxtp.backends.fused import gemm_ar

    return gemm_ar.matmul_all_reduce(x, weight, bias, info)


def all_reduce(x, info: GroupInfo):
    from fluxtp.backends.fused import gemm_ar

    return gemm_ar.all_reduce(x, info)


_GEMM_ONLY_MODULES = {"all_gather_matmul": "ag_gemm", "matmul_reduce_scatter": "gemm_rs"}


def gemm_only(op: str, x, weight, bias, info: GroupInfo):
    """A zero-argument callable running op's fused kernel with communication switched off."""
    if op not in _GEMM_ONLY_MODULES:
        raise ValueError(f"the fused backend has no GEMM-only mode for {op}")
    module = importlib.import_module(f"fluxtp.backends.fused.{_GEMM_ONLY_MODULES[op]}")
    return module.gemm_only(x, weight, bias, info)
