"""The usual tensor(+sequence)-parallel plan of a Llama decoder, with fluxtp's styles or torch's.

    from fluxtp.nn.llama_plan import parallelize_llama
    parallelize_llama(model, mesh)                      # mesh 1-D, or one with a "tp" dim
    fully_shard(...)                                    # FSDP2 on the other dims, as usual

The plan is torchtitan's Llama plan; `styles="torch"` gives exactly that one (torch's
ColwiseParallel / RowwiseParallel), `styles="fluxtp"` the same model function with the
linears on fluxtp's ops. Per decoder layer, W = the TP size, activations [batch, seq, hidden]:

    attention_norm, ffn_norm     SequenceParallel: input and output Shard(1) (seq split in W)
    attention.wq / wk / wv       column: fluxtp gathers the Shard(1) input inside each GEMM
                                 (all_gather_matmul); torch redistributes it to Replicate()
                                 once (PrepareModuleInput on attention) and runs local GEMMs
    attention.wo                 row, output Shard(1): matmul_reduce_scatter
    feed_forward.w1 / w3, w2     column (gathered like q/k/v), row with output Shard(1)
and for the model: tok_embeddings RowwiseParallel (torch's; output Shard(1)), norm
SequenceParallel, output column-parallel from Shard(1) to Replicate() logits (or Shard(-1)
DTensor logits with loss_parallel, for torch.distributed.tensor.parallel.loss_parallel()).
Without sequence parallelism the norms stay replicated plain modules, columns take Replicate()
input and rows give Replicate() output (matmul_all_reduce).

Module names default to torchtitan's; `LlamaNames.hugging_face()` gives transformers' names
for the per-layer modules. Note that a transformers Llama also computes positions and RoPE
from the embedding output's local sequence length under this plan (its decoder is not written
for DTensors): for those models use fluxtp.nn.parallelize, which handles that.

The attention module must compute its head count from its projections' outputs (local under
TP, `view(batch, seq, -1, head_dim)` as torchtitan does) and read batch and seq from its input
(a DTensor under sequence parallelism, whose .shape is global); heads and kv heads must divide
by W (checked where the module has n_heads / n_kv_heads attributes).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

from fluxtp.nn.styles import ColwiseParallel, RowwiseParallel, tp_submesh


@dataclass(frozen=True)
class LlamaNames:
    """Dotted module paths: model-level from the model root, the rest inside one decoder layer.
    A model-level entry set to None is left out of the plan."""

    layers: str = "layers"  # nn.ModuleList or nn.ModuleDict of decoder layers
    embedding: str | None = "tok_embeddings"
    final_norm: str | None = "norm"
    output: str | None = "output"
    attention: str = "attention"
    attention_norm: str = "attention_norm"
    q: str = "attention.wq"
    k: str = "attention.wk"
    v: str = "attention.wv"
    o: str = "attention.wo"
    mlp: str = "feed_forward"
    ffn_norm: str = "ffn_norm"
    gate: str = "feed_forward.w1"
    up: str = "feed_forward.w3"
    down: str = "feed_forward.w2"

    @classmethod
    def hugging_face(cls, prefix: str = "model.") -> LlamaNames:
        """transformers' names (LlamaForCausalLM: prefix "model.", a base LlamaModel: "")."""
        return cls(
            layers=prefix + "layers",
            embedding=prefix + "embed_tokens",
            final_norm=prefix + "norm",
            output="lm_head" if prefix else None,
            attention="self_attn",
            attention_norm="input_layernorm",
            q="self_attn.q_proj",
            k="self_attn.k_proj",
            v="self_attn.v_proj",
            o="self_attn.o_proj",
            mlp="mlp",
            ffn_norm="post_attention_layernorm",
            gate="mlp.gate_proj",
            up="mlp.up_proj",
            down="mlp.down_proj",
        )


STYLES = ("fluxtp", "torch")


def _check_styles(styles: str) -> None:
    if styles not in STYLES:
        raise ValueError(f"styles must be one of {', '.join(map(repr, STYLES))}, got {styles!r}")


def llama_layer_plan(
    *,
    styles: str = "fluxtp",
    backend: str = "auto",
    sequence_parallel: bool = True,
    names: LlamaNames = LlamaNames(),
    attention_args: int = 1,
    mlp_args: int = 1,
) -> dict:
    """The plan of one decoder layer, for parallelize_module(layer, tp_mesh, plan).

    attention_args / mlp_args: how many positional arguments the attention / MLP forward takes
    (torch's plan annotates all of them, the first being the activations; parallelize_llama
    reads them from the forward's signature). backend: fluxtp's, ignored with styles="torch".
    """
    _check_styles(styles)
    if styles == "fluxtp":
        column, row = partial(ColwiseParallel, backend=backend), partial(RowwiseParallel, backend=backend)
    else:
        column, row = TorchColwise, TorchRowwise
    if not sequence_parallel:
        return {
            names.q: column(),
            names.k: column(),
            names.v: column(),
            names.o: row(),
            names.gate: column(),
            names.up: column(),
            names.down: row(),
        }
    seq = Shard(1)
    plan = {names.attention_norm: SequenceParallel(), names.ffn_norm: SequenceParallel()}
    if styles == "torch":
        # One all-gather of the normed activations in front of q/k/v (and gate/up).
        for path, n in ((names.attention, attention_args), (names.mlp, mlp_args)):
            plan[path] = PrepareModuleInput(
                input_layouts=(seq,) + (None,) * (n - 1), desired_input_layouts=(Replicate(),) + (None,) * (n - 1)
            )
        column_in = {}
    else:
        # The norms' outputs reach q/k/v and gate/up as Shard(1) DTensors, gathered in the GEMMs.
        column_in = {"input_layouts": seq}
    plan.update(
        {
            names.q: column(**column_in),
            names.k: column(**column_in),
            names.v: column(**column_in),
            names.o: row(output_layouts=seq),
            names.gate: column(**column_in),
            names.up: column(**column_in),
            names.down: row(output_layouts=seq),
        }
    )
    return plan


