"""The `train` scenario: whole training steps of a stack of LLaMA decoder layers, per backend.

One step is forward + backward + AdamW step (fused on GPUs) + zero_grad of `--layers` transformers
LlamaDecoderLayers at real layer sizes (`--model`), tensor + sequence parallel over the ranks by
fluxtp.nn.parallelize. Every backend runs on the same model and the same data: there is one
model, and the backend of its parallel linears is switched between samples. Each sample is one
step (GPU_PROTOCOL / CPU_PROTOCOL below), the variants interleaved by fluxtp.bench.harness.

What a step contains (each rank; T = batch*seq tokens, W ranks):
- input: hidden states [batch, seq, hidden], random, the same on every rank, no gradient (the
  embedding's output as data); the hook parallelize puts before the first layer keeps this
  rank's rows (a local slice). RoPE cos/sin are computed once per sequence length.
- the layers, as parallelize runs them: norms on row shards [T/W, hidden]; q/k/v and gate/up
  column-parallel (one all-gather each group, fused with the first GEMM), o and down
  row-parallel (reduce-scatter); attention (sdpa, causal) on all tokens of this rank's heads.
  The backward has the mirrored collectives (reduce-scatter of the input gradients of q/k/v
  and gate/up, all-gather of the output gradients of o and down) and the all-reduce of the
  norm weights' gradients.
- loss: the mean square of this rank's output rows (local; the sum over ranks is the objective,
  so every gradient is that of a real loss of the whole layer stack); backward; AdamW over the
  layers' parameters; zero_grad.

With `--fp8 row-wise` every parallel linear runs its three GEMMs in FP8 (parallelize(fp8=True):
dynamic row-wise scales, the forward's accumulation fast, the gradients' precise), through the
scaled ops of each backend.

Variants: `nccl` (the baseline), `torch`, `fused` (those usable here, or --backends), and
`no_comm`: the step with every communication of the layers removed, the whole model switched
(fluxtp.nn.set_backend) to the bench's no_comm backend, fluxtp/bench/no_comm.py, which the
layers run all of their communication through: each all-gather becomes a local repeat of this
rank's rows (before the same GEMM), each reduce-scatter a local sum of this rank's row blocks
of its own product, each gradient all-reduce nothing.
So `no_comm` keeps every GEMM, attention, norm, elementwise op, memory copy of the output
buffers and the optimizer step at their shapes, and drops every transfer between GPUs and
every wait for a peer. Its time is what a step would take with communication perfectly hidden:
    T_exposed_comm = T_nccl - T_no_comm,  ideal_speedup = T_nccl / (T_nccl - T_exposed_comm),
    E_overlap[x]   = 1 - (T_x - T_no_comm) / T_exposed_comm  (fraction of the exposed time hidden).
tokens_per_s counts the global batch*seq tokens of one step (the whole group's throughput).

Before timing, each backend's forward output is compared with nccl's (a sanity check of the
layer stack, loose enough for bfloat16 rounding through the layers: the ops scenario verifies
each op tightly).

Loss curves (`--loss-steps N`, after the timing; `--rounds 1` keeps that short): does a
backend train the same model as nccl? The whole LlamaForCausalLM (embedding, the layers, final
norm, LM head; parallelize's layout: embedding and head replicated, so the loss is computed
alike on every rank) is trained for N steps per backend, each from the same weights (the state
when the phase starts, saved once and loaded before each backend) with a fresh AdamW, on the
same data, at the first `--seq`:
- objective: next-token cross-entropy (the mean over the batch's tokens: the full objective,
  one number on every rank). The mean square of the layers' output that the timed step uses
  does not train at llama3-70b sizes (CPU, one layer, bfloat16, 64 tokens a step: flat at
  58.8 +- 0.5, the size of the layers' random output, over 8 steps at lr 1e-5 and 1e-4;
  divergent at 1e-3).
- data: sequences of a fixed random Markov chain over the model's VOCAB tokens, each token
  followed by one of MARKOV_BRANCHES successors, uniformly; fresh sequences every step, drawn
  from a seed and the step number (the same on every rank and for every backend). A model
  that has learned the chain scores ln(MARKOV_BRANCHES) (1.386), the floor of the curve; the
  untrained model starts near ln(VOCAB) (4.85) or above.
- optimizer: AdamW (weight decay 0.01), peak learning rate `--loss-lr` (LOSS_LEARNING_RATE
  per model), reached by a linear warm-up over the first LOSS_WARMUP_STEPS steps, then
  decayed linearly to LOSS_FINAL_LR_FRACTION of it at the last step. The weights are bfloat16
  (no float32 master copy, as in the timed steps): a step smaller than half a bfloat16 ulp of
  a weight leaves it unchanged, which bounds the learning rate from below.
- noise reference: bfloat16 rounding makes two equivalent computations drift apart over the
  steps (an ulp flipped in one step changes the next step's gradients). To tell that from a
  real difference, nccl is trained a second time as `nccl_reordered`: the same function with
  the GEMMs of the two ops (all_gather_matmul, matmul_reduce_scatter: the GEMMs the backends
  replace) summed in another order (their K dim halves swapped: the bench's nccl_reordered
  backend, fluxtp/bench/nccl_reordered.py), so its curve differs from nccl's by rounding alone
  (with one rank the ops are plain linears for every backend, this one too). A backend's curve
  is "within noise" when its largest relative difference from nccl's over the steps is at most
  LOSS_NOISE_MARGIN x the reference's (or the dtype's unit roundoff, if larger).
Rows: one per variant, {"phase": "loss", "backend", model, layers, seq, batch, dtype, lr,
warmup_steps, final_lr_fraction, "losses": [one per step], "max_rel_diff_vs_nccl",
"within_noise"} after the
timing rows (which have no "phase"); `--plot X.png` draws the curves to X-loss.png beside X.png.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

from fluxtp._dist import GroupInfo, max_over_ranks
from fluxtp.bench import NO_COMM, REORDERED, BenchError
from fluxtp.bench.harness import Protocol, Timings, Variant, format_speedup, measure_rounds, overlap_efficiency
from fluxtp.bench.harness import speedup, speedup_iqr
from fluxtp.bench.progress import describe as describe_bar
from fluxtp.bench.progress import progress_bar
from fluxtp.bench.ops import (
    BASELINE,
    DEFAULT_DTYPE,
    DTYPES,
    parse_backends,
    relative_error,
    select_backends,
)

LOSS_PHASE = "loss"


@dataclass(frozen=True)
class LayerDims:
    """The sizes of one decoder layer (LLaMA 3: head_dim = hidden / heads = 128)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int


