r"""Hybrid DP x PP x TP training of a LLaMA-style transformers model, launched by torchrun.

Tensor (+ sequence) parallelism with fluxtp inside a node, where the GPUs talk over NVLink;
data parallelism (FSDP2) and pipeline parallelism (torch.distributed.pipelining) across nodes,
on PyTorch's own engines. The ranks form a 3-D DeviceMesh ("pp", "dp", "tp"); tp is the
innermost dimension, so consecutive ranks (the GPUs of a node) share a TP group.

    # one node, 8 GPUs: 2 pipeline stages x 2 data-parallel replicas x TP 2
    torchrun --nnodes 1 --nproc-per-node 8 examples/train_hybrid.py --pp 2 --dp 2 --tp 2

    # two nodes of 8 GPUs (run on each node, --node-rank 0 and 1): TP 8 inside a node, DP across
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint node0.example:29500 examples/train_hybrid.py --tp 8 --dp 2

    # CPU (gloo) works too, for trying it out: dp 2 x tp 2 on 4 processes
    torchrun --standalone --nproc-per-node 4 examples/train_hybrid.py --dp 2 --tp 2

    # the same model and data in one process, no parallelism: the losses to compare with
    python examples/train_hybrid.py --reference

Each process takes the GPU of its LOCAL_RANK and NCCL where CUDA GPUs are visible, else the CPU
and gloo (CUDA_VISIBLE_DEVICES= forces the CPU). pp*dp*tp must equal the number of processes.

Every run prints `step N loss X` per step (from one rank). Model, data and optimizer are
deterministic functions of --seed, so a parallel run and the --reference run print the same
losses up to rounding (in float64, to ~1e-12). What is parallelized how:
- tp: fluxtp.nn.parallelize: q/k/v/gate/up column-parallel, o/down row-parallel, activations
  between them sharded by tokens; attention on local heads (see fluxtp.nn.decoder).
- dp: each replica takes its share of the global batch; FSDP2 (fully_shard on the dp mesh
  dimension) shards parameters, gradients and optimizer state and averages the gradients.
- pp: the decoder layers are split evenly into --pp stages; the first holds the embedding, the
  last the final norm and LM head; --microbatches micro-batches per step through a GPipe or
  1F1B schedule. Between stages travel the token shards [microbatch*seq/tp, hidden].
Every rank builds the full model from the seed before sharding it: fine for this example's
sizes; a large model would be built on the meta device and loaded per shard.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring's launch lines as they are, and each option's default."""


def parse_args(argv=None) -> argparse.Namespace:
    # The help shows what the script does and how to launch it: the docstring up to what it prints.
    launch = __doc__[: __doc__.index("Every run prints")].rstrip()
    p = argparse.ArgumentParser(description=launch, formatter_class=HelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (innermost mesh dim)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step and data-parallel replica")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pipeline schedule (pp > 1)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step, all replicas)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--ffn", type=int, default=128, help="MLP intermediate size")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divisible by --tp)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (divisible by --tp)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the data and the optimizer")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="parameter and activation dtype")
    p.add_argument("--backend", default="auto", help="fluxtp backend of the parallel linears")
    p.add_argument("--reference", action="store_true", help="one process, no parallelism: the losses to compare with")
    args = p.parse_args(argv)
    if args.batch % (args.dp * args.microbatches):
        p.error(f"--batch {args.batch} must be divisible by dp*microbatches = {args.dp * args.microbatches}")
    if (args.batch // (args.dp * args.microbatches)) * args.seq % args.tp:
        p.error("tokens per micro-batch (batch/(dp*microbatches)*seq) must be divisible by --tp")
    if args.layers < args.pp:
        p.error(f"--layers {args.layers} cannot fill --pp {args.pp} stages")
    return args


def build_model(args) -> nn.Module:
    """The same random LlamaForCausalLM on every rank (seeded), in args.dtype, on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 64),
        attn_implementation="sdpa",  # causal without a mask tensor: pipeline stages pass none
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(DTYPES[args.dtype])


def global_batch(args, step: int) -> torch.Tensor:
    """input_ids [batch, seq] of one step: arithmetic sequences mod vocab (random start and
    stride per sequence), learnable from two tokens, so the loss visibly falls."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits [b, seq, vocab] (upcast below float32)."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), input_ids[:, 1:].reshape(-1))


