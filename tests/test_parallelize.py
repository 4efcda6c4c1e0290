"""parallelize() on tiny random transformers models against the same unsharded model: logits,
loss and every parameter gradient, on a gloo world of 2 (one spawn for all cases).

Each rank builds the full model from one seed, deep-copies it, parallelizes the copy and runs
both on the same tokens; a sharded parameter's gradient is compared with the matching slice of
the full gradient, a replicated one (embeddings, norms, lm_head, row biases) with the whole.
"""

import copy
import random

import pytest
import torch
import transformers  # the test extra's; a missing install fails here rather than skipping

from fluxtp.nn import ColumnParallelLinear, RowParallelLinear, parallelize
from fluxtp.testing import run_on_ranks
from tests._cases import rel_error

# Normwise relative error against the unsharded model in float64. The sharded model sums the
# same products in another order (reduce-scatter of rank partials, gathered GEMMs), so each
# value differs by a few ulps per layer; through 2 layers, softmax and the loss that stays far
# below 1e-10 (measured ~1e-15), while any misplaced head, token or missing reduction gives
# errors of order 1.
TOLERANCE = 1e-10

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


def _build(family, attn, seed, **overrides):
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    config_cls, model_cls = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    config = config_cls(**{**TINY, **overrides}, attn_implementation=attn, use_cache=False)
    torch.manual_seed(seed)
    model = model_cls(config).double()
    # Fresh random norms and biases: at their init (ones, zeros) a wrong slice would go unseen.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def _expected_grad(name, full_grad, module, rank):
    """The slice of the full gradient that this rank's parameter `name` holds."""
    if isinstance(module, ColumnParallelLinear):
        n = module.out_features_local
        return full_grad[rank * n : (rank + 1) * n]
    if isinstance(module, RowParallelLinear) and name.endswith("weight"):
        k = module.in_features_local
        return full_grad[:, rank * k : (rank + 1) * k]
    return full_grad  # replicated: the whole gradient on every rank


def check_model(rank, world, family, attn, seed, batch, seq, save_memory=False):
    reference = _build(family, attn, seed)
    model = parallelize(copy.deepcopy(reference), save_memory=save_memory)
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=g)

    ref_out = reference(input_ids=input_ids, labels=input_ids)
    out = model(input_ids=input_ids, labels=input_ids)
    tag = f"{family}/{attn} W={world} batch={batch} seq={seq}"
    assert out.logits.shape == ref_out.logits.shape
    err = rel_error(out.logits, ref_out.logits.detach())
    assert err <= TOLERANCE, f"{tag} logits: rel err {err:.2e}"
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOLERANCE * abs(ref_out.loss.item()), f"{tag} loss"

    ref_out.loss.backward()
    out.loss.backward()
    ref_params = dict(reference.named_parameters())
    modules = dict(model.named_modules())
    names = [name for name, _ in model.named_parameters()]
    assert names == list(ref_params), f"{tag}: parameter names changed"
    for name, p in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        expected = _expected_grad(name, ref_params[name].grad, module, rank)
        assert p.grad is not None, f"{tag} {name}: no gradient"
        assert p.grad.shape == expected.shape, (
            f"{tag} {name}: grad shape {tuple(p.grad.shape)} vs {tuple(expected.shape)}"
        )
        err = rel_error(p.grad, expected)
        assert err <= TOLERANCE, f"{tag} {name}: grad rel err {err:.2e}"
    sharded = [n for n, m in modules.items() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(sharded) == 7 * TINY["num_hidden_layers"], sharded


def check_heads_must_divide(world):
    # 4 query heads, 1 KV head (multi-query): the KV head cannot be split over 2 ranks.
    model = _build("llama", "eager", 0, num_key_value_heads=1)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"num_attention_heads=4 and num_key_value_heads=1 must both be divisible"):
        parallelize(model)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "a failed parallelize changed the model"
    assert not any(isinstance(m, ColumnParallelLinear) for m in model.modules())
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        parallelize(_build("llama", "eager", 0, num_attention_heads=6, num_key_value_heads=3, hidden_size=48))
    with pytest.raises(ValueError, match="no default tensor-parallel plan"):
        parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def _parallelize_body(rank, world, seed):
    # batch*seq = 3*6 = 18 rows, 9 a rank: rank 0's rows end mid-sequence (the hard case).
    check_model(rank, world, "llama", "eager", seed, batch=3, seq=6)
    check_model(rank, world, "llama", "sdpa", seed + 1, batch=2, seq=8, save_memory=True)
    check_model(rank, world, "qwen2", "sdpa", seed + 2, batch=1, seq=10)  # q/k/v biases
    if hasattr(transformers, "Qwen3Config"):  # transformers >= 4.51
        check_model(rank, world, "qwen3", "eager", seed + 3, batch=2, seq=5)  # per-head q/k norms
    check_model(rank, world, "mistral", "sdpa", seed + 4, batch=2, seq=4)
    check_heads_must_divide(world)


def test_parallelize_matches_unsharded_model():
    run_on_ranks(_parallelize_body, 2, random.randrange(1 << 30), backend="gloo")


def test_world_of_one_without_distributed():
    """No process group: parallelize only swaps in one-rank layers; the model is unchanged."""
    check_model(0, 1, "llama", "sdpa", random.randrange(1 << 30), batch=2, seq=5)