MODELS = {
    "llama3-8b": LayerDims(hidden=4096, ffn=14336, heads=32, kv_heads=8),
    "llama3-70b": LayerDims(hidden=8192, ffn=28672, heads=64, kv_heads=8),
    # The CPU demo: the same code on sizes a 2-process gloo world runs in seconds.
    "tiny": LayerDims(hidden=256, ffn=512, heads=8, kv_heads=4),
}
# On GPUs: a llama3-70b layer (856M parameters) takes about 3.4 GB per rank at TP=2 in bfloat16
# (weights, gradients, AdamW state), plus about 2 GB of saved activations at 8192 tokens, and
# 5 GB while it is built whole in float32 before the sharding: 2 layers are far inside one H200
# (141 GB) or H100 (80 GB); --layers can go up where memory allows.
DEFAULTS = {
    "cuda": {"model": "llama3-70b", "layers": 2, "seq": (4096, 8192), "batch": 1},
    "cpu": {"model": "tiny", "layers": 2, "seq": (64,), "batch": 2},
}
VOCAB = 128  # the model's embedding and head are built but not in the step
# One step per sample: a step is tens of milliseconds at the GPU defaults.
GPU_PROTOCOL = Protocol(rounds=20, warmup_rounds=3, calls_per_sample=1)
CPU_PROTOCOL = Protocol(rounds=5, warmup_rounds=1, calls_per_sample=1)
LEARNING_RATE = 1e-5  # small: the weights barely move over the run's steps
# Forward output of the layer stack, max |out - ref| / max |ref| against nccl. Backends differ
# in the order and precision of the reduce-scatter sums (an ulp per element per op), which the
# layers carry to the output. Bounded by bfloat16 against float32 of the same weights, measured
# on CPU at llama3-8b sizes: 0.029 through 2 layers, 0.034 through 8 (it follows the largest
# element, not the depth); a misplaced or missing tile, head or token is off by O(1) there.
VERIFY_TOLERANCE = {
    torch.bfloat16: 0.1,
    torch.float16: 0.05,
    torch.float32: 1e-3,
    torch.float64: 1e-9,
}
# With FP8 GEMMs (--fp8): an activation one backend rounds the other way before its e4m3
# quantization lands up to 2^-4 of itself away, and the layers carry that to the output.
VERIFY_TOLERANCE_FP8 = 0.125
TRAIN_FP8 = "row-wise"  # the only scaling of fluxtp.nn's FP8 recipe