def llama_model_plan(
    *,
    styles: str = "fluxtp",
    backend: str = "auto",
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    names: LlamaNames = LlamaNames(),
) -> dict:
    """The plan of the model-level modules (embedding, final norm, output head)."""
    _check_styles(styles)
    column = partial(ColwiseParallel, backend=backend) if styles == "fluxtp" else TorchColwise
    plan = {}
    seq = Shard(1) if sequence_parallel else Replicate()
    if names.embedding is not None:
        # A lookup, no GEMM: torch's style (vocab rows split; its output reduce-scattered to Shard(1)).
        plan[names.embedding] = TorchRowwise(input_layouts=Replicate(), output_layouts=seq)
    if names.final_norm is not None and sequence_parallel:
        plan[names.final_norm] = SequenceParallel()
    if names.output is not None:
        plan[names.output] = column(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _positional_args(module: nn.Module, what: str) -> int:
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(
            f"{what}.forward takes *args: pass its positional argument count (llama_layer_plan(attention_args=...))"
        )
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _check_heads(attention: nn.Module, world: int, where: str) -> None:
    for attr in ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads"):
        n = getattr(attention, attr, None)
        if isinstance(n, int) and n % world:
            raise ValueError(
                f"{where}.{attr}={n} must be divisible by the tensor-parallel size {world}: a rank holds whole heads"
            )


def parallelize_llama(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    styles: str = "fluxtp",
    backend: str = "auto",
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    names: LlamaNames = LlamaNames(),
    tp_dim: str = "tp",
) -> nn.Module:
    """Apply the Llama TP plan to `model` in place on mesh's tensor-parallel dimension.

    Args:
        model: a single-device Llama (parameters on the device each rank computes on; every rank
            builds the same model, or rank 0's values are scattered: parallelize_module's default).
        mesh: a 1-D DeviceMesh, or an N-D one with a dimension named `tp_dim` (the others are
            for FSDP2 / pipelining, applied afterwards by the caller).
        styles: "fluxtp" (the fused ops) or "torch" (torch's own styles, the reference).
        backend: fluxtp's backend of every linear ("auto", "fused", "nccl", "torch").
        sequence_parallel: activations between the linears Shard(1) on the sequence (default)
            or replicated.
        loss_parallel: leave the logits a Shard(-1) DTensor for loss_parallel().
        names: where the modules are (default torchtitan's names).

    Returns:
        model. ValueError, before anything is changed, for a mesh without `tp_dim`, head counts
        or feature sizes W does not divide, or a plan path that names no module.
    """
    _check_styles(styles)
    tp = tp_submesh(mesh, tp_dim)
    world = tp.size()
    layers = model.get_submodule(names.layers)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)) or len(layers) == 0:
        raise ValueError(f"names.layers={names.layers!r} must name a non-empty nn.ModuleList or nn.ModuleDict")
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    layer_plans = []
    for i, block in enumerate(blocks):
        where = f"{names.layers}.{i}"
        attention_args = _positional_args(block.get_submodule(names.attention), f"{where}.{names.attention}")
        mlp_args = _positional_args(block.get_submodule(names.mlp), f"{where}.{names.mlp}")
        _check_heads(block.get_submodule(names.attention), world, f"{where}.{names.attention}")
        plan = llama_layer_plan(
            styles=styles,
            backend=backend,
            sequence_parallel=sequence_parallel,
            names=names,
            attention_args=attention_args,
            mlp_args=mlp_args,
        )
        for path, style in plan.items():
            module = block.get_submodule(path)  # AttributeError names a missing path
            sharded = None
            if isinstance(style, (ColwiseParallel, TorchColwise)):
                sharded = "out_features"
            elif isinstance(style, (RowwiseParallel, TorchRowwise)):
                sharded = "in_features"
            if sharded and getattr(module, sharded, 0) % world:
                raise ValueError(
                    f"{where}.{path}: {sharded}={getattr(module, sharded)} must be divisible by the "
                    f"tensor-parallel size {world}"
                )
        layer_plans.append(plan)
    model_plan = llama_model_plan(
        styles=styles, backend=backend, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, names=names
    )
    for path, style in model_plan.items():
        module = model.get_submodule(path)
        if isinstance(style, (ColwiseParallel, TorchColwise)) and getattr(module, "out_features", 0) % world:
            raise ValueError(
                f"{path}: out_features={module.out_features} must be divisible by the tensor-parallel size {world}"
            )
    parallelize_module(model, tp, model_plan)
    for block, plan in zip(blocks, layer_plans):
        parallelize_module(block, tp, plan)
    return model
