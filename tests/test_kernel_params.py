"""A recorded call's kernel parameters (fluxtp/backends/fused/_launch.py, KernelParams): the array
must follow Triton's launcher (constexprs left out, a host descriptor expanded to its tensor map,
shape and strides, two scratch pointers last), be refused where the loaded kernel declares other
sizes, and rebind a call's tensors (descriptors encoded once per address). The driver calls are
stood in for here; tests/gpu/test_whole_call_one_gpu.py runs the real ones."""

import ctypes
import types

import pytest
import torch

pytest.importorskip("triton")

from fluxtp.backends.fused import _launch  # noqa: E402

# tensordesc<bf16[128, 64]>, *bf16, constexpr (None), i32, i64: Triton's expanded sizes.
SIGNATURE = {"a": "tensordesc<bf16[128, 64]>", "y": "*bf16", "bias": "constexpr", "n": "i32", "k": "i64",
             "RANK": "constexpr"}  # fmt: skip
META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64], "fp4_padded": False}
SIZES = [128, 4, 4, 8, 8, 8, 4, 8, 8, 8]


def _compiled(signature=SIGNATURE, metas=(META,)):
    return types.SimpleNamespace(
        src=types.SimpleNamespace(signature=dict(signature)),
        metadata=types.SimpleNamespace(tensordesc_meta=list(metas)),
        function=1234,
    )


def _descriptor(base):
    return types.SimpleNamespace(base=base, shape=[256, 64], strides=[64, 1], padding="zero")


@pytest.fixture
def driver(monkeypatch):
    """The driver stood in for: the declared sizes, and an encoder that writes the base address
    into the tensor map's first 8 bytes and counts its calls."""
    state = types.SimpleNamespace(sizes=list(SIZES), encoded=[])

    def encode(out, dtype, address, shape, strides_bytes, box, swizzle, nan_fill):
        assert out % 64 == 0, "a tensor map must be 64-byte aligned"
        state.encoded.append((address, list(shape), list(strides_bytes), list(box), swizzle, nan_fill))
        ctypes.c_uint64.from_address(out).value = address

    monkeypatch.setattr(_launch._driver, "kernel_param_sizes", lambda function: state.sizes)
    monkeypatch.setattr(_launch._driver, "encode_tiled_tensor_map", encode)
    return state


def _value(params, slot, ctype):
    return ctype.from_address(params.array[slot]).value


def test_the_array_follows_tritons_launcher(driver):
    x, y = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    params = _launch.KernelParams.of(_compiled(), (_descriptor(x), y, None, 100, 5))
    assert params is not None and len(params.array) == len(SIZES)
    # The descriptor: its map, then shape (i32) and strides (i64) as the kernel reads them.
    assert _value(params, 0, ctypes.c_uint64) == x.data_ptr()
    assert [_value(params, i, ctypes.c_int32) for i in (1, 2)] == [256, 64]
    assert [_value(params, i, ctypes.c_int64) for i in (3, 4)] == [64, 1]
    assert _value(params, 5, ctypes.c_uint64) == y.data_ptr()
    assert _value(params, 6, ctypes.c_uint32) == 100 and _value(params, 7, ctypes.c_uint64) == 5
    assert _value(params, 8, ctypes.c_uint64) == 0 and _value(params, 9, ctypes.c_uint64) == 0  # scratch
    assert driver.encoded == [(x.data_ptr(), [256, 64], [128], [128, 64], 3, False)]


def test_a_call_rebinds_its_tensors_and_encodes_each_address_once(driver):
    x, y = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    params = _launch.KernelParams.of(_compiled(), (_descriptor(x), y, None, 100, 5))
    bind = params.binder((0, 1, 2))  # the constexpr bias is not passed: nothing to bind
    x2, y2 = torch.zeros_like(x), torch.zeros_like(y)
    bind((x2, y2, None))
    assert _value(params, 0, ctypes.c_uint64) == x2.data_ptr()
    assert _value(params, 5, ctypes.c_uint64) == y2.data_ptr()
    bind((x, y, None))
    bind((x2, y2, None))
    assert _value(params, 0, ctypes.c_uint64) == x2.data_ptr()
    assert [e[0] for e in driver.encoded] == [x.data_ptr(), x2.data_ptr()], "an address was encoded twice"
    assert _value(params, 6, ctypes.c_uint32) == 100, "a fixed argument moved"


def test_a_layout_the_kernel_does_not_declare_is_refused(driver):
    x, y = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    args = (_descriptor(x), y, None, 100, 5)
    driver.sizes = SIZES[:-1]  # one scratch pointer fewer: another Triton's launcher
    assert _launch.KernelParams.of(_compiled(), args) is None
    driver.sizes = None  # a driver that cannot tell
    assert _launch.KernelParams.of(_compiled(), args) is None
    driver.sizes = list(SIZES)
    float_signature = dict(SIGNATURE, n="fp32")  # a float argument: not laid out here
    assert _launch.KernelParams.of(_compiled(float_signature), args) is None
    assert _launch.KernelParams.of(_compiled(metas=()), args) is None  # a descriptor not lowered to TMA