# Loss curves (module docstring). The learning rate: AdamW's first steps move every weight by
# about lr, coherently along a row, so a logit moves by about lr * sum|h| ~ lr * hidden; below
# about 1e-4 most bfloat16 weights of the init's size (std 0.02, ulp 1.2e-4) do not move at all.
# Measured on CPU, one llama3-70b layer, bfloat16 (initial loss 6.35): at 256 tokens a step,
# 1e-3 and 3e-4 diverged (10 to 25 within 5 steps), 1e-4 fell to 4.2 in 16 steps (noisy) and to
# 3.5 with the 8-step warm-up; at 1024 tokens, with the warm-up, to 3.1 by step 8, then it
# stalled at 3.1-3.3 at the full rate; with the decay as well, to 2.7 by step 20 and falling.
LOSS_LEARNING_RATE = {"llama3-8b": 1e-4, "llama3-70b": 1e-4, "tiny": 1e-3}
LOSS_WARMUP_STEPS = 8  # linear warm-up to the peak rate ...
LOSS_FINAL_LR_FRACTION = 0.1  # ... then a linear decay to this share of it at the last step
LOSS_WEIGHT_DECAY = 0.01
MARKOV_BRANCHES = 4
LOSS_DATA_SEED = 20261123
LOSS_NOISE_MARGIN = 2.0
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}


@dataclass(frozen=True)
class TrainConfig:
    model: str
    dims: LayerDims
    layers: int
    seqs: tuple[int, ...]
    batch: int
    dtype: torch.dtype
    backends: tuple[str, ...] | None  # None: every candidate usable here; else the baseline first
    protocol: Protocol
    loss_steps: int = 0  # 0: no loss curves
    loss_lr: float | None = None  # None: LOSS_LEARNING_RATE[model]
    fp8: str | None = None  # "row-wise": every parallel linear's GEMMs in FP8 (parallelize's fp8 recipe)


def add_arguments(group) -> None:
    group.add_argument(
        "--model",
        choices=tuple(MODELS),
        help="layer sizes: llama3-8b (hidden 4096, ffn 14336, 32 heads, 8 KV heads), llama3-70b (8192, 28672, "
        "64, 8), tiny (256, 512, 8, 4) (default: llama3-70b on GPUs, tiny on CPU)",
    )
    group.add_argument("--layers", type=int, help="decoder layers in the stack (default: 2)")
    group.add_argument(
        "--seq",
        metavar="S,...",
        help="sequence lengths, one row each (default on GPUs: 4096,8192; on CPU: 64)",
    )
    group.add_argument("--batch", type=int, help="sequences per step (default: 1 on GPUs, 2 on CPU)")
    group.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        metavar="N",
        help="after the timing, train the whole model N steps per backend from the same weights on the same data "
        "(next-token loss on a synthetic Markov chain, at the first --seq) and compare the loss curves with nccl's "
        "(default: 0, none)",
    )
    group.add_argument(
        "--loss-lr",
        type=float,
        metavar="LR",
        help="peak AdamW learning rate of the loss curves (default: 1e-4 for llama3 sizes, 1e-3 for tiny)",
    )


def _parse_seqs(text: str) -> tuple[int, ...]:
    items = [s.strip() for s in text.split(",")]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        raise ValueError(f"--seq: {text!r} is not a comma list of positive integers (e.g. 4096,8192)")
    return tuple(int(s) for s in items)


def make_config(args: argparse.Namespace, world: int, device_type: str) -> TrainConfig:
    defaults = DEFAULTS[device_type]
    model = args.model or defaults["model"]
    dims = MODELS[model]
    layers = defaults["layers"] if args.layers is None else args.layers
    batch = defaults["batch"] if args.batch is None else args.batch
    if isinstance(batch, (tuple, list)):  # --batch is shared with serve, which takes a list
        if len(batch) != 1:
            raise ValueError(f"--batch: train takes one batch size, got {','.join(map(str, batch))}")
        batch = batch[0]
    seqs = _parse_seqs(args.seq) if args.seq else defaults["seq"]
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    for what, n in (("attention heads", dims.heads), ("KV heads", dims.kv_heads)):
        if n % world:
            raise ValueError(f"--model {model}: its {n} {what} do not divide over the world size {world}")
    for seq in seqs:
        if batch * seq % world:
            raise ValueError(
                f"batch*seq = {batch}*{seq} tokens must be divisible by the world size {world} "
                "(sequence parallelism shards the tokens)"
            )
    loss_steps = getattr(args, "loss_steps", 0) or 0
    loss_lr = getattr(args, "loss_lr", None)
    if loss_steps < 0:
        raise ValueError(f"--loss-steps must be 0 (no loss curves) or more, got {loss_steps}")
    if loss_lr is not None and not (loss_lr > 0 and math.isfinite(loss_lr)):
        raise ValueError(f"--loss-lr must be a positive number, got {loss_lr}")
    dtype_name = args.dtype or DEFAULT_DTYPE[device_type]
    fp8 = getattr(args, "fp8", None)
    if fp8 not in (None, TRAIN_FP8):
        raise ValueError(f"--fp8 {fp8}: train runs fluxtp.nn's FP8 recipe, whose scales are {TRAIN_FP8} "
                         f"(--fp8 {TRAIN_FP8})")  # fmt: skip
    if getattr(args, "fast_accum", False):
        raise ValueError("--fast-accum: train runs fluxtp.nn's FP8 recipe, which accumulates the forward fast and "
                         "the gradients precisely")  # fmt: skip
    protocol = GPU_PROTOCOL if device_type == "cuda" else CPU_PROTOCOL
    if args.rounds is not None:
        protocol = Protocol(args.rounds, protocol.warmup_rounds, protocol.calls_per_sample)
    return TrainConfig(
        model,
        dims,
        layers,
        seqs,
        batch,
        DTYPES[dtype_name],
        parse_backends(args.backends),
        protocol,
        loss_steps,
        loss_lr,
        fp8,
    )


