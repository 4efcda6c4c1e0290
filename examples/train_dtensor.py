"""Train a plain single-device Llama with torch's DTensor tensor parallelism on fluxtp's ops,
FSDP2 on the data-parallel mesh dimension, launched by torchrun.

The model below is written for one device (torchtitan's layout and names: tok_embeddings,
layers.N.attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, output).
fluxtp.nn.llama_plan.parallelize_llama applies torchtitan's TP + sequence-parallel plan with
fluxtp's ColwiseParallel / RowwiseParallel (all_gather_matmul, matmul_reduce_scatter) on the
"tp" dimension of a (dp, tp) DeviceMesh; fully_shard shards every layer over "dp".

    # 4 GPUs: dp 2 x tp 2 (NCCL)
    torchrun --standalone --nproc-per-node 4 examples/train_dtensor.py --dp 2 --tp 2

    # CPU (gloo) works too: the same on 4 processes
    torchrun --standalone --nproc-per-node 4 examples/train_dtensor.py --dp 2 --tp 2

    # torch's own styles on the same model and data (the reference plan): same losses
    torchrun --standalone --nproc-per-node 4 examples/train_dtensor.py --dp 2 --tp 2 --styles torch

    # one process, no parallelism
    python examples/train_dtensor.py --reference

Every run prints `step N loss X` (from one rank). Model, data and optimizer are deterministic
functions of --seed: the parallel runs and --reference print the same losses up to rounding
(float64: ~1e-13). --compile compiles the whole model with fullgraph=True (tp only, --dp 1).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LlamaArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    vocab_size: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq, head_dim/2] of the rotary embedding (pairs of adjacent features)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]: rotate each adjacent pair (x0, x1) by the position's angle."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[1], None, :].to(x.dtype), sin[: x.shape[1], None, :].to(x.dtype)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # batch and seq from the input (global under sequence parallelism: a DTensor's shape),
        # head counts from the projections (local under tensor parallelism).
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def build_model(args: LlamaArgs, seed: int, dtype: torch.dtype, device="cpu") -> Llama:
    """The same random model on every rank; random norm weights (at ones a misrouted norm gradient would hide)."""
    torch.manual_seed(seed)
    model = Llama(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.to(device=device, dtype=dtype)


def batch(vocab: int, n: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """tokens [n, seq] of one step: arithmetic sequences mod vocab, learnable, so the loss falls."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), tokens[:, 1:].reshape(-1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP2) size, outer mesh dim")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size, inner mesh dim")
    p.add_argument("--styles", choices=("fluxtp", "torch"), default="fluxtp", help="whose ColwiseParallel/RowwiseParallel")
    p.add_argument("--backend", default="auto", help="fluxtp backend of the linears (auto, fused, nccl, torch)")
    p.add_argument("--no-sequence-parallel", action="store_true", help="replicated activations (matmul_all_reduce)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph=True; only with --dp 1)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences per step, all replicas)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--reference", action="store_true", help="one process, no parallelism: the losses to compare with")
    args = p.parse_args(argv)
    if args.batch % args.dp:
        p.error(f"--batch {args.batch} must be divisible by --dp {args.dp}")
    if args.compile and args.dp > 1:
        p.error(
            "--compile only with --dp 1: with FSDP2 the compile fails on torch's own styles as well "
            "(see docs/dtensor.md, 'torch.compile')"
        )
    if args.seq % args.tp:
        p.error(f"--seq {args.seq} must be divisible by --tp {args.tp} (the sequence is sharded over tp)")
    return args


def model_args(args) -> LlamaArgs:
    return LlamaArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, 64),
    )


def make_optimizer(params, args):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    # foreach=False: the per-parameter path, the same arithmetic for DTensor and plain parameters.
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, foreach=False)


def reference(args) -> None:
    model = build_model(model_args(args), args.seed, DTYPES[args.dtype])
    optimizer = make_optimizer(model.parameters(), args)
    for step in range(args.steps):
        tokens = batch(args.vocab, args.batch, args.seq, args.seed, step)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.17g}", flush=True)


def train(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fluxtp.nn.llama_plan import parallelize_llama

    world = int(os.environ["WORLD_SIZE"])
    if args.dp * args.tp != world:
        raise SystemExit(f"dp*tp = {args.dp}*{args.tp} must equal the number of processes {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    model = build_model(model_args(args), args.seed, DTYPES[args.dtype], device)
    parallelize_llama(
        model, mesh, styles=args.styles, backend=args.backend, sequence_parallel=not args.no_sequence_parallel
    )
    if args.dp > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if args.compile:
        model.compile(fullgraph=True)
    optimizer = make_optimizer(model.parameters(), args)

    local = args.batch // args.dp
    for step in range(args.steps):
        tokens = batch(args.vocab, args.batch, args.seq, args.seed, step)[dp_rank * local : (dp_rank + 1) * local]
        loss = lm_loss(model(tokens.to(device)), tokens.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().double()
        if args.dp > 1:  # the global batch's loss: the mean over the replicas
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= args.dp
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.17g}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    reference(args) if args.reference else train(args)


if __name__ == "__main__":
    main()
