"""TPLlama: a LLaMA-style decoder for tensor-parallel inference (the vLLM layout).

Every rank holds the whole activations [tokens, hidden] (replicated) and its share of the weights:

    embed_tokens      replicated
    per decoder layer
      input norm      replicated
      q/k/v           column-parallel: this rank's attention heads and KV heads, one fused local
                      GEMM (no communication)
      attention       this rank's heads over its KV heads (grouped-query attention keeps every
                      query head with its own KV head: heads split in contiguous blocks)
      o_proj          row-parallel: fluxtp.matmul_all_reduce (the sum over ranks)
      post norm       replicated
      gate/up         column-parallel: this rank's slice of the FFN, one fused local GEMM
      down_proj       row-parallel: fluxtp.matmul_all_reduce
    final norm        replicated
    lm_head           vocab-parallel: this rank's rows of the vocabulary, then an all-gather of
                      the logits, so that argmax sees the whole vocabulary, the same on every rank

So a layer communicates twice (two all-reduces) and the model once more (the logits), all of it
through the model's backend (its ops, and fluxtp.backends.collective for the gathers). A long
prefill (SEQUENCE_PARALLEL_MIN_TOKENS or more, a multiple of the world size) runs sequence
parallel instead, as Megatron's training layers do: each rank holds a contiguous block of the
flattened prompts' rows, norms it, and q/k/v and gate/up gather the rows inside their GEMM
(fluxtp.all_gather_matmul), o_proj and down_proj scatter them back (fluxtp.matmul_reduce_scatter):
the same bytes as the all-reduces, but both halves overlap a GEMM (an all-reduce after a GEMM
hides at most its reduce-scatter half). The math
is that of transformers' Llama/Mistral/Qwen2/Qwen3 (RMSNorm in float32, RoPE from the model's
own rotary embedding, so rope_theta and llama3 scaling come with it): greedy tokens match the
unsharded Hugging Face model.

Build one with `TPLlama.from_hf(model, group)` (copies this rank's slices of a loaded model),
`TPLlama.from_pretrained(path, group)` (a local checkpoint directory) or
`TPLlama.random_init(config, group)` (random weights at a config's dims, the same on every
rank). Then `allocate_cache`, `prefill`, `decode_step`, or `generate` (fluxtp/inference/generate.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fluxtp
from fluxtp import backends
from fluxtp._dist import resolve_group
from fluxtp.inference.kv_cache import StaticKVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# A prefill of fewer tokens is latency-bound: the all-reduce layout's two collectives a layer cost
# less than sequence parallelism's four.
SEQUENCE_PARALLEL_MIN_TOKENS = 1024

# A full weight of the unsharded model by its transformers parameter name, or None when the
# model has no such parameter (a bias it was built without).
WeightSource = Callable[[str], "torch.Tensor | None"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, step for step: normalize in float32, scale in x's dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, head_dim] at positions whose cos/sin are [S, head_dim] (the HF formula)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class Dims:
    """The model's sizes (whole model) and this rank's share of them."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    world: int

    @property
    def heads_local(self) -> int:
        return self.heads // self.world

    @property
    def kv_heads_local(self) -> int:
        return self.kv_heads // self.world

    @property
    def ffn_local(self) -> int:
        return self.ffn // self.world

    @property
    def vocab_local(self) -> int:
        """Rows of lm_head per rank: the vocabulary padded up to a multiple of the world size."""
        return -(-self.vocab // self.world)


def model_dims(config, world: int, num_layers: int | None = None) -> Dims:
    """Dims from a transformers config; ValueError (naming the counts) when they do not split."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"TPLlama supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r} "
            f"({type(config).__name__})"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % world or kv_heads % world:
        raise ValueError(
            f"attention heads do not divide over {world} ranks: num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} must both be divisible by the tensor-parallel world size {world}"
        )
    if config.intermediate_size % world:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} must be divisible by the tensor-parallel world size {world}"
        )
    layers = config.num_hidden_layers if num_layers is None else num_layers
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
    return Dims(
        hidden=config.hidden_size,
        ffn=config.intermediate_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
        layers=layers,
        world=world,
    )


@dataclass
class LayerShard:
    """One decoder layer's weights on this rank (nn.Linear layout [out, in]; biases may be None)."""

    input_norm: torch.Tensor  # [H]
    qkv_weight: torch.Tensor  # [(heads_local + 2 kv_heads_local) * head_dim, H]: q, k, v rows
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim], Qwen3's per-head norms before RoPE
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor  # [H, heads_local * head_dim]
    o_bias: torch.Tensor | None  # [H], added once after the sum
    post_norm: torch.Tensor  # [H]
    gate_up_weight: torch.Tensor  # [2 * ffn_local, H]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor  # [H, ffn_local]
    down_bias: torch.Tensor | None


