"""The fused launchers' compiled-kernel lookup (fluxtp/backends/fused/_launch.py): its key must
tell apart every argument difference Triton compiles apart, or a call would run a kernel
compiled for other arguments. The lookup on real launches needs a GPU (tests/gpu/test_ops_gpu.py);
here Triton's compile and launch are stood in for."""

import pytest
import torch

pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from fluxtp.backends.fused import _launch  # noqa: E402
from fluxtp.kernels import COMPILE_OPTIONS  # noqa: E402


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
        # A split tile's head waiting for a later piece of it (stream-K): (program, -1 - tile, rank).
        ("all_gather_matmul", [7, -3, 0], "rank 0 timed out waiting for program 7's part of stream-K tile 2"),
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


def test_a_kernel_compiled_ahead_of_a_recording_is_found_by_every_later_launch(monkeypatch):
    """A plan compiles its kernels before recording them in a graph (Launch.compile, no launch);
    another plan of the same launch key (say the all-gather's return_gathered twin) must then
    launch that compiled kernel without a trip through Triton's binding, and the reverse."""
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        pass

    trips = []  # ("warmup" | "run" | "direct", ...) in the order they happened

    def through_triton(what):
        def compile_or_launch(*args, grid, warmup=False, **constexprs):
            assert constexprs.items() >= COMPILE_OPTIONS.items(), f"{what} without fluxtp's compile options"
            trips.append(what)
            return types.SimpleNamespace(run=None, function=0, packed_metadata=None)  # _Direct: not its layout

        return compile_or_launch

    monkeypatch.setattr(kernel, "warmup", through_triton("warmup"))
    monkeypatch.setattr(kernel, "run", through_triton("run"))
    device = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda index: 0)
    monkeypatch.setattr(_launch, "driver", types.SimpleNamespace(active=device))
    monkeypatch.setattr(_launch, "_run", lambda compiled, constexprs, index, grid, args: trips.append("direct"))
    monkeypatch.setattr(_launch, "_compiled", {})
    x, y = torch.zeros(64), torch.zeros(64)

    _launch.Launch(kernel, 4, BLOCK=16).compile(x, 64)  # recorded plan: compiled, not launched
    _launch.Launch(kernel, 4, BLOCK=16)(y, 64)  # another plan, same key: launched directly
    assert trips == ["warmup", "direct"]
    _launch.Launch(kernel, 4, BLOCK=16)(x, 32)  # a new key (scalars are keyed by value): Triton
    _launch.Launch(kernel, 4, BLOCK=16).compile(y, 32)  # ... whose kernel a recording then reuses
    assert trips == ["warmup", "direct", "run"]
    _launch.launch_compiled(kernel, 4, y, 48, BLOCK=16)  # a new key: through Triton, with the options
    assert trips == ["warmup", "direct", "run", "run"]


def test_direct_launches_hand_the_launcher_what_triton_hands_it(monkeypatch):
    """_Direct must pass the installed Triton's C launcher exactly the arguments Triton's own launch
    does, its descriptors filled once per address. A Triton whose launcher layout _Direct does not
    know fails here: its eager calls would fall back to Triton's slower launch."""
    import inspect
    import types

    import triton
    from triton.backends.nvidia import driver as nvidia

    if "kernel_signature" not in inspect.getsource(nvidia.CudaLauncher.__init__):
        pytest.skip("Triton 3.6's per-kernel C launcher is compiled on a GPU: tests/gpu/test_whole_call_one_gpu.py")
    fills = []

    def fill(desc, meta, _):  # cuTensorMapEncodeTiled's stand-in: a pure function of address and layout
        fills.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["block_size"]), *desc.shape, *desc.strides]

    calls = []
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", fill)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace())
    signature = {0: "*bf16", 1: "tensordesc<bf16[32,16]>", 2: "i32", 3: "tensordesc<bf16[16,16]>", 4: "constexpr"}
    metas = [{"block_size": [32, 16]}, {"block_size": [16, 16]}]
    run = object.__new__(nvidia.CudaLauncher)  # the attributes CudaLauncher.__init__ sets, without a GPU
    run.launch = nvidia.wrap_handle_tensordesc(lambda *a: calls.append(a), signature, metas)
    run.arg_annotations, run.kernel_signature, run.gsan_enabled, run.num_ctas = "annotations", "signature", False, 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    compiled = types.SimpleNamespace(run=run, packed_metadata="metadata", function=7)

    direct = _launch._Direct.of(compiled, (64,), 4)
    assert direct is not None, "this Triton's launcher layout is not one _Direct knows"
    x, a, b = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, 16, dtype=torch.bfloat16), torch.randn(48, 16)
    descs = [TensorDescriptor.from_tensor(t.bfloat16(), block) for t, block in ((a, [32, 16]), (b, [16, 16]))]
    for first, second in ((descs[0], descs[1]), (descs[0], descs[1]), (descs[1], descs[0])):
        args = (x, first, 5, second)
        run(3, 1, 1, 11, 7, "metadata", None, None, None, *args, 64)  # Triton's launch, hooks off
        direct(3, 11, 7, args)
        theirs, ours = calls[-2:]
        assert ours == theirs
    # Triton filled 2 descriptors a launch; the direct launches 2 per new (position, address) pair
    assert len(fills) == 6 + 4
