"""Call plans (fluxtp._plan, fluxtp.ops._dispatch): the second eager call of a signature reuses
the first's plan (no validation, no group resolution, no backend choice, no backend plan), and a
plan is rebuilt when it must be: another shape, stride, dtype, backend or group; the tuning
tables reloaded; a symmetric buffer created, grown or freed; a group destroyed through fluxtp."""

import types

import pytest
import torch

from fluxtp import _generation, backends, configs, symm
from fluxtp._dist import GroupInfo
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.testing import run_on_ranks


def _cached_plan() -> PlanCache:
    """A cache holding one plan: empty once the generation moves."""
    cache = PlanCache()
    cache.put("k", object())
    return cache


def test_a_plan_lives_until_the_generation_moves_and_goes_at_once():
    """A bump empties every cache then and there: what only stale plans hold (a replaced
    workspace) is freed outside any capture, not at a later put."""
    cache, other = PlanCache(), _cached_plan()
    plan = cache.put("k", object())
    assert cache.get("k") is plan
    _generation.bump()
    assert cache.get("k") is None and len(cache) == 0 and len(other) == 0


def test_freed_workspaces_take_the_ops_state_over_them_and_every_plan(monkeypatch):
    """free_workspaces(group) drops that group's buffers and each op's entries over them (keyed by
    the group's name first), no other group's, and every cached plan."""
    mine, theirs = symm.op_workspaces(), symm.op_workspaces()
    monkeypatch.setattr(symm, "_buffers", {("g", 0, "op"): "buffer", ("h", 0, "op"): "buffer"})
    mine.update({("g", 0): "ws", ("h", 0): "ws"})
    theirs[("g", 1, "all_reduce")] = "ws"
    cache = PlanCache()
    cache.put("k", object())
    try:
        symm.free_workspaces("g")
        assert list(symm._buffers) == [("h", 0, "op")] and list(mine) == [("h", 0)] and not theirs
        assert len(cache) == 0
        symm.free_workspaces()
        assert not symm._buffers and not mine
    finally:
        symm._op_workspaces.remove(mine)
        symm._op_workspaces.remove(theirs)


def test_the_signature_tells_apart_what_a_plan_depends_on():
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    base = tensor_key(x)
    assert tensor_key(torch.ones(8, 16, dtype=torch.bfloat16)) == base  # values never matter
    others = [x.float(), x[:4], x.t().contiguous().t(), torch.zeros(17, dtype=torch.bfloat16)[1:].view(1, 16),
              torch.nn.Parameter(x)]  # fmt: skip
    assert len({base, *map(tensor_key, others)}) == 1 + len(others)


def test_reload_and_freed_workspaces_move_the_generation():
    cache = _cached_plan()
    configs.reload()
    assert len(cache) == 0
    cache = _cached_plan()
    symm.free_workspaces("no such group")
    assert len(cache) == 0


def test_a_created_or_grown_symmetric_buffer_moves_the_generation(monkeypatch):
    """symm.buffer with torch's symmetric memory stood in for by plain CPU tensors."""
    fake = types.SimpleNamespace(
        empty=lambda size, dtype, device: torch.empty(size, dtype=dtype),
        rendezvous=lambda tensor, name: types.SimpleNamespace(rank=0),
        enable_symm_mem_for_group=lambda name: None,
    )
    monkeypatch.setattr(symm, "_symm_mem", lambda: fake)
    monkeypatch.setattr(symm.torch.cuda, "synchronize", lambda device=None: None)
    info = GroupInfo(None, 0, 2)
    try:
        cache = _cached_plan()
        first = symm.buffer(info, "test_plans", 1 << 10, "cpu")
        assert len(cache) == 0
        cache = _cached_plan()
        assert symm.buffer(info, "test_plans", 1 << 10, "cpu") is first and len(cache) == 1  # reused
        grown = symm.buffer(info, "test_plans", 1 << 22, "cpu")
        assert grown is not first and len(cache) == 0
    finally:
        symm.free_workspaces("")


def _plans_body(rank, world, seed):
    import fluxtp
    import torch.distributed as dist

    del seed
    counts = {"choose": 0, "prepare": 0, "check": 0, "unsupported": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    import importlib

    ag_module = importlib.import_module("fluxtp.ops.all_gather_matmul")
    backends.choose = counted("choose", backends.choose)
    backends.prepare = counted("prepare", backends.prepare)
    backends.unsupported_reason = counted("unsupported", backends.unsupported_reason)
    ag_module.check_linear_args = counted("check", ag_module.check_linear_args)

    def calls(fn):
        before = dict(counts)
        out = fn()
        return out, {k: counts[k] - before[k] for k in counts}

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    first, built = calls(lambda: fluxtp.all_gather_matmul(x, w))
    assert built == {"choose": 1, "prepare": 1, "check": 1, "unsupported": 2}, built  # auto: fused refused, nccl taken
    # The second call of the signature: nothing resolved again, and the same result for the same data.
    again, reused = calls(lambda: fluxtp.all_gather_matmul(x.clone(), w.clone()))
    assert reused == {"choose": 0, "prepare": 0, "check": 0, "unsupported": 0}, reused
    assert torch.equal(first, again)
    # What the signature holds makes a new plan when it changes.
    for what, call in [
        ("shape", lambda: fluxtp.all_gather_matmul(torch.randn(2, 8), w)),
        ("stride", lambda: fluxtp.all_gather_matmul(x, w.t().contiguous().t())),
        ("dtype", lambda: fluxtp.all_gather_matmul(x.double(), w.double())),
        ("bias", lambda: fluxtp.all_gather_matmul(x, w, bias=torch.randn(6))),
        ("backend", lambda: fluxtp.all_gather_matmul(x, w, backend="nccl")),
        ("return_gathered", lambda: fluxtp.all_gather_matmul(x, w, return_gathered=True)),
    ]:
        _, new = calls(call)
        assert new["prepare"] == 1 and new["check"] == 1, (what, new)
    # Invalidation: a reload of the tuning tables, freed workspaces.
    for what, invalidate in [("reload", configs.reload), ("free_workspaces", symm.free_workspaces)]:
        invalidate()
        _, rebuilt = calls(lambda: fluxtp.all_gather_matmul(x, w))
        assert rebuilt["prepare"] == 1, (what, rebuilt)
        _, reused = calls(lambda: fluxtp.all_gather_matmul(x, w))
        assert reused["prepare"] == 0, (what, reused)
    # Another group of the same ranks: a plan of its own (plans are keyed by the group object).
    other = dist.new_group(list(range(world)))
    _, new = calls(lambda: fluxtp.all_gather_matmul(x, w, group=other))
    assert new["prepare"] == 1, new
    # Bad input still gets its message on a planned signature's neighbour.
    with pytest.raises(ValueError, match="K mismatch"):
        fluxtp.all_gather_matmul(x, torch.randn(6, 7))
    with pytest.raises(TypeError, match="x_shard must be a torch.Tensor"):
        fluxtp.all_gather_matmul([1.0], w)
    dist.barrier()


def test_second_calls_reuse_the_plan_and_invalidation_rebuilds_it():
    run_on_ranks(_plans_body, 2, 0, backend="gloo", timeout_s=300)


def test_fluxtp_destroy_process_group_moves_the_generation(monkeypatch):
    from fluxtp import _dist

    monkeypatch.setattr(_dist.dist, "destroy_process_group", lambda: None)
    cache = _cached_plan()
    _dist.destroy_process_group()
    assert len(cache) == 0
