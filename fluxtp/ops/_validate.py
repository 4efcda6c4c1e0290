"""Argument checks shared by the ops: every failure names the tensor, its shape or dtype, and
what was expected (the op contract in DESIGN.md)."""

from __future__ import annotations

import torch

from fluxtp import backends, fp8

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The built-in choices; fluxtp.backends.register adds others (check_backend takes those too).
BACKENDS = ("auto", "fused", "nccl", "torch")


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has unsupported dtype {t.dtype}; expected one of {names}")


def _check_k(x, weight, x_name: str) -> None:
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"K mismatch: {x_name} has shape {tuple(x.shape)} (K={x.shape[1]}) but weight has shape "
            f"{tuple(weight.shape)} (K={weight.shape[1]}); weight must be [out_features, K] as in nn.Linear"
        )


def check_scatter_rows(x, world: int) -> None:
    """The reduce-scatter's rows split evenly over the group."""
    if world > 1 and x.shape[0] % world:
        raise ValueError(
            f"x has shape {tuple(x.shape)}: its M={x.shape[0]} rows must be divisible by the "
            f"group's world size {world} to be scattered"
        )


def check_linear_args(x, weight, bias, x_name: str, x_layout: str, w_layout: str) -> None:
    """x [rows, K] @ weight[n, K]^T (+ bias[n]): shapes, dtypes and devices agree."""
    check_tensor(x_name, x, 2, x_layout)
    check_tensor("weight", weight, 2, w_layout)
    _check_k(x, weight, x_name)
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
    """A built-in backend, "auto", or one that fluxtp.backends.register added."""
    if backend not in BACKENDS and backend not in backends.registered():
        known = (*BACKENDS, *backends.registered())
        raise ValueError(f"backend must be one of {', '.join(map(repr, known))}, got {backend!r}")


# ---------------------------------------------------------------- the scaled (FP8) ops


def _fp8_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in fp8.FP8_DTYPES)


def _check_fp8_operand(name: str, t, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D {layout}, got shape {tuple(t.shape)}")
    if not fp8.is_fp8(t.dtype):
        raise TypeError(f"{name} has dtype {t.dtype}; the scaled ops take float8 operands: one of {_fp8_names()}")


def _check_scale(name: str, scale, of: str, of_shape, row_shape: tuple[int, int], device) -> None:
    """float32 on the operand's device, per tensor (one value) or row-wise (row_shape)."""
    if scale is None:
        raise TypeError(f"{name} is required: the float32 scale of {of} {tuple(of_shape)} (torch._scaled_mm's)")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {scale.dtype}; expected torch.float32")
    if scale.device != device:
        raise ValueError(f"device mismatch: {name} is on {scale.device} but {of} is on {device}")
    per_tensor = scale.numel() == 1 and scale.dim() <= 2
    if not per_tensor and tuple(scale.shape) != row_shape:
        raise ValueError(
            f"{name} has shape {tuple(scale.shape)}; expected {row_shape} (row-wise, for {of} {tuple(of_shape)}) "
            "or a single value (per tensor: shape (), (1,) or (1, 1))"
        )


def check_scaled_args(x, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum, x_name: str, x_layout: str,
                      w_layout: str) -> None:  # fmt: skip
    """x [rows, K] (float8) @ weight [n, K]^T (float8), scaled as torch._scaled_mm scales, (+ bias
    [n]) in out_dtype: formats, shapes, scales, devices, and FP8 tensor cores on a GPU."""
    _check_fp8_operand(x_name, x, x_layout)
    _check_fp8_operand("weight", weight, w_layout)
    if x.dtype == weight.dtype == torch.float8_e5m2:
        raise TypeError(f"{x_name} and weight are both float8_e5m2; at most one operand may be e5m2 (as in torch._scaled_mm)")
    _check_k(x, weight, x_name)
    if weight.device != x.device:
        raise ValueError(f"device mismatch: {x_name} is on {x.device} but weight is on {weight.device}")
    scale_x_name = "scale_" + x_name.split("_")[0]
    _check_scale(scale_x_name, scale_x, x_name, x.shape, (x.shape[0], 1), x.device)
    _check_scale("scale_w", scale_w, "weight", weight.shape, (1, weight.shape[0]), x.device)
    # torch._scaled_mm scales both operands alike; a single value stands for a row-wise scale of
    # an operand that has one row.
    x_rows, w_rows = scale_x.numel() != 1, scale_w.numel() != 1
    if x_rows != w_rows and not (x_rows and weight.shape[0] == 1) and not (w_rows and x.shape[0] == 1):
        raise ValueError(
            f"{scale_x_name} has shape {tuple(scale_x.shape)} and scale_w {tuple(scale_w.shape)}: scale both per tensor "
            f"or both row-wise ({scale_x_name} [{x.shape[0]}, 1] and scale_w [1, {weight.shape[0]}]), as torch._scaled_mm"
        )
    if out_dtype not in fp8.OUT_DTYPES:
        names = ", ".join(str(d) for d in fp8.OUT_DTYPES)
        raise TypeError(f"out_dtype must be one of {names}, got {out_dtype}")
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight {tuple(weight.shape)}, got {shape}")
        if bias.dtype not in fp8.OUT_DTYPES:
            raise TypeError(f"bias has dtype {bias.dtype}; expected one of {', '.join(str(d) for d in fp8.OUT_DTYPES)}")
        if bias.device != x.device:
            raise ValueError(f"device mismatch: bias is on {bias.device} but {x_name} is on {x.device}")
    check_fp8_device(x_name, x.device)


def check_fp8_device(name: str, device: torch.device) -> None:
    """FP8 tensor cores on the tensor's GPU (none needed on CPU: the dequantized float32 product)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < fp8.MIN_CAPABILITY:
        raise ValueError(
            f"{name} is on {device} ({torch.cuda.get_device_name(device)}, compute capability "
            f"{capability[0]}.{capability[1]}), which has no FP8 tensor cores; FP8 needs capability "
            f"{fp8.MIN_CAPABILITY[0]}.{fp8.MIN_CAPABILITY[1]} or higher (Ada, Hopper)"
        )
