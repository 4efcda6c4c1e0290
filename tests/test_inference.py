"""fluxtp.inference on CPU: TPLlama sharded over a gloo world of 2 (one spawn for every case) and
in a world of one, against the unsharded transformers model's own greedy generation.

Each rank builds the full float64 model from one seed, shards it with TPLlama.from_hf (or loads
a checkpoint directory with from_pretrained) and generates; HF generates from the same model.
Tokens must be identical, every step's logits equal within TOLERANCE.
"""

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import transformers

import fluxtp
from fluxtp.bench import NO_COMM  # registers the benchmark's backends
from fluxtp.inference import TPLlama
from fluxtp.inference.model import SEQUENCE_PARALLEL_MIN_TOKENS
from fluxtp.testing import run_on_ranks
from tests._cases import rel_error

# Normwise relative error of the logits against HF in float64. The sharded model sums the same
# products in another order (all-reduce of rank partials, fused q/k/v and gate/up GEMMs), a few
# ulps (1e-16) per layer; measured ~1e-15 through 2 layers. A wrong head, KV group, position or
# vocabulary block is off by O(1).
TOLERANCE = 1e-10
# transformers' generate hands out each step's logits rounded to float32: against those, a few
# float32 unit roundoffs (2^-24 each).
GENERATE_LOGITS_TOLERANCE = 4 * 2**-24
NEW_TOKENS = 16

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per KV head
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    # llama3 RoPE scaling that really moves the frequencies at these sizes (head_dim 16: the
    # slowest wavelengths exceed original_max_position_embeddings / low_freq_factor)
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def build(family="llama", seed=0, **overrides):
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[family]
    config_cls, model_cls = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    settings = {**TINY, **overrides}
    if family != "llama":
        settings.pop("rope_scaling")
    config = config_cls(**settings, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = model_cls(config).double().eval()
    # Random norms and biases: at their init (ones, zeros) a wrong slice would go unseen.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def hf_greedy(model, prompts, new_tokens=NEW_TOKENS):
    """transformers' own greedy generation: (tokens [B, n], logits [B, n, vocab])."""
    model.generation_config.eos_token_id = None  # exactly new_tokens tokens, as TPLlama.generate
    out = model.generate(
        prompts,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, prompts.shape[1] :], torch.stack(out.logits, dim=1)


def prompts_for(seed, batch, seq, vocab):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def check_generation(tp, model, prompts, tag, *, hf=None):
    ref_tokens, ref_logits = hf if hf is not None else hf_greedy(model, prompts)
    tokens, logits = tp.generate(prompts, NEW_TOKENS, return_logits=True)
    assert tokens.shape == ref_tokens.shape, f"{tag}: tokens {tuple(tokens.shape)} vs HF {tuple(ref_tokens.shape)}"
    assert torch.equal(tokens, ref_tokens), f"{tag}: greedy tokens differ from HF\n{tokens}\n{ref_tokens}"
    err = rel_error(logits, ref_logits)
    assert err <= GENERATE_LOGITS_TOLERANCE, f"{tag}: logits of the {NEW_TOKENS} steps rel err {err:.2e}"
    first = tp.prefill(prompts)  # prefill alone: the logits of each prompt's last token
    with torch.no_grad():
        ref_first = model(input_ids=prompts).logits[:, -1]  # float64, unlike generate's
    err = rel_error(first, ref_first)
    assert err <= TOLERANCE, f"{tag}: prefill logits rel err {err:.2e}"


def check_llama_gqa(world, seed):
    model = build("llama", seed)
    tp = TPLlama.from_hf(model)
    assert tp.dims.heads_local == 4 // world and tp.dims.kv_heads_local == 2 // world
    check_generation(tp, model, prompts_for(seed, 3, 7, 128), f"llama GQA W={world}")
    max_len = tp.cache.max_len
    # Fresh prompts of another shape in the same (larger) cache: fewer sequences, a shorter prompt,
    # so the decode mask must hide slots left from the first call.
    check_generation(tp, model, prompts_for(seed + 1, 2, 4, 128), f"llama GQA W={world}, smaller batch")
    assert tp.cache.max_len == max_len, "a fitting cache was reallocated"
    return model


def check_qwen2_biases_tied_odd_vocab(world, seed):
    # q/k/v biases, all heads with their own KV head, lm_head tied to the embedding, and a
    # vocabulary that does not split evenly (the last rank's block is padded).
    model = build("qwen2", seed, num_key_value_heads=4, vocab_size=127, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tp = TPLlama.from_hf(model)
    assert tp.lm_head.shape == (-(-127 // world), 64)
    check_generation(tp, model, prompts_for(seed, 2, 5, 127), f"qwen2 W={world}")


def check_heads_must_divide(world):
    if world == 1:
        return
    with pytest.raises(ValueError, match=r"num_attention_heads=4 and num_key_value_heads=1 must both be divisible"):
        TPLlama.from_hf(build("llama", 0, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"num_attention_heads=3 and num_key_value_heads=3 .* world size 2"):
        TPLlama.random_init(
            transformers.LlamaConfig(**{**TINY, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3})
        )


def check_random_init_is_one_model(rank, world, seed):
    """random_init over the group equals random_init in a world of one (the same seed): the
    ranks draw the same full weights and keep matching slices."""
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3})
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    kwargs = {"num_layers": 2, "dtype": torch.float64, "seed": seed}
    sharded = TPLlama.random_init(config, **kwargs)
    whole = TPLlama.random_init(config, singles[rank], **kwargs)
    assert whole.dims.world == 1 and sharded.dims.world == world and len(sharded.layers) == 2
    prompts = prompts_for(seed, 2, 6, 128)
    tokens, logits = sharded.generate(prompts, 8, return_logits=True)
    ref_tokens, ref_logits = whole.generate(prompts, 8, return_logits=True)
    assert torch.equal(tokens, ref_tokens)
    assert rel_error(logits, ref_logits) <= TOLERANCE


def check_from_pretrained(rank, model, checkpoint, seed):
    if rank == 0:
        model.save_pretrained(checkpoint)
    dist.barrier()
    tp = TPLlama.from_pretrained(checkpoint, dtype=torch.float64, device="cpu")
    assert tp.dtype == torch.float64
    check_generation(tp, model, prompts_for(seed + 2, 2, 5, 128), "from_pretrained")


@contextlib.contextmanager
def calls_to(module, names):
    """The names of `module`'s functions `names` (those it has) called inside the block, in order;
    each still runs."""
    calls, originals = [], {name: getattr(module, name) for name in names if hasattr(module, name)}
    for name, original in originals.items():
        setattr(module, name, lambda *a, _name=name, _original=original, **k: calls.append(_name) or _original(*a, **k))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor")


def check_no_comm_backend_issues_no_collective(model, seed):
    """On the benchmark's no_comm backend every collective of the model goes: the same shapes, no
    collective (so the model's communication all runs through its backend)."""
    tp = TPLlama.from_hf(model)
    tp.allocate_cache(2, 8)
    prompts = prompts_for(seed, 2, 6, 128)
    with calls_to(dist, COLLECTIVES) as calls:
        ref = tp.prefill(prompts), tp.decode_step(prompts[:, -1])
        assert calls, "the counters see no collective of the communicating model"
        calls.clear()
        tp.backend = NO_COMM
        local = tp.prefill(prompts), tp.decode_step(prompts[:, -1])
        assert calls == [], f"backend {NO_COMM!r} still called {calls}"
    for out, want in zip(local, ref):
        assert out.shape == want.shape and torch.isfinite(out).all()


SHARDED_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def check_long_prefill_runs_sequence_parallel(world, model, seed):
    """A prefill of SEQUENCE_PARALLEL_MIN_TOKENS rows runs sequence parallel: every layer's GEMMs
    through all_gather_matmul and matmul_reduce_scatter, no all-reduce; and still matches HF."""
    prompts = prompts_for(seed, 32, SEQUENCE_PARALLEL_MIN_TOKENS // 32, 128)
    tp = TPLlama.from_hf(model)
    assert tp.sequence_parallel(prompts.numel()) == (world > 1)
    assert not tp.sequence_parallel(prompts.numel() - 1) and not tp.sequence_parallel(prompts.numel() + world - 1)
    tp.allocate_cache(32, prompts.shape[1])
    with calls_to(fluxtp, SHARDED_OPS) as calls:
        tp.prefill(prompts)
    layers = len(tp.layers)
    counts = collections.Counter(calls)
    assert counts == {"all_gather_matmul": 2 * layers, "matmul_reduce_scatter": 2 * layers}, counts
    tag = f"llama W={world}, {prompts.numel()} prompt tokens sequence parallel"
    with torch.no_grad():
        err = rel_error(tp.prefill(prompts), model(input_ids=prompts).logits[:, -1])
        assert err <= TOLERANCE, f"{tag}: prefill logits rel err {err:.2e}"
        # Against HF's forward over prompt and generated tokens: at 32 sequences transformers'
        # generate drifts from that forward by 2-3% of the logits here (TPLlama: 1e-16).
        tokens, logits = tp.generate(prompts, NEW_TOKENS, return_logits=True)
        ref = model(input_ids=torch.cat([prompts, tokens[:, :-1]], dim=1)).logits[:, prompts.shape[1] - 1 :]
    err = rel_error(logits, ref)
    assert err <= TOLERANCE and torch.equal(tokens, ref.argmax(-1)), f"{tag}: generated logits rel err {err:.2e}"


def _sharded_body(rank, world, seed, checkpoint):
    llama = check_llama_gqa(world, seed)
    check_long_prefill_runs_sequence_parallel(world, llama, seed + 30)
    check_qwen2_biases_tied_odd_vocab(world, seed + 10)
    check_heads_must_divide(world)
    check_random_init_is_one_model(rank, world, seed + 20)
    check_from_pretrained(rank, llama, checkpoint, seed)
    check_no_comm_backend_issues_no_collective(llama, seed)


def test_sharded_greedy_matches_hf(tmp_path):
    run_on_ranks(_sharded_body, 2, 1234, str(tmp_path / "checkpoint"), backend="gloo", timeout_s=240)


def test_world_of_one_matches_hf():
    check_llama_gqa(1, 99)


def test_cache_and_input_errors():
    tp = TPLlama.from_hf(build("llama", 3))
    prompts = prompts_for(0, 2, 5, 128)
    with pytest.raises(RuntimeError, match="no KV cache"):
        tp.prefill(prompts)
    tp.allocate_cache(2, 8)
    assert tp.cache.max_len == 16  # rounded up to whole 16-position blocks
    with pytest.raises(ValueError, match=r"batch 3 x 5 tokens do not fit the KV cache of 2 x 16"):
        tp.prefill(prompts_for(0, 3, 5, 128))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\]"):
        tp.prefill(prompts[0])
    tp.prefill(prompts)
    assert tp.cache.length.item() == 5
    logits = tp.decode_step(torch.tensor([1, 2]), advance=False)
    assert logits.shape == (2, 128) and tp.cache.length.item() == 5
    tp.decode_step(torch.tensor([[1], [2]]))
    assert tp.cache.length.item() == 6
    with pytest.raises(ValueError, match="sliding_window=8"):
        TPLlama.from_hf(build("mistral", 0, sliding_window=8)).allocate_cache(1, 9)
    with pytest.raises(ValueError, match="supports model_type"):
        TPLlama.random_init(transformers.GPT2Config())
