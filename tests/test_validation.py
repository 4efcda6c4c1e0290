"""One test per validation rule of the op contract (DESIGN.md): the exception type, and a message
that names the argument and its shape (or dtype, or device) and what was expected.

The rules that need a process group run in one spawned 3-rank gloo world (module fixture); the
others need no world at all (the checks run before the group is looked at)."""

import json
import re

import pytest
import torch
import torch.distributed as dist

import fluxtp
from fluxtp.ops import OPS
from fluxtp.testing import run_on_ranks

# The name of the activation argument of each op, as its messages spell it.
X_NAME = {"all_gather_matmul": "x_shard", "matmul_reduce_scatter": "x", "matmul_all_reduce": "x"}


def call(op, x, weight, **kwargs):
    return getattr(fluxtp, op)(x, weight, **kwargs)


def assert_names(message: str, *needles: str) -> None:
    for needle in needles:
        assert re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", message), f"{needle!r} not named in: {message}"


@pytest.fixture(params=OPS)
def op(request):
    return request.param


def test_x_of_wrong_rank(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8, 1), torch.randn(6, 8))
    assert_names(str(e.value), X_NAME[op], "(4, 8, 1)", "2-D")


def test_weight_of_wrong_rank(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(48))
    assert_names(str(e.value), "weight", "(48,)", "2-D")


def test_k_mismatch(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 7))
    assert_names(str(e.value), X_NAME[op], "(4, 8)", "weight", "(6, 7)", "K=8", "K=7")


def test_dtype_mismatch(op):
    with pytest.raises(TypeError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8, dtype=torch.bfloat16))
    assert_names(str(e.value), X_NAME[op], "weight", "torch.float32", "torch.bfloat16")


@pytest.mark.parametrize("which", ["x", "weight"])
def test_unsupported_dtype(op, which):
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    if which == "x":
        x = x.to(torch.int32)
    else:
        weight = weight.to(torch.int32)
    with pytest.raises(TypeError) as e:
        call(op, x, weight)
    assert_names(
        str(e.value), X_NAME[op] if which == "x" else "weight", "torch.int32", "bfloat16", "float16", "float32"
    )


def test_devices_differ(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8, device="meta"))
    assert_names(str(e.value), X_NAME[op], "weight", "cpu", "meta")


def test_bias_of_wrong_shape(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), bias=torch.randn(5))
    assert_names(str(e.value), "bias", "(5,)", "(6,)", "(6, 8)")


def test_bias_of_wrong_rank(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), bias=torch.randn(1, 6))
    assert_names(str(e.value), "bias", "(1, 6)", "1-D")


def test_bias_of_wrong_dtype(op):
    with pytest.raises(TypeError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), bias=torch.randn(6, dtype=torch.float64))
    assert_names(str(e.value), "bias", "torch.float64", "torch.float32")


def test_bias_on_another_device(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), bias=torch.randn(6, device="meta"))
    assert_names(str(e.value), "bias", "meta", "cpu")


def test_not_a_tensor(op):
    with pytest.raises(TypeError) as e:
        call(op, [[1.0] * 8] * 4, torch.randn(6, 8))
    assert_names(str(e.value), X_NAME[op], "list")


def test_bad_backend_name(op):
    with pytest.raises(ValueError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), backend="nvshmem")
    assert_names(str(e.value), "backend", "'nvshmem'", "'auto'", "'fused'", "'nccl'", "'torch'")


def test_group_that_is_not_a_process_group(op):
    with pytest.raises(TypeError) as e:
        call(op, torch.randn(4, 8), torch.randn(6, 8), group="tp")
    assert_names(str(e.value), "group", "ProcessGroup", "str")


# --------------------------------------------------- rules that need a process group


def _capture(fn) -> list[str] | None:
    try:
        fn()
    except Exception as e:  # recorded for the parent to check
        return [type(e).__name__, str(e)]
    return None


def _world_rules_body(rank, world, out_path):
    pair = dist.new_group([1, 2])  # collective: every rank creates it
    found = {}
    if rank == 0:  # not a member of `pair`
        for op in OPS:
            found[f"not_member/{op}"] = _capture(
                lambda op=op: call(op, torch.randn(4, 8), torch.randn(6, 8), group=pair)
            )
    # M = 4 rows cannot be scattered over the 3 ranks of the world (checked before any collective).
    found["m_not_divisible/world"] = _capture(
        lambda: fluxtp.matmul_reduce_scatter(torch.randn(4, 8), torch.randn(6, 8))
    )
    if rank in (1, 2):  # nor M = 5 over the 2 ranks of the pair
        found[f"m_not_divisible/pair/{rank}"] = _capture(
            lambda: fluxtp.matmul_reduce_scatter(torch.randn(5, 8), torch.randn(6, 8), group=pair)
        )
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(found, f)


@pytest.fixture(scope="module")
def world_rules(tmp_path_factory):
    out = tmp_path_factory.mktemp("validation") / "found"
    run_on_ranks(_world_rules_body, 3, str(out), backend="gloo")
    found = {}
    for rank in range(3):
        found.update(json.loads(out.with_name(f"found.{rank}").read_text()))
    return found


def test_caller_not_in_group(world_rules, op):
    kind, message = world_rules[f"not_member/{op}"]
    assert kind == "ValueError"
    assert_names(message, "global rank 0", "not a member of the group")


def test_m_not_divisible_by_world_for_reduce_scatter(world_rules):
    kind, message = world_rules["m_not_divisible/world"]
    assert kind == "ValueError"
    assert_names(message, "x", "(4, 8)", "M=4", "world size 3")
    for rank in (1, 2):
        kind, message = world_rules[f"m_not_divisible/pair/{rank}"]
        assert kind == "ValueError"
        assert_names(message, "x", "(5, 8)", "M=5", "world size 2")