# ---------------------------------------------------------------- the model and one step


def build_layers(config: TrainConfig, info: GroupInfo, device: torch.device):
    """(model, its parallelized decoder layers): a LlamaForCausalLM of config.layers layers,
    seeded alike on every rank, parallelized over info's group (backend nccl until switched)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fluxtp.nn import parallelize

    dims = config.dims
    llama = LlamaConfig(
        hidden_size=dims.hidden,
        intermediate_size=dims.ffn,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        num_hidden_layers=config.layers,
        vocab_size=VOCAB,
        max_position_embeddings=max(config.seqs),
        attn_implementation="sdpa",  # causal through is_causal, no mask tensor
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(20261122)  # the same weights on every rank
    with torch.device(device):
        model = LlamaForCausalLM(llama).to(config.dtype)
    model.train()
    parallelize(model, info.group, backend=BASELINE, fp8=config.fp8 is not None)
    return model, list(model.model.layers)


def run_layers(layers, hidden, position_ids, position_embeddings) -> torch.Tensor:
    """The stack on full hidden states [batch, seq, H] -> this rank's output rows [T/W, H]."""
    h = hidden
    for layer in layers:
        h = layer(
            h,
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        h = h[0] if isinstance(h, tuple) else h  # transformers < 5 returns a tuple
    return h


class Trainer:
    """One model, one optimizer, one input; `step(variant)` is a whole training step."""

    def __init__(self, config: TrainConfig, info: GroupInfo, device: torch.device):
        self.model, self.layers = build_layers(config, info, device)
        params = [p for layer in self.layers for p in layer.parameters()]
        # The fused AdamW on GPUs: the default (foreach) one took 22 of the 50 ms of a step at
        # llama3-70b, 2 layers, seq 4096 (benchmarks/train_step_profile.py), far more than a
        # training framework spends, diluting every difference the backends make.
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.01, fused=fused)
        self.backend = BASELINE
        self.config, self.device = config, device
        self.hidden = self.position_ids = self.position_embeddings = None

    def set_input(self, seq: int) -> None:
        """Random hidden states [batch, seq, H], the same on every rank (not zeros)."""
        generator = torch.Generator(device=self.device).manual_seed(seq)
        shape = (self.config.batch, seq, self.config.dims.hidden)
        self.hidden = torch.randn(shape, generator=generator, device=self.device, dtype=self.config.dtype)
        self.position_ids = torch.arange(seq, device=self.device).unsqueeze(0)
        with torch.no_grad():
            self.position_embeddings = self.model.model.rotary_emb(self.hidden, self.position_ids)

    def use(self, backend: str) -> None:
        """The whole model communicates through `backend` (a built-in or one of the bench's) from now on."""
        if backend != self.backend:
            from fluxtp.nn import set_backend

            set_backend(self.model, backend)
            self.backend = backend

    def forward(self, backend: str) -> torch.Tensor:
        self.use(backend)
        return run_layers(self.layers, self.hidden, self.position_ids, self.position_embeddings)

    def step(self, backend: str) -> None:
        self.use(backend)
        out = run_layers(self.layers, self.hidden, self.position_ids, self.position_embeddings)
        loss = out.float().square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- run


