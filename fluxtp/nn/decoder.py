"""`parallelize(model, group)`: tensor + sequence parallelism for a LLaMA-style decoder, in place.

What it does to a Hugging Face transformers Llama / Mistral / Qwen2 / Qwen3 model (the default
plan; another model with the same structure can pass its own `TensorParallelPlan`):

    embed_tokens                    replicated, full [B, S, H]
    -- scatter_tokens --            before the first decoder layer: [B, S, H] -> rows [B*S/W, H]
    per decoder layer (sequence-parallel region: residual stream and norms on row shards)
      input_layernorm               on rows, weight replicated (gradient summed over the group)
      q/k/v_proj                    ColumnParallelLinear: rows -> all tokens, local heads (the
                                    three share one all-gather, fused with q's GEMM)
      attention                     on the full sequences, this rank's heads (and KV heads)
      o_proj                        RowParallelLinear: local heads -> rows (reduce-scatter)
      post_attention_layernorm      on rows
      gate/up_proj, down_proj       ColumnParallelLinear (sharing one all-gather), RowParallelLinear
    final norm                      on rows
    -- gather_tokens --             on the base model's output: rows -> [B, S, H]
    lm_head, loss                   replicated (identical on every rank)

RoPE and masks: the base model computes position ids, the causal mask and the rotary cos/sin
from the full-sequence embeddings *before* the scatter (the scatter sits in front of the first
layer, not at the embedding output), and passes the same full-sequence cos/sin and mask to
every layer. The attention's input is gathered back to all tokens by q/k/v, so those apply
unchanged; the attention forward is replaced by one that takes row-shard input and learns the
sequence length from cos/sin ([.., S, head_dim]). Rows are the batch-major flattened tokens, so
W must divide B*S (not S): a rank's rows may span sequences.

Caveats: hidden states captured with output_hidden_states are row shards; use_cache/generation
works per rank on its local heads but is not what this is for.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from fluxtp._dist import resolve_group
from fluxtp.nn.linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from fluxtp.nn.sequence import gather_tokens, scatter_tokens, sum_grads_over_group, track_backend
from fluxtp.ops._validate import check_backend

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TensorParallelPlan:
    """Where the parts of a decoder are, as dotted module paths.

    `layers`, `final_norm` and `sequence_output` are paths from the model root; the others
    are paths inside one decoder layer.
    """

    layers: str = "model.layers"  # the ModuleList of decoder layers
    column: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    row: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    attention: str = "self_attn"  # gets local head counts and the sequence-parallel forward
    # A gated MLP (gate_proj, up_proj, down_proj, act_fn) whose forward is replaced so that gate
    # and up share one all-gather; None keeps the model's own forward (one gather per layer).
    mlp: str | None = "mlp"
    # Replicated parameters that each rank applies to part of the data (its rows, or its heads
    # for per-head q/k norms): their gradients are summed over the group.
    replicated: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    final_norm: str | None = "model.norm"
    sequence_output: str = "model"  # the module whose output (last_hidden_state) is gathered


def default_plan(model: nn.Module) -> TensorParallelPlan:
    """The plan for a transformers *ForCausalLM or base model of a supported family."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"no default tensor-parallel plan for {type(model).__name__} (model_type={model_type!r}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}. Pass plan=TensorParallelPlan(...) for others"
        )
    inner = getattr(model, "model", None)
    prefix = "model." if isinstance(inner, nn.Module) and hasattr(inner, "layers") else ""
    replicated = TensorParallelPlan.replicated
    if model_type == "qwen3":
        replicated += ("self_attn.q_norm", "self_attn.k_norm")
    return TensorParallelPlan(
        layers=prefix + "layers",
        replicated=replicated,
        final_norm=prefix + "norm",
        sequence_output=prefix.rstrip("."),
    )


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent_path), name, module)


def _head_counts(model: nn.Module, world: int) -> tuple[int, int]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"{type(model).__name__} has no config.num_attention_heads: parallelize needs the head counts")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % world or kv_heads % world:
        raise ValueError(
            f"attention heads do not divide over {world} ranks: num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} must both be divisible by the tensor-parallel world size {world}"
        )
    return heads, kv_heads


