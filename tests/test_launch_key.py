"""The fused launchers' compiled-kernel lookup (fluxtp/backends/fused/_launch.py): its key must
tell apart every argument difference Triton compiles apart, or a call would run a kernel
compiled for other arguments. The lookup itself needs a GPU: tests/gpu/test_ops_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from fluxtp.backends.fused import _launch  # noqa: E402


def _key(arg):
    return _launch._spec_key(arg)


def test_scalars_are_keyed_by_type_and_exact_value():
    # Triton compiles 1, multiples of 16 and other ints apart, and bools apart from ints.
    keys = [_key(v) for v in (1, 16, 17, 32, True, False, 0, None, 1.0)]
    assert len(set(keys)) == len(keys)
    assert _key(17) == _key(17)


def test_tensors_are_keyed_by_dtype_and_alignment():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert _key(buf[8:]) == _key(buf)  # 16 bytes in: still aligned
    assert _key(buf[1:]) != _key(buf)  # 2 bytes in: not
    assert _key(buf.view(torch.float16)) != _key(buf)


def test_descriptors_are_keyed_by_layout_and_block():
    x = torch.zeros(64, 32, dtype=torch.float16)
    base = _key(TensorDescriptor.from_tensor(x, [16, 16]))
    assert _key(TensorDescriptor.from_tensor(x.clone(), [16, 16])) == base
    others = [
        TensorDescriptor.from_tensor(x, [32, 16]),
        TensorDescriptor.from_tensor(x[:48], [16, 16]),
        TensorDescriptor.from_tensor(torch.zeros(64, 40, dtype=torch.float16)[:, :32], [16, 16]),
        TensorDescriptor.from_tensor(x.to(torch.bfloat16), [16, 16]),
    ]
    assert len({base, *map(_key, others)}) == 1 + len(others)


def test_kernels_that_are_not_compiled_take_their_own_launch():
    # The interpreter's kernels (and anything that is not a JITFunction) are launched as such.
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    _launch.launch_compiled(Kernel(), 3, 1, "a", FLAG=True)
    assert launched == [((3,), (1, "a"), {"FLAG": True})]


@pytest.mark.parametrize(
    "op, record, expected",
    [
        ("all_gather_matmul", [1, 3, 0], "rank 0 timed out waiting for chunk 3 of rank 1's rows"),
        ("matmul_reduce_scatter", [2, 17, 1], "rank 1 timed out waiting for rank 2's partial of tile 17"),
        ("all_reduce", [0, 5, 3], "rank 3 timed out waiting for rank 0's partial of tile 5"),
    ],
)
def test_every_timeout_report_names_rank_and_chunk_or_tile(op, record, expected):
    """What a kernel's give_up wrote, (source rank, chunk or tile, rank), read back as a sentence."""
    report = _launch.timeout_record(op, "cpu")
    assert _launch.timeout_report(op) is None  # nothing gave up yet
    try:
        report.copy_(torch.tensor(record, dtype=torch.int32))
        assert expected in _launch.timeout_report(op)
    finally:
        report.fill_(-1)