def _select_backends(config: TrainConfig, info: GroupInfo, device) -> tuple[list[str], dict[str, str]]:
    """Backends to time (baseline first) and why the others were left out: a backend must run
    both ops of the layers (small stand-in tensors with the layers' K and dtype)."""
    dims, world = config.dims, info.world_size
    probes = {
        "all_gather_matmul": (
            dims.hidden,
            dims.hidden,
        ),  # q/k/v, gate/up; backward of o, down
        "matmul_reduce_scatter": (
            dims.ffn // world,
            dims.hidden,
        ),  # down; backward: K = hidden * (1 + 2 kv/h) / W
    }
    stand_ins = [
        (
            op,
            torch.empty(8 * world, k, dtype=config.dtype, device=device),
            torch.empty(n, k, dtype=config.dtype, device=device),
        )
        for op, (k, n) in probes.items()
    ]
    return select_backends(config.backends, stand_ins, info, f"the layers with {config.dtype} on {device}")


def verify(trainer: Trainer, names: list[str], info: GroupInfo, where: str) -> None:
    """Each backend's forward output of the stack against nccl's; BenchError on every rank if one differs."""
    tolerance = VERIFY_TOLERANCE[trainer.config.dtype]
    if trainer.config.fp8 is not None:
        tolerance = max(tolerance, VERIFY_TOLERANCE_FP8)
    with torch.no_grad():
        ref = trainer.forward(BASELINE)
        for name in names:
            error = relative_error(trainer.forward(name), ref)  # the baseline: 0, or inf on NaN
            (error,) = max_over_ranks([error], info, ref.device)
            if not error <= tolerance:
                what = "NaN or Inf in the output" if math.isinf(error) else f"max-norm relative error {error:.3g}"
                raise BenchError(
                    f"verification failed: backend {name!r} on {where}: {what} of the layers' forward output "
                    f"against the nccl reference (worst rank), allowed {tolerance:.3g}; nothing was timed"
                )


# ---------------------------------------------------------------- loss curves (module docstring)