def _validate(model: nn.Module, plan: TensorParallelPlan, world: int) -> nn.ModuleList:
    """Every check before anything is changed, so a failure leaves the model as it was."""
    _head_counts(model, world)
    layers = model.get_submodule(plan.layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"plan.layers={plan.layers!r} must name a non-empty nn.ModuleList, got {type(layers).__name__}"
        )
    for i, layer in enumerate(layers):
        for path, sharded in [(p, "out_features") for p in plan.column] + [(p, "in_features") for p in plan.row]:
            linear = layer.get_submodule(path)
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{plan.layers}.{i}.{path} must be an nn.Linear, got {type(linear).__name__}")
            if getattr(linear, sharded) % world:
                raise ValueError(
                    f"{plan.layers}.{i}.{path}: {sharded}={getattr(linear, sharded)} must be divisible by the "
                    f"tensor-parallel world size {world}"
                )
        attn = layer.get_submodule(plan.attention)
        model_file = sys.modules.get(type(attn).__module__)
        missing = [
            a for a in ("head_dim", "scaling", "config", "q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, a)
        ]
        missing += [f for f in ("apply_rotary_pos_emb", "eager_attention_forward") if not hasattr(model_file, f)]
        if missing:
            raise ValueError(
                f"{plan.layers}.{i}.{plan.attention} ({type(attn).__name__}) is not a transformers "
                f"Llama-style attention: it lacks {', '.join(missing)}"
            )
        for path in plan.replicated:
            layer.get_submodule(path)
        if plan.mlp is not None:
            mlp = layer.get_submodule(plan.mlp)
            missing = [a for a in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, a)]
            if missing:
                raise ValueError(
                    f"{plan.layers}.{i}.{plan.mlp} ({type(mlp).__name__}) is not a gated MLP: it lacks "
                    f"{', '.join(missing)} (set plan.mlp=None to keep its own forward)"
                )
    for path in (plan.final_norm, plan.sequence_output):
        if path is not None:
            model.get_submodule(path)
    return layers


def _sequence_parallel_attention_forward(
    self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs
):
    """The transformers Llama/Mistral/Qwen attention forward, taking row-shard input.

    hidden_states: [T/W, H], this rank's rows of the flattened [B*S, H] activations.
    position_embeddings: (cos, sin) of the full sequence, [B or 1, S, head_dim].
    Returns (out_shard [T/W, H], attention weights or None).
    """
    if position_embeddings is None:
        raise ValueError("sequence-parallel attention needs position_embeddings (cos, sin) computed by the model")
    past_key_values = past_key_values if past_key_values is not None else kwargs.pop("past_key_value", None)
    cos, sin = position_embeddings
    seq_len = cos.shape[-2]
    hf = sys.modules[type(self).__module__]  # the model file's own rope/attention functions

    # [T, heads_local * head_dim] each: all tokens, local heads; one all-gather for the three.
    query, key, value = column_parallel_linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
    tokens = query.shape[0]
    if tokens % seq_len:
        raise ValueError(f"{tokens} tokens are not a whole number of sequences of length {seq_len}")
    full_shape = (tokens // seq_len, seq_len, -1, self.head_dim)
    query, key, value = query.view(full_shape), key.view(full_shape), value.view(full_shape)
    if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    query, key = hf.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = self.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, hf.eager_attention_forward)
    else:
        attention = hf.eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    if hasattr(self, "sliding_window"):  # Qwen2/Qwen3 per layer; Mistral from its config
        kwargs["sliding_window"] = self.sliding_window
    elif getattr(self.config, "sliding_window", None) is not None:
        kwargs["sliding_window"] = self.config.sliding_window
    attn_output, attn_weights = attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(tokens, -1)  # [B*S, heads_local * head_dim], batch-major rows
    return self.o_proj(attn_output), attn_weights


def _sequence_parallel_mlp_forward(self, x_shard):
    """Gated MLP on row shards [T/W, H] -> [T/W, H]; gate and up share one all-gather."""
    gate, up = column_parallel_linears(x_shard, (self.gate_proj, self.up_proj))  # [T, ffn/W] each
    return self.down_proj(self.act_fn(gate) * up)


class _ScatterBeforeFirstLayer:
    """Forward pre-hook of the first decoder layer: its hidden states -> this rank's rows."""

    def __init__(self, group, backend: str):
        self.group, self.backend = group, backend

    def __call__(self, module, args, kwargs):
        if args:
            return (scatter_tokens(args[0], self.group, backend=self.backend), *args[1:]), kwargs
        hidden = scatter_tokens(kwargs["hidden_states"], self.group, backend=self.backend)
        return args, dict(kwargs, hidden_states=hidden)


