"""What the fused launchers need to run the scaled (FP8) ops on their kernels: the FP8 constexprs
and the scales as the kernels read them (a plain call passes none of this: its kernels compile
exactly as before, the scale pointers being None constexprs).

Kernel constexprs: SCALING 0 (unscaled), 1 (per tensor: one float32 each), 2 (row-wise: a float32
per row of x, indexed by the row in the whole x, and one per output column); PRECISE_ACC: FP8
products promoted to float32 after every BLOCK_K of K (tl.dot's max_num_imprecise_acc), as
torch._scaled_mm without use_fast_accum; with it, Hopper's FP8 tensor cores accumulate in their
own reduced precision over the whole K loop.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass

import torch

from fluxtp import fp8


@dataclass(frozen=True)
class Scaled:
    """One scaled call signature's choices (part of the launchers' plan keys)."""

    out_dtype: torch.dtype
    row_wise: bool
    precise_acc: bool  # not use_fast_accum

    @staticmethod
    def of(scale_x, scale_w, out_dtype, use_fast_accum: bool) -> Scaled:
        return Scaled(out_dtype, fp8.is_row_wise(scale_x, scale_w), not use_fast_accum)

    @property
    def scaling(self) -> int:
        return 2 if self.row_wise else 1


def flat(scale: torch.Tensor) -> torch.Tensor:
    """A scale as the kernels index it: float32, contiguous, one dim (a view where it can be)."""
    return scale.reshape(-1).contiguous()


def constexprs(scaled: Scaled | None) -> dict:
    """The kernels' FP8 constexprs for a launch (off for a plain call)."""
    if scaled is None:
        return {"SCALING": 0, "PRECISE_ACC": False}
    return {"SCALING": scaled.scaling, "PRECISE_ACC": scaled.precise_acc}


def split_accumulator(scaled: Scaled | None, block_n: int) -> bool:
    """Whether a warp-specialized kernel's tile keeps its float32 accumulator in two column halves
    (fluxtp.kernels._pingpong's SPLIT): a precise call's tiles wider than 128 columns, whose whole
    accumulator and promotion buffer would not fit a consumer's registers."""
    return scaled is not None and scaled.precise_acc and block_n > 128


def staging_columns(block_n: int, split: bool) -> int:
    """The columns the all-gather kernel's consumer stages and TMA-stores at once: a split
    accumulator's halves go one after the other through a buffer half as wide (split_accumulator;
    the reducer kernel's staging: _matmul_reduce_scatter.reducer_staging_columns)."""
    return block_n // 2 if split else block_n


# The warp-specialized kernels' launch: 12 warps of 168 registers (num_warps counts the default
# partition, consumer 0); the two consumers take 232 each, the loader warp 40.
PINGPONG_WARPS = {"num_warps": 4, "maxnreg": 168}


@functools.cache
def _pingpong_kernels_available() -> bool:
    """Whether this Triton has the Gluon the warp-specialized kernels are written in (its API moves)."""
    try:
        from triton.experimental.gluon import language as gl

        from fluxtp.kernels import _pingpong  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


def pingpong_unsupported(device, scaled: Scaled | None, plain_dtype: torch.dtype | None = None) -> str | None:
    """Why a call cannot take a warp-specialized kernel (fluxtp.kernels._pingpong), or None. They
    serve scaled calls (either accumulation) and plain ones (plain_dtype: such a call's dtype, bf16
    or fp16), on Hopper (sm_90), compiled (not interpreted)."""
    if scaled is None and plain_dtype not in (torch.bfloat16, torch.float16):
        return "it serves FP8 calls, and bf16 or fp16 calls, only"
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "it runs on a CUDA GPU only, not under the Triton interpreter"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return f"it needs a Hopper GPU (sm_90), this is {torch.cuda.get_device_name(device)}"
    if not _pingpong_kernels_available():
        return "this Triton's Gluon lacks what it is written in (Triton 3.6's warp_specialize and Hopper TMA)"
    return None
