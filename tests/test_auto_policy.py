"""The "auto" policy: the fused kernels only from the token counts where they measured faster."""

import torch

from fluxtp._dist import GroupInfo
from fluxtp.backends import fused

TWO = GroupInfo(None, 0, 2)


def test_all_gather_matmul_counts_gathered_tokens():
    w = torch.empty(14336, 64, device="meta")  # LLaMA-70B gate projection per rank at TP=2
    threshold = fused.AUTO_MIN_TOKENS["all_gather_matmul"]
    assert not fused.preferred("all_gather_matmul", torch.empty(threshold // 2 - 1, 64, device="meta"), w, TWO)
    assert fused.preferred("all_gather_matmul", torch.empty(threshold // 2, 64, device="meta"), w, TWO)


def test_all_gather_matmul_needs_enough_output_per_rank():
    """At 4096 tokens the narrow q projection (N/W = 4096) lost; 8192 tokens of it won."""
    q = torch.empty(4096, 64, device="meta")
    assert not fused.preferred("all_gather_matmul", torch.empty(2048, 64, device="meta"), q, TWO)
    assert fused.preferred("all_gather_matmul", torch.empty(4096, 64, device="meta"), q, TWO)


def test_matmul_reduce_scatter_counts_rows():
    w = torch.empty(8, 64)
    threshold = fused.AUTO_MIN_TOKENS["matmul_reduce_scatter"]
    assert not fused.preferred("matmul_reduce_scatter", torch.empty(threshold - 2, 64), w, TWO)
    assert fused.preferred("matmul_reduce_scatter", torch.empty(threshold, 64), w, TWO)


def test_matmul_reduce_scatter_not_past_measured_widths():
    rows = fused.AUTO_MIN_TOKENS["matmul_reduce_scatter"]
    widest = fused.AUTO_MAX_N["matmul_reduce_scatter"]
    assert fused.preferred("matmul_reduce_scatter", torch.empty(rows, 64), torch.empty(widest, 64), TWO)
    assert not fused.preferred("matmul_reduce_scatter", torch.empty(rows, 64), torch.empty(widest + 8, 64), TWO)


def test_matmul_all_reduce_only_at_decode_rows():
    w = torch.empty(8192, 64)
    rows = fused.AUTO_MAX_ROWS["matmul_all_reduce"]
    assert fused.preferred("matmul_all_reduce", torch.empty(1, 64), w, TWO)
    assert fused.preferred("matmul_all_reduce", torch.empty(rows, 64), w, TWO)
    assert not fused.preferred("matmul_all_reduce", torch.empty(rows + 1, 64), w, TWO)


def test_all_reduce_up_to_measured_bytes():
    most = fused.AUTO_MAX_BYTES["all_reduce"]
    assert fused.preferred("all_reduce", torch.empty(most // 2, dtype=torch.bfloat16), None, TWO)
    assert not fused.preferred("all_reduce", torch.empty(most // 2 + 1, dtype=torch.bfloat16), None, TWO)