def _token_shape(args, kwargs) -> tuple[int, int]:
    """(batch, seq) of a base-model call, from input_ids [B, S] or inputs_embeds [B, S, H]."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        return tuple(ids.shape[:2])
    return tuple(kwargs["inputs_embeds"].shape[:2])


class _GatherModelOutput:
    """Forward hook of the base model: its output rows -> the full [batch, seq, hidden]."""

    def __init__(self, group, backend: str):
        self.group, self.backend = group, backend

    def __call__(self, module, args, kwargs, output):
        batch, seq = _token_shape(args, kwargs)
        if isinstance(output, tuple):
            rows = gather_tokens(output[0], self.group, backend=self.backend)
            return (rows.view(batch, seq, -1), *output[1:])
        rows = gather_tokens(output.last_hidden_state, self.group, backend=self.backend)
        output.last_hidden_state = rows.view(batch, seq, -1)
        return output


def parallelize(
    model: nn.Module,
    group=None,
    plan: TensorParallelPlan | None = None,
    *,
    backend: str = "auto",
    save_memory: bool = False,
    fp8: bool = False,
) -> nn.Module:
    """Apply tensor + sequence parallelism to a LLaMA-style decoder, in place.

    Args:
        model: a transformers Llama/Mistral/Qwen2/Qwen3 *ForCausalLM or base model (or any model
            matching `plan`), the same weights on every rank of `group` (seed identically).
        group: the tensor-parallel process group (default: the world).
        plan: where the parts are; default `default_plan(model)`.
        backend: what every communication of the model runs through (the parallel linears, the
            token scatter and gather, the gradient sums): "auto", "fused", "nccl", "torch" or a
            registered one (fluxtp.backends); `set_backend` changes it later.
        save_memory: column-parallel linears keep only their input rows for the backward.
        fp8: every parallel linear's three GEMMs in FP8 with dynamic row-wise scales
            (fluxtp.nn._fp8; docs/fp8.md); master weights and gradients stay in their dtype.

    Returns:
        The model. Its forward takes the same inputs and returns the same outputs (logits
        [B, S, vocab], identical on every rank); B*S must be divisible by the group size.
        Sharded weights are this rank's slices ([out/W, in] for q/k/v/gate/up, [out, in/W] for
        o/down); replicated ones (embeddings, norms, lm_head) get the full, identical gradient
        on every rank. Raises ValueError (model unchanged) when heads or features do not divide.
    """
    info = resolve_group(group)
    world = info.world_size
    plan = plan or default_plan(model)
    layers = _validate(model, plan, world)
    heads, kv_heads = _head_counts(model, world)
    for layer in layers:
        for path in plan.column:
            linear = layer.get_submodule(path)
            _set_submodule(
                layer, path,
                ColumnParallelLinear.from_linear(linear, group, backend=backend, save_memory=save_memory, fp8=fp8),
            )  # fmt: skip
        for path in plan.row:
            _set_submodule(
                layer, path, RowParallelLinear.from_linear(layer.get_submodule(path), group, backend=backend, fp8=fp8)
            )
        attn = layer.get_submodule(plan.attention)
        # Local heads: rank r has query heads r*h/W.. and KV heads r*kv/W.., which keeps every
        # query head with its KV head (query head j uses KV head j // (h/kv)).
        attn.num_heads = heads // world
        attn.num_key_value_heads = kv_heads // world
        attn.num_key_value_groups = heads // kv_heads
        attn.forward = _sequence_parallel_attention_forward.__get__(attn)
        if plan.mlp is not None:
            mlp = layer.get_submodule(plan.mlp)
            mlp.forward = _sequence_parallel_mlp_forward.__get__(mlp)
        for path in plan.replicated:
            sum_grads_over_group(layer.get_submodule(path), group, backend=backend)
    if plan.final_norm is not None:
        sum_grads_over_group(model.get_submodule(plan.final_norm), group, backend=backend)
    # With one rank these only flatten to rows and back: the attention takes rows either way.
    scatter = _ScatterBeforeFirstLayer(group, backend)
    layers[0].register_forward_pre_hook(scatter, with_kwargs=True)
    track_backend(layers[0], scatter)
    output = model.get_submodule(plan.sequence_output)
    gather = _GatherModelOutput(group, backend)
    output.register_forward_hook(gather, with_kwargs=True)
    track_backend(output, gather)
    model._fluxtp_tensor_parallel = (plan, group)
    return model


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Make every fluxtp.nn part of `model` communicate through `backend` from its next call on:
    the parallel linears, and the hooks parallelize and sum_grads_over_group added (the token
    scatter and gather, the gradient sums). The DTensor styles (fluxtp.nn.styles) keep the
    backend they were applied with. Returns the model."""
    check_backend(backend)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.backend = backend
        for hooks in getattr(module, "_fluxtp_hooks", ()):
            hooks.backend = backend
    return model