def markov_successors(vocab: int = VOCAB, branches: int = MARKOV_BRANCHES, seed: int = LOSS_DATA_SEED):
    """The chain of the loss curves' data: token t is followed by one of successors[t] (distinct tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randperm(vocab, generator=generator)[:branches].tolist() for _ in range(vocab)]


def loss_batch(step: int, batch: int, seq: int, successors) -> torch.Tensor:
    """Token ids [batch, seq] of one step: sequences of the chain from a random first token,
    drawn on CPU from LOSS_DATA_SEED and the step (the same on every rank, new every step)."""
    generator = torch.Generator().manual_seed(LOSS_DATA_SEED + 1 + step)
    firsts = torch.randint(len(successors), (batch,), generator=generator).tolist()
    picks = torch.randint(len(successors[0]), (batch, seq), generator=generator).tolist()
    rows = []
    for token, row_picks in zip(firsts, picks):
        row = [token]
        for pick in row_picks[1:]:
            token = successors[token][pick]
            row.append(token)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def loss_lr_factor(step: int, steps: int) -> float:
    """The share of the peak learning rate that step `step` (0-based) of `steps` uses: a linear
    warm-up over LOSS_WARMUP_STEPS steps, then a linear decay to LOSS_FINAL_LR_FRACTION."""
    warm = (step + 1) / LOSS_WARMUP_STEPS
    decay = 1.0 - (1.0 - LOSS_FINAL_LR_FRACTION) * max(0, step + 1 - LOSS_WARMUP_STEPS) / max(
        1, steps - LOSS_WARMUP_STEPS
    )
    return min(warm, decay)


def train_losses(trainer: Trainer, variant: str, initial_state: dict, data, lr: float, progress=None) -> torch.Tensor:
    """Load `initial_state`, then one AdamW step of the whole model per batch of `data` with
    `variant`'s backend (nccl_reordered: nccl with the GEMMs summed in another order); the
    loss of every step, float64 on the model's device (this rank's value)."""
    model = trainer.model
    model.load_state_dict(initial_state)
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=LOSS_WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(loss_lr_factor, steps=len(data)))
    trainer.use(variant)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().double())
        if progress is not None:
            progress()
    return torch.stack(losses)


def _max_rel_diff(curve: list[float], ref: list[float]) -> float:
    """max over the steps of |curve - ref| / |ref|; inf when either has NaN or Inf."""
    if not all(math.isfinite(v) for v in (*curve, *ref)):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(curve, ref))


def loss_curves(config: TrainConfig, trainer: Trainer, names: list[str], info: GroupInfo, device, show_progress: bool):
    """Every backend of `names` and the nccl_reordered reference trained config.loss_steps steps
    from the same weights on the same data (collective). Returns (rows, notes)."""
    seq, steps = config.seqs[0], config.loss_steps
    lr = config.loss_lr or LOSS_LEARNING_RATE[config.model]
    successors = markov_successors()
    data = [loss_batch(step, config.batch, seq, successors).to(device) for step in range(steps)]
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    variants = [*names, REORDERED]
    curves, rank_spread = {}, 0.0
    bar = progress_bar(len(variants) * steps, "step", show_progress)
    try:
        for variant in variants:
            describe_bar(bar, f"loss curve {variant}")
            values = train_losses(trainer, variant, initial, data, lr, lambda: bar.update(1))
            low, high = values.clone(), values.clone()
            if info.group is not None:
                dist.all_reduce(low, op=dist.ReduceOp.MIN, group=info.group)
                dist.all_reduce(high, op=dist.ReduceOp.MAX, group=info.group)
            spread = (high - low).abs().nan_to_num(nan=math.inf).max().item()
            rank_spread = max(rank_spread, spread)
            curves[variant] = high.tolist()
    finally:
        bar.close()
        del initial
    ref = curves[BASELINE]
    diffs = {v: _max_rel_diff(c, ref) for v, c in curves.items()}
    noise = diffs[REORDERED]
    tolerance = max(LOSS_NOISE_MARGIN * noise, UNIT_ROUNDOFF[config.dtype])
    rows = [
        {
            "phase": LOSS_PHASE,
            "backend": variant,
            "model": config.model,
            "layers": config.layers,
            "seq": seq,
            "batch": config.batch,
            "dtype": str(config.dtype).removeprefix("torch."),
            "fp8": config.fp8,
            "lr": lr,
            "warmup_steps": LOSS_WARMUP_STEPS,
            "final_lr_fraction": LOSS_FINAL_LR_FRACTION,
            "losses": [v if math.isfinite(v) else None for v in curve],
            "max_rel_diff_vs_nccl": diffs[variant] if math.isfinite(diffs[variant]) else None,
            "within_noise": None if variant in (BASELINE, REORDERED) else bool(diffs[variant] <= tolerance),
        }
        for variant, curve in curves.items()
    ]
    first, last = ref[0], ref[-1]
    notes = [
        (
            f"loss curves: {steps} steps of the whole model per backend from the same weights and data (next-token "
            f"cross-entropy on a {VOCAB}-token Markov chain, {MARKOV_BRANCHES} successors per token: floor "
            f"ln {MARKOV_BRANCHES} = {math.log(MARKOV_BRANCHES):.3f}; seq {seq}, batch {config.batch}; AdamW, lr up "
            f"to {lr:g} over {LOSS_WARMUP_STEPS} steps, then down to {LOSS_FINAL_LR_FRACTION:g}x): "
            f"nccl {first:.4g} -> {last:.4g}"
        )
    ]
    if not last < first:
        notes.append(
            "loss curves: the nccl loss did not decrease over the steps, so the curves compare little "
            "(more --loss-steps, or a smaller --loss-lr if it rose)"
        )
    compared = [v for v in names if v != BASELINE]
    verdicts = ", ".join(f"{v} {'yes' if diffs[v] <= tolerance else 'NO'}" for v in compared) or "no other backend ran"
    notes.append(
        "loss curves against nccl's, max relative difference over the steps: "
        + ", ".join(f"{v} {diffs[v]:.3g}" for v in compared)
        + ("; " if compared else "")
        + f"noise: {REORDERED} (nccl with the ops' GEMMs summed in another order) {noise:.3g}; within noise "
        f"(<= max({LOSS_NOISE_MARGIN:g} x noise, unit roundoff {UNIT_ROUNDOFF[config.dtype]:.3g}) = {tolerance:.3g}): "
        + verdicts
    )
    if rank_spread > 0:
        notes.append(
            f"loss curves: the ranks' losses differ by up to {rank_spread:.3g} (the loss is computed alike on every "
            "rank and should be identical); the curves are each step's largest over the ranks"
        )
    return rows, notes


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run(config: TrainConfig, info: GroupInfo, device: torch.device, show_progress: bool):
    """Verify, then time a training step per backend for each sequence length, then the loss
    curves if asked; collective over the ranks of `info`. Returns (rows, notes)."""
    names, skipped = _select_backends(config, info, device)
    trainer = Trainer(config, info, device)
    rows = []
    bar = progress_bar(len(config.seqs) * config.protocol.rounds, "round", show_progress)
    try:
        for seq in config.seqs:
            where = f"{config.model} x{config.layers} layers, batch {config.batch}, seq {seq}"
            describe_bar(bar, f"{config.model} batch {config.batch} seq {seq}")
            trainer.set_input(seq)
            verify(trainer, names, info, where)
            variants = [Variant(v, ((lambda v=v: trainer.step(v)),)) for v in (*names, NO_COMM)]
            timings = measure_rounds(variants, config.protocol, info, device, lambda: bar.update(1))
            rows.append(_row(config, seq, names, timings))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next length's activations are larger
    finally:
        bar.close()
    notes = [f"backend {name!r} not timed: {reason}" for name, reason in skipped.items()]
    if config.loss_steps:
        loss_rows, loss_notes = loss_curves(config, trainer, names, info, device, show_progress)
        rows += loss_rows
        notes += loss_notes
    return rows, notes


def _row(config: TrainConfig, seq: int, names: list[str], timings: Timings) -> dict:
    return {
        "model": config.model,
        "layers": config.layers,
        "seq": seq,
        "batch": config.batch,
        "dtype": str(config.dtype).removeprefix("torch."),
        "fp8": config.fp8,
        **step_metrics(timings, names, config.batch * seq, ms_digits=4),
    }


def step_metrics(timings: Timings, names, tokens: int, ms_digits: int) -> dict:
    """A step row's timing columns (train and serve): ms of every variant, tokens/s, the speedups
    over nccl and their spread, the exposed communication (nccl minus NO_COMM), the speedup hiding
    all of it would give, and E_overlap against those two."""
    ms = timings.ms
    t_nccl, t_local = ms[BASELINE], ms[NO_COMM]
    return {
        "ms": {k: round(v, ms_digits) for k, v in ms.items()},
        "tokens_per_s": {n: round(tokens / (ms[n] / 1e3), 1) for n in names},
        "speedup_vs_nccl": {n: _round(speedup(t_nccl, ms[n]), 4) for n in names},
        "speedup_vs_nccl_iqr": speedup_iqr(timings, BASELINE, names),
        "T_exposed_comm": round(t_nccl - t_local, ms_digits),
        "ideal_speedup": _round(speedup(t_nccl, t_local), 4),
        "E_overlap": {n: _round(overlap_efficiency(ms[n], t_local, t_nccl), 4) for n in names},
    }


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _timing_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "phase" not in r]


def _loss_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("phase") == LOSS_PHASE]


def format_table(rows: list[dict]) -> str:
    """Step time of every variant, throughput, speedup and the exposed communication per row;
    then the loss curves' summary, if any."""
    loss_rows = _loss_rows(rows)
    rows = _timing_rows(rows)
    tables = [_format_timing(rows)] if rows else []
    if loss_rows:
        tables.append(_format_losses(loss_rows))
    return "\n\n".join(tables)


