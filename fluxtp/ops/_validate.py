"""Argument checks shared by the ops: every failure names the tensor, its shape or dtype, and
what was expected (the op contract in DESIGN.md)."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKENDS = ("auto", "fused", "nccl", "torch")


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has unsupported dtype {t.dtype}; expected one of {names}")


def check_linear_args(x, weight, bias, x_name: str, x_layout: str, w_layout: str) -> None:
    """x [rows, K] @ weight[n, K]^T (+ bias[n]): shapes, dtypes and devices agree."""
    check_tensor(x_name, x, 2, x_layout)
    check_tensor("weight", weight, 2, w_layout)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"K mismatch: {x_name} has shape {tuple(x.shape)} (K={x.shape[1]}) but weight has shape "
            f"{tuple(weight.shape)} (K={weight.shape[1]}); weight must be [out_features, K] as in nn.Linear"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"dtype mismatch: {x_name} is {x.dtype} but weight is {weight.dtype}; expected the same dtype")
    if weight.device != x.device:
        raise ValueError(f"device mismatch: {x_name} is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        check_tensor("bias", bias, 1, f"[{weight.shape[0]}]")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},) to match weight {tuple(weight.shape)}, "
                f"got {tuple(bias.shape)}"
            )
        if bias.dtype != x.dtype:
            raise TypeError(f"dtype mismatch: bias is {bias.dtype} but {x_name} is {x.dtype}; expected the same dtype")
        if bias.device != x.device:
            raise ValueError(f"device mismatch: bias is on {bias.device} but {x_name} is on {x.device}")


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
