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