def _precision(row: dict) -> str:
    """A row's dtype, and its GEMMs' FP8 scaling where they ran in FP8."""
    return row["dtype"] if row["fp8"] is None else f"{row['dtype']}, FP8 GEMMs ({row['fp8']} scales)"


def _format_losses(rows: list[dict]) -> str:
    body = []
    for r in rows:
        finite = [v for v in r["losses"] if v is not None]
        within = r["within_noise"]
        body.append(
            [
                r["backend"],
                _fmt(r["losses"][0]),
                _fmt(r["losses"][-1]),
                _fmt(min(finite) if finite else None),
                _fmt(r["max_rel_diff_vs_nccl"]),
                "-" if within is None else ("yes" if within else "NO"),
            ]
        )
    first = rows[0]
    title = (
        f"loss curves ({len(first['losses'])} steps, {first['model']} x{first['layers']} layers, seq {first['seq']}, "
        f"batch {first['batch']}, {_precision(first)}, lr {first['lr']:g})"
    )
    headers = ["backend", "first loss", "last loss", "min loss", "max rel diff vs nccl", "within noise"]
    return title + "\n" + tabulate(body, headers=headers, disable_numparse=True, stralign="right")


def step_table(rows: list[dict], key_columns: list[str], title: str) -> str:
    """The timing table of the train and serve scenarios: key_columns, ms of every variant,
    tokens/s and speedup of each backend, the exposed communication and the share each hides."""
    variants = list(dict.fromkeys(k for r in rows for k in r["ms"]))
    backends_ = list(dict.fromkeys(k for r in rows for k in r["tokens_per_s"]))
    compared = [b for b in backends_ if b != BASELINE]
    headers = list(key_columns) + [f"{v} ms" for v in variants]
    headers += [f"{b} tok/s" for b in backends_] + [f"speedup {b} (p25-p75)" for b in compared]
    headers += ["T_exposed_comm ms", "ideal_speedup"] + [f"E_overlap {b}" for b in compared]
    body = []
    for r in rows:
        line = [r[k] for k in key_columns] + [_fmt(r["ms"].get(v)) for v in variants]
        line += [_fmt(r["tokens_per_s"].get(b)) for b in backends_]
        line += [format_speedup(r["speedup_vs_nccl"].get(b), r["speedup_vs_nccl_iqr"].get(b)) for b in compared]
        line += [_fmt(r["T_exposed_comm"]), _fmt(r["ideal_speedup"])] + [_fmt(r["E_overlap"].get(b)) for b in compared]
        body.append(line)
    return title + "\n" + tabulate(body, headers=headers, disable_numparse=True, stralign="right")


