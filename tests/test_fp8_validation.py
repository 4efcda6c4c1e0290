"""Every error the FP8 ops and layers raise before anything runs, in one process (no group), plus
the row-wise quantizer's definition."""

import re

import pytest
import torch

import fluxtp
from fluxtp import fp8
from fluxtp.nn import ColumnParallelLinear, RowParallelLinear
from fluxtp.ops._validate import check_fp8_device

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _args(m=4, n=6, k=16, x_dtype=E4M3, w_dtype=E4M3):
    x = torch.randn(m, k).to(x_dtype)
    w = torch.randn(n, k).to(w_dtype)
    return x, w, torch.ones(m, 1), torch.ones(1, n)


OPS = [fluxtp.all_gather_scaled_matmul, fluxtp.scaled_matmul_reduce_scatter]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "change, error, pattern",
    [
        (lambda a: (a[0].float(), *a[1:]), TypeError, r"x(_shard)? has dtype torch.float32; the scaled ops take float8"),
        (lambda a: (a[0].float().to(torch.float8_e4m3fnuz), *a[1:]), TypeError, r"float8_e4m3fnuz.*float8_e4m3fn, float8_e5m2"),
        (lambda a: (a[0], a[1].float().to(torch.float8_e5m2fnuz), *a[2:]), TypeError, r"weight has dtype torch.float8_e5m2fnuz"),
        (lambda a: (a[0].float().to(E5M2), a[1].float().to(E5M2), *a[2:]), TypeError, r"both float8_e5m2"),
        (lambda a: (a[0], a[1][:, :8], *a[2:]), ValueError, r"K mismatch: .* \(4, 16\) .* \(6, 8\)"),
        (lambda a: (a[0][0], *a[1:]), ValueError, r"must be 2-D \[[mM], [kK]\], got shape \(16,\)"),
        (lambda a: (a[0], a[1], None, a[3]), TypeError, r"scale_x is required: the float32 scale of x(_shard)? \(4, 16\)"),
        (lambda a: (a[0], a[1], a[2].half(), a[3]), TypeError, r"scale_x has dtype torch.float16; expected torch.float32"),
        (lambda a: (a[0], a[1], torch.ones(4, 2), a[3]), ValueError, r"scale_x has shape \(4, 2\); expected \(4, 1\)"),
        (lambda a: (a[0], a[1], torch.ones(1, 4), a[3]), ValueError, r"scale_x has shape \(1, 4\); expected \(4, 1\)"),
        (lambda a: (a[0], a[1], a[2], torch.ones(6, 1)), ValueError, r"scale_w has shape \(6, 1\); expected \(1, 6\)"),
        (lambda a: (a[0], a[1], a[2], [1.0]), TypeError, r"scale_w must be a float32 torch.Tensor, got list"),
        (lambda a: (a[0], a[1], a[2], torch.ones(())), ValueError, r"both per tensor or both row-wise"),
        (lambda a: (a[0], a[1], torch.ones(1), a[3]), ValueError, r"both per tensor or both row-wise"),
        (lambda a: (a[0], a[1], torch.ones(4, 1, device="meta"), a[3]), ValueError, r"device mismatch: scale_x is on meta"),
        (lambda a: (a[0], a[1].to("meta"), *a[2:]), ValueError, r"device mismatch: x(_shard)? is on cpu but weight is on meta"),
    ],
)
def test_bad_arguments(op, change, error, pattern):
    with pytest.raises(error, match=pattern):
        op(*change(_args()))


@pytest.mark.parametrize("op", OPS)
def test_bad_options(op):
    args = _args()
    with pytest.raises(TypeError, match=r"out_dtype must be one of .*got torch.float64"):
        op(*args, out_dtype=torch.float64)
    with pytest.raises(TypeError, match=r"out_dtype must be one of .*got torch.float8_e4m3fn"):
        op(*args, out_dtype=E4M3)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\) .* got \(5,\)"):
        op(*args, bias=torch.zeros(5))
    with pytest.raises(TypeError, match=r"bias has dtype torch.float64"):
        op(*args, bias=torch.zeros(6, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"use_fast_accum must be a bool"):
        op(*args, use_fast_accum=1)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        op(*args, backend="cublas")


def test_per_tensor_and_single_row_scales_are_accepted():
    x, w, _, _ = _args(m=1)
    for sx, sw in [(torch.ones(()), torch.ones(1)), (torch.ones(1, 1), torch.ones(1, 6)), (torch.ones(1), torch.ones(1, 6))]:
        for op in OPS:
            assert op(x, w, sx, sw).shape == (1, 6)


def test_gpu_without_fp8_tensor_cores(monkeypatch):
    """Capability 8.0 (A100): a clear error naming the tensor, the GPU and what FP8 needs."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    message = "x_shard is on cuda:0 (NVIDIA A100-SXM4-80GB, compute capability 8.0), which has no FP8 tensor cores; FP8 needs capability 8.9"
    with pytest.raises(ValueError, match=re.escape(message)):
        check_fp8_device("x_shard", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("x_shard", torch.device("cuda", 0))  # Hopper: fine


def test_fp8_layers_refuse_float64_parameters():
    with pytest.raises(TypeError, match=r"ColumnParallelLinear\(fp8=True\) needs parameters of .*got torch.float64"):
        ColumnParallelLinear(8, 8, fp8=True, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"RowParallelLinear\(fp8=True\) needs parameters of"):
        RowParallelLinear(8, 8, fp8=True, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rows(dtype):
    """Power-of-two scales, the smallest with |t| / scale <= the format's max; values rounded to
    nearest by the cast of the exact t / scale; zero rows give zeros."""
    t = torch.randn(6, 40) * 2.0 ** torch.arange(-12, 24, 6).view(6, 1)
    t[2] = 0
    t_q, scale = fp8.quantize_rows(t, dtype)
    assert t_q.dtype == dtype and t_q.is_contiguous() and scale.shape == (6, 1) and scale.dtype == torch.float32
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5), f"scales not powers of two: {scale.view(-1).tolist()}"
    limit = fp8.fp8_max(dtype)
    ratio = t.abs().amax(1, keepdim=True) / scale
    live = torch.arange(6) != 2
    assert torch.all(ratio[live] <= limit) and torch.all(ratio[live] > limit / 2), ratio.view(-1).tolist()
    assert torch.equal(t_q.view(torch.uint8), (t.double() / scale.double()).to(dtype).view(torch.uint8))
    assert torch.all(t_q[2].float() == 0)
    t_q2, scale2 = fp8.quantize_rows(t.t().contiguous().t(), dtype)  # a column-major view: the same, row-major
    assert torch.equal(scale2, scale) and torch.equal(t_q2.view(torch.uint8), t_q.view(torch.uint8))


def test_torch_backend_finds_the_scaled_ops_in_a_fresh_process():
    """torch.ops.symm_mem's scaled ops exist only once torch.distributed._symmetric_memory is
    imported: the first check of a process must not call them missing (it did, so `fluxtp bench
    --fp8` left PyTorch's all-gather untimed at its first case)."""
    import subprocess
    import sys

    code = (
        "import torch; from fluxtp.backends import torch_symm\n"
        "for op in ('all_gather_scaled_matmul', 'scaled_matmul_reduce_scatter'):\n"
        "    why = torch_symm._scaled_unsupported_reason(op, torch.empty(16, 32), torch.empty(32, 32), False,"
        " torch.bfloat16, False)\n"
        "    assert why is None, why\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