class TPLlama:
    """A LLaMA-style causal LM sharded over a tensor-parallel group (see the module docstring).

    `backend` ("auto", "fused", "nccl", "torch" or a registered one, fluxtp.backends), which
    every communication of the model runs through (the row-parallel layers' sums, the logits
    gather), may be changed; it is used from the next call on (a captured CUDA graph keeps the
    one it was captured with).
    """

    def __init__(
        self,
        config,
        source: WeightSource,
        rotary_emb,
        group=None,
        *,
        num_layers: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str = "auto",
    ):
        """Copy this rank's slices of the weights `source` returns; use the classmethods instead."""
        self.info = resolve_group(group)
        self.dims = dims = model_dims(config, self.info.world_size, num_layers)
        self.config, self.dtype, self.device, self.backend = config, dtype, torch.device(device), backend
        # Prefill rows from which the layers run sequence parallel (module docstring); another
        # value moves the switch (benchmarks/prefill_layouts.py times both layouts).
        self.sequence_parallel_min_tokens = SEQUENCE_PARALLEL_MIN_TOKENS
        self.eps = config.rms_norm_eps
        self.scaling = dims.head_dim**-0.5
        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]
        # The model's own rotary embedding (rope_theta, scaling type and attention_scaling); a
        # copy, never cast: its inv_freq keeps the precision the model computes it in.
        self.rotary_emb = copy.deepcopy(rotary_emb).to(self.device)
        self._build(source)
        self.cache: StaticKVCache | None = None
        self.rope_cos = self.rope_sin = None
        self.decode_graphs: dict = {}  # fluxtp/inference/generate.py keeps captured steps here

    # ------------------------------------------------------------ construction

    @classmethod
    def from_hf(cls, model, group=None, *, num_layers=None, dtype=None, device=None, backend="auto") -> TPLlama:
        """This rank's shard of a transformers LlamaForCausalLM-like model (Llama, Mistral, Qwen2,
        Qwen3), its weights copied (the model is left as it was). dtype and device default to the
        model's; num_layers keeps only the first layers."""

        def source(name: str):
            try:
                return model.get_parameter(name).detach()
            except AttributeError:  # e.g. a bias the model was built without
                return None

        embed = model.get_input_embeddings().weight
        inner = getattr(model, "model", model)
        if not hasattr(inner, "rotary_emb"):
            raise ValueError(f"{type(model).__name__} has no model.rotary_emb: not a transformers Llama-style model")
        return cls(
            model.config,
            source,
            inner.rotary_emb,
            group,
            num_layers=num_layers,
            dtype=dtype or embed.dtype,
            device=device or embed.device,
            backend=backend,
        )

    @classmethod
    def from_pretrained(
        cls, path, group=None, *, dtype=torch.bfloat16, device=None, backend="auto", num_layers=None
    ) -> TPLlama:
        """Load a local Hugging Face checkpoint directory with transformers (on CPU, every rank the
        whole model), then keep this rank's shard on `device` (default: the current CUDA device,
        else CPU)."""
        import transformers
        from transformers import AutoModelForCausalLM

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        # transformers 4.56 renamed torch_dtype= to dtype= (the old name warns in 5.x)
        version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
        dtype_kwarg = "dtype" if version >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kwarg: dtype})
        return cls.from_hf(model, group, num_layers=num_layers, dtype=dtype, device=device, backend=backend)

    @classmethod
    def random_init(
        cls,
        config,
        group=None,
        *,
        num_layers=None,
        dtype=torch.bfloat16,
        device="cpu",
        backend="auto",
        seed: int = 0,
    ) -> TPLlama:
        """Random weights at a transformers config's dims, for benchmarks without checkpoints.

        Every rank draws the same full tensors from `seed` on `device` and keeps its slices, so the
        model is the same whatever the world size: matrices normal(0, config.initializer_range),
        norm weights 1, biases 0 (transformers' own init). num_layers builds only the first layers.
        """
        from transformers import AutoModelForCausalLM

        model_dims(config, resolve_group(group).world_size, num_layers)  # clear errors before any drawing
        config = copy.deepcopy(config)
        if num_layers is not None:
            config.num_hidden_layers = num_layers
        with torch.device("meta"):  # names, shapes and ties of the parameters, without memory
            skeleton = AutoModelForCausalLM.from_config(config)
        generator = torch.Generator(device=device).manual_seed(seed)
        std = getattr(config, "initializer_range", 0.02)
        drawn: dict[int, torch.Tensor] = {}  # by parameter identity: a tied lm_head is the embedding

        def source(name: str):
            try:
                param = skeleton.get_parameter(name)
            except AttributeError:
                return None
            if id(param) not in drawn:
                if param.dim() >= 2:
                    t = torch.randn(param.shape, generator=generator, dtype=dtype, device=device).mul_(std)
                elif name.endswith("norm.weight"):
                    t = torch.ones(param.shape, dtype=dtype, device=device)
                else:
                    t = torch.zeros(param.shape, dtype=dtype, device=device)
                # Only the embedding is asked for twice (tied lm_head); nothing else is kept.
                if name == "model.embed_tokens.weight":
                    drawn[id(param)] = t
                return t
            return drawn[id(param)]

        with torch.device(device):
            rotary_emb = type(skeleton.model.rotary_emb)(config=config)
        return cls(config, source, rotary_emb, group, dtype=dtype, device=device, backend=backend)

    def _build(self, source: WeightSource) -> None:
        """Copy this rank's blocks of every weight (always in the same order on every rank)."""
        d, rank = self.dims, self.info.rank

        def take(name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
            full = source(name)
            if full is None:
                return None
            block = full if rows is None else full[rows[0] : rows[1]]
            block = block if cols is None else block[:, cols[0] : cols[1]]
            out = torch.empty(block.shape, dtype=self.dtype, device=self.device)
            return out.copy_(block)

        def cat(*parts):
            return None if parts[0] is None else torch.cat(parts)

        def own(size_local: int) -> tuple[int, int]:  # this rank's contiguous block
            return rank * size_local, (rank + 1) * size_local

        q_rows = own(d.heads_local * d.head_dim)
        kv_rows = own(d.kv_heads_local * d.head_dim)
        ffn_rows = own(d.ffn_local)
        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(d.layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = [(attn + f"{n}_proj", r) for n, r in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
            self.layers.append(
                LayerShard(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv_weight=cat(*(take(n + ".weight", rows=r) for n, r in qkv)),
                    qkv_bias=cat(*(take(n + ".bias", rows=r) for n, r in qkv)),
                    q_norm=take(attn + "q_norm.weight"),
                    k_norm=take(attn + "k_norm.weight"),
                    o_weight=take(attn + "o_proj.weight", cols=q_rows),
                    o_bias=take(attn + "o_proj.bias"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_weight=cat(
                        take(mlp + "gate_proj.weight", rows=ffn_rows), take(mlp + "up_proj.weight", rows=ffn_rows)
                    ),
                    gate_up_bias=cat(
                        take(mlp + "gate_proj.bias", rows=ffn_rows), take(mlp + "up_proj.bias", rows=ffn_rows)
                    ),
                    down_weight=take(mlp + "down_proj.weight", cols=ffn_rows),
                    down_bias=take(mlp + "down_proj.bias"),
                )
            )
        self.norm = take("model.norm.weight")
        # Vocab-parallel head: rows [rank * V_local, (rank + 1) * V_local), the last rank's block
        # padded with zero rows up to V_local (cut off again after the gather).
        start, stop = own(d.vocab_local)
        stop = min(stop, d.vocab)
        self.lm_head = torch.zeros(d.vocab_local, d.hidden, dtype=self.dtype, device=self.device)
        if stop > start:
            self.lm_head[: stop - start].copy_(take("lm_head.weight", rows=(start, stop)))
        missing = [n for n, t in (("embed_tokens", self.embed), ("norm", self.norm)) if t is None]
        if missing:
            raise ValueError(f"the model has no {', '.join(missing)} weight where a Llama-style model has it")

    # ------------------------------------------------------------ cache

    def sliding_window(self) -> int | None:
        """The attention window the model uses, if any (Mistral; Qwen2 with use_sliding_window)."""
        if getattr(self.config, "use_sliding_window", True) is False:
            return None
        return getattr(self.config, "sliding_window", None)

    def allocate_cache(self, max_batch: int, max_len: int) -> StaticKVCache:
        """A new static KV cache for up to max_batch sequences of max_len tokens (prompt and
        generated), and the RoPE tables for those positions; drops captured decode graphs."""
        window = self.sliding_window()
        if window is not None and max_len > window:
            raise ValueError(
                f"max_len={max_len} exceeds the model's sliding_window={window}: TPLlama attends to every "
                "cached position and has no sliding-window attention"
            )
        d = self.dims
        self.decode_graphs.clear()
        self.cache = None  # free the old cache before allocating the new one
        self.cache = StaticKVCache(
            d.layers, max_batch, max_len, d.kv_heads_local, d.head_dim, dtype=self.dtype, device=self.device
        )
        positions = torch.arange(self.cache.max_len, device=self.device)[None]
        # The model's rotary embedding evaluated once per position: the same values HF computes per call.
        cos, sin = self.rotary_emb(self.embed, positions)
        self.rope_cos, self.rope_sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cache

    def _require_cache(self, batch: int, seq: int) -> StaticKVCache:
        cache = self.cache
        if cache is None:
            raise RuntimeError("no KV cache: call allocate_cache(max_batch, max_len) first")
        if batch > cache.max_batch or seq > cache.max_len:
            raise ValueError(
                f"batch {batch} x {seq} tokens do not fit the KV cache of {cache.max_batch} x {cache.max_len}; "
                "allocate_cache a larger one"
            )
        return cache

    # ------------------------------------------------------------ forward

    def sequence_parallel(self, tokens: int) -> bool:
        """Whether a prefill of `tokens` rows in all runs sequence parallel (module docstring)."""
        world = self.dims.world
        return world > 1 and tokens >= self.sequence_parallel_min_tokens and tokens % world == 0

    def _column(self, x: torch.Tensor, weight, bias, sequence_parallel: bool) -> torch.Tensor:
        """A column-parallel GEMM of every row: the row blocks gathered inside it when sequence parallel."""
        if sequence_parallel:
            return fluxtp.all_gather_matmul(x, weight, group=self.info.group, bias=bias, backend=self.backend)
        return F.linear(x, weight, bias)

    def _row(self, x: torch.Tensor, weight, bias, sequence_parallel: bool) -> torch.Tensor:
        """A row-parallel GEMM summed over the ranks: into this rank's row block when sequence parallel."""
        op = fluxtp.matmul_reduce_scatter if sequence_parallel else fluxtp.matmul_all_reduce
        return op(x, weight, group=self.info.group, bias=bias, backend=self.backend)

    def _layers(self, h: torch.Tensor, batch: int, seq: int, cos, sin, attend, sequence_parallel=False) -> torch.Tensor:
        """h [batch*seq, H] (sequence parallel: this rank's block of those rows) through every layer;
        attend(layer, q, k, v) -> [B, heads_local, S, head_dim] with q [B, heads_local, S, d] and
        k, v [B, kv_heads_local, S, d] (RoPE applied), every row."""
        d, sp = self.dims, sequence_parallel
        q_size, kv_size = d.heads_local * d.head_dim, d.kv_heads_local * d.head_dim
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.eps)
            q, k, v = self._column(x, layer.qkv_weight, layer.qkv_bias, sp).split((q_size, kv_size, kv_size), dim=-1)
            q = q.view(batch, seq, d.heads_local, d.head_dim)
            k = k.view(batch, seq, d.kv_heads_local, d.head_dim)
            v = v.view(batch, seq, d.kv_heads_local, d.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            out = out.transpose(1, 2).reshape(batch * seq, q_size)
            h = h + self._row(out, layer.o_weight, layer.o_bias, sp)
            x = rms_norm(h, layer.post_norm, self.eps)
            gate, up = self._column(x, layer.gate_up_weight, layer.gate_up_bias, sp).chunk(2, dim=-1)
            h = h + self._row(self.act(gate) * up, layer.down_weight, layer.down_bias, sp)
        return h

    def _last_rows(self, h: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Each prompt's last row [B, H] from the sequence-parallel row blocks h (rank r holds rows
        r*n .. r*n+n-1 of the flattened prompts): every rank's candidates gathered, the holder's kept."""
        n = h.shape[0]
        last = torch.arange(1, batch + 1, device=h.device) * seq - 1
        candidates = h.index_select(0, (last - self.info.rank * n).clamp(0, n - 1))
        gathered = backends.collective("gather_rows", self.backend)(candidates, self.info)  # [W * B, H]
        return gathered.view(self.dims.world, batch, -1)[last // n, torch.arange(batch, device=h.device)]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and the vocab-parallel head: h [B, H] -> logits [B, vocab], the same on every rank."""
        d = self.dims
        local = F.linear(rms_norm(h, self.norm, self.eps), self.lm_head)  # [B, V_local]
        if d.world == 1:
            return local[:, : d.vocab]
        gathered = backends.collective("gather_rows", self.backend)(local, self.info)  # [W * B, V_local]
        # [W, B, V_local] (rank-major) -> [B, W * V_local]: rank r's block is vocab ids r*V_local...
        logits = gathered.view(d.world, -1, d.vocab_local).transpose(0, 1).reshape(-1, d.world * d.vocab_local)
        return logits[:, : d.vocab]

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run prompts tokens [B, S] (one length, no padding) from position 0, filling the cache.

        Resets the cache to these B sequences (its length becomes S) and returns the logits of
        each prompt's last token, [B, vocab]: the first generated token is their argmax. Attention
        is causal over the prompt itself (flash/efficient kernels), then keys and values are stored.
        B * S rows run sequence parallel where sequence_parallel(B * S) says.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq] token ids, got shape {tuple(tokens.shape)}")
        batch, seq = tokens.shape
        cache = self._require_cache(batch, seq)
        d = self.dims

        def attend(i, q, k, v):
            cache.fill(i, k, v)
            grouped = d.heads_local != d.kv_heads_local
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=grouped)

        rows = tokens.reshape(-1)
        sp = self.sequence_parallel(rows.numel())
        if sp:  # this rank's block of the rows
            block = rows.numel() // d.world
            rows = rows[self.info.rank * block : (self.info.rank + 1) * block]
        h = self._layers(F.embedding(rows, self.embed), batch, seq, self.rope_cos[:seq], self.rope_sin[:seq], attend, sp)
        cache.reset(seq)
        return self._logits(self._last_rows(h, batch, seq) if sp else h.view(batch, seq, -1)[:, -1])

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, advance: bool = True) -> torch.Tensor:
        """One token per sequence, tokens [B] at position cache.length; returns logits [B, vocab].

        Writes the tokens' keys and values at that position and attends over the whole static
        cache with a length mask (fixed shapes, no host synchronization: CUDA-graph capturable).
        advance=True moves cache.length on by one (on the device); the caller keeps
        length < max_len (generate checks it before it starts).
        """
        if tokens.dim() == 2 and tokens.shape[1] == 1:
            tokens = tokens[:, 0]
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be [batch] token ids (one per sequence), got shape {tuple(tokens.shape)}")
        batch = tokens.shape[0]
        cache = self._require_cache(batch, 1)
        d = self.dims
        group_size = d.heads_local // d.kv_heads_local
        mask = cache.decode_mask()
        position = cache.length

        def attend(i, q, k, v):
            keys, values = cache.append(i, k, v)
            # The query heads of one KV head (consecutive, as in HF's repeat_kv) become that head's
            # `group_size` query rows: plain attention over the cache, no copy of the keys per head.
            q = q.reshape(batch, d.kv_heads_local, group_size, d.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            return out.reshape(batch, d.heads_local, 1, d.head_dim)

        h = F.embedding(tokens, self.embed)
        cos, sin = self.rope_cos.index_select(0, position), self.rope_sin.index_select(0, position)
        h = self._layers(h, batch, 1, cos, sin, attend)
        logits = self._logits(h)
        if advance:
            cache.advance()
        return logits

    def generate(self, prompt_tokens: torch.Tensor, max_new_tokens: int, *, cuda_graph: bool = True, **kwargs):
        """Greedy generation of exactly max_new_tokens tokens per prompt (no stop at an end-of-sequence
        token); see fluxtp.inference.generate.generate."""
        from fluxtp.inference.generate import generate

        return generate(self, prompt_tokens, max_new_tokens, cuda_graph=cuda_graph, **kwargs)