def make_optimizer(params, args):
    if args.optimizer == "sgd":  # updates proportional to the gradient: shows a mis-scaled one
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def reference_losses(args) -> list[float]:
    """The losses of the same model, data and optimizer in one process (whole batch a step)."""
    model = build_model(args)
    optimizer = make_optimizer(model.parameters(), args)
    losses = []
    for step in range(args.steps):
        input_ids = global_batch(args, step)
        loss = causal_lm_loss(model(input_ids=input_ids).logits, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


class PipelineStageModule(nn.Module):
    """One pipeline stage of a parallelized LlamaForCausalLM: [embedding] + layers [+ norm + head].

    Input: input_ids [b, seq] on the first stage, else token rows [b*seq/tp, hidden] (the
    sequence-parallel shard). Output: token rows, or logits [b, seq, vocab] on the last stage.
    RoPE cos/sin are computed here for the full sequence (every stage knows seq), as the base
    model would; attention is causal through sdpa's is_causal (no mask tensor).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool, seq: int, tp_group):
        super().__init__()
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        # The first model layer keeps parallelize's hook that scatters [b, seq, H] to rows.
        self.layers = nn.ModuleList(base.layers[i] for i in layer_ids)
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.seq, self.tp_group = seq, tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fluxtp.nn import gather_tokens

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(self.seq, device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
            h = h[0] if isinstance(h, tuple) else h  # transformers < 5 returns a tuple
        if self.lm_head is None:
            return h
        rows = gather_tokens(self.norm(h), self.tp_group)
        return self.lm_head(rows.view(-1, self.seq, rows.shape[-1]))


def stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    """Layers of a stage: contiguous, as even as possible, earlier stages one more."""
    per, extra = divmod(num_layers, pp)
    start = stage * per + min(stage, extra)
    return list(range(start, start + per + (stage < extra)))


def train(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fluxtp.nn

    world = int(os.environ["WORLD_SIZE"])
    if args.pp * args.dp * args.tp != world:
        raise SystemExit(f"pp*dp*tp = {args.pp}*{args.dp}*{args.tp} must equal the number of processes {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    tp_group = mesh["tp"].get_group()

    model = build_model(args).to(device)
    fluxtp.nn.parallelize(model, tp_group, backend=args.backend)
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    if args.pp == 1:
        module = model
        blocks = list(model.model.layers)
    else:
        module = PipelineStageModule(
            model, stage_layers(args.layers, args.pp, pp_rank), first, last, args.seq, tp_group
        )
        blocks = list(module.layers)
    del model
    if args.dp > 1:
        for block in blocks:  # one FSDP unit per decoder layer, the rest in the root unit
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    optimizer = make_optimizer(module.parameters(), args)

    local_batch = args.batch // args.dp
    micro = local_batch // args.microbatches
    schedule = None
    if args.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        dtype = DTYPES[args.dtype]
        # Shapes for the stage's p2p buffers (static: no shape inference through the TP
        # collectives); requires_grad says that gradients travel back over that boundary.
        rows = torch.empty(micro * args.seq // args.tp, args.hidden, dtype=dtype, device=device, requires_grad=True)
        example_in = torch.zeros(micro, args.seq, dtype=torch.long, device=device) if first else rows
        example_out = torch.empty(micro, args.seq, args.vocab, dtype=dtype, device=device) if last else rows
        stage = PipelineStage(
            module,
            pp_rank,
            args.pp,
            device,
            input_args=example_in,
            output_args=example_out,
            group=mesh["pp"].get_group(),
        )
        schedule_cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        # loss_fn is the mean over a micro-batch; the schedule averages gradients over them.
        schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=causal_lm_loss)

    reporter = last and dp_rank == 0 and tp_rank == 0
    for step in range(args.steps):
        input_ids = global_batch(args, step)[dp_rank * local_batch : (dp_rank + 1) * local_batch].to(device)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        if schedule is None:
            for ids in input_ids.split(micro):  # gradient accumulation over the micro-batches
                mb_loss = causal_lm_loss(module(input_ids=ids).logits, ids) / args.microbatches
                mb_loss.backward()
                loss += mb_loss.detach().double()
        else:
            losses: list[torch.Tensor] = []
            if first:
                schedule.step(input_ids)
            elif last:
                schedule.step(target=input_ids, losses=losses)
            else:
                schedule.step()
            if last:
                loss += torch.stack([x.detach().double() for x in losses]).mean()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last and args.dp > 1:  # the loss of the global batch: mean over the replicas
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= args.dp
        if reporter:
            print(f"step {step} loss {loss.item():.17g}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.reference:
        for step, loss in enumerate(reference_losses(args)):
            print(f"step {step} loss {loss:.17g}", flush=True)
    else:
        train(args)


if __name__ == "__main__":
    main()