def _format_timing(rows: list[dict]) -> str:
    title = (
        f"train steps (forward + backward + AdamW; {_precision(rows[0])}; {NO_COMM}: the nccl step with its "
        "communication removed)"
    )
    return step_table(rows, ["model", "layers", "seq", "batch"], title)


def loss_plot_path(path: str) -> str:
    """Where plot() draws the loss curves: X.png -> X-loss.png."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-loss{p.suffix or '.png'}"))


def plot(rows: list[dict], path: str, title: str) -> None:
    """Step time against sequence length per variant and each backend's speedup beside the
    ideal, to `path`; the loss curves, if any, to loss_plot_path(path)."""
    loss_rows = _loss_rows(rows)
    rows = _timing_rows(rows)
    if rows:
        _plot_timing(rows, path, title)
    if loss_rows:
        loss_path = loss_plot_path(path)
        _plot_losses(loss_rows, loss_path, title)
        print(f"wrote {loss_path}", flush=True)


def _plot_losses(rows: list[dict], path: str, title: str) -> None:
    """Loss against step per variant (left) and each curve's relative difference from nccl's
    (right, log scale; the within-noise bound dotted)."""
    from fluxtp.bench.plot import _pyplot, save_figure

    plt = _pyplot()
    ref = next(r for r in rows if r["backend"] == BASELINE)["losses"]
    noise = next((r["max_rel_diff_vs_nccl"] for r in rows if r["backend"] == REORDERED), None)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    any_diff = False
    for i, r in enumerate(rows):
        steps = list(range(1, len(r["losses"]) + 1))
        losses = [math.nan if v is None else v for v in r["losses"]]
        style = {"linestyle": "--", "color": "grey"} if r["backend"] == REORDERED else {"color": f"C{i}"}
        left.plot(steps, losses, label=r["backend"], linewidth=1.2, **style)
        if r["backend"] == BASELINE:
            continue
        diff = [
            math.nan if a is None or b is None or a == b else abs(a - b) / max(abs(b), 1e-30)
            for a, b in zip(r["losses"], ref)
        ]
        any_diff = any_diff or any(math.isfinite(d) for d in diff)
        right.plot(steps, diff, marker=".", linewidth=0.8, label=r["backend"], **style)
    left.axhline(math.log(MARKOV_BRANCHES), color="grey", linewidth=0.8, linestyle=":", label="floor ln 4")
    left.set_ylabel("loss (next-token cross-entropy)")
    if noise is not None:
        dtype = getattr(torch, rows[0]["dtype"])
        bound = max(LOSS_NOISE_MARGIN * noise, UNIT_ROUNDOFF[dtype])
        right.axhline(bound, color="grey", linewidth=0.8, linestyle=":", label=f"within noise <= {bound:.2g}")
    if any_diff:
        right.set_yscale("log")
    right.set_ylabel("|loss - nccl's| / nccl's (equal: not drawn)")
    first = rows[0]
    for ax in (left, right):
        ax.set_xlabel(f"step (seq {first['seq']}, batch {first['batch']}, {first['model']} x{first['layers']} layers)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    schedule = f"AdamW lr {first['lr']:g}"
    if first.get("final_lr_fraction") is not None:  # rows written before the decay have a constant rate
        schedule = (
            f"AdamW lr up to {first['lr']:g} over {first['warmup_steps']} steps, then down to "
            f"{first['final_lr_fraction']:g}x"
        )
    save_figure(fig, path, f"{title}\nloss curves, {first['dtype']}, {schedule}", fontsize=10)


def _plot_timing(rows: list[dict], path: str, title: str) -> None:
    from fluxtp.bench.plot import _pyplot, save_figure

    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["seq"])
    seqs = [r["seq"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in dict.fromkeys(k for r in rows for k in r["ms"]):
        left.plot(seqs, [r["ms"].get(variant) for r in rows], marker="o", label=variant)
    left.set_ylabel("ms per step (slowest rank)")
    for backend in dict.fromkeys(k for r in rows for k in r["speedup_vs_nccl"]):
        right.plot(
            seqs,
            [r["speedup_vs_nccl"].get(backend) for r in rows],
            marker="o",
            label=backend,
        )
    right.plot(
        seqs,
        [r["ideal_speedup"] for r in rows],
        linestyle=":",
        marker="x",
        color="grey",
        label="ideal",
    )
    right.set_ylabel("speedup against nccl")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.minorticks_off()
        ax.set_xlabel(f"seq (batch {rows[0]['batch']}, {rows[0]['model']} x{rows[0]['layers']} layers)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)
