"""The `serve` scenario: prefill latency and per-token decode latency of tensor-parallel inference.

The model is fluxtp.inference.TPLlama (the vLLM layout: activations replicated, q/k/v and
gate/up column-parallel without communication, o_proj and down_proj row-parallel through
fluxtp.matmul_all_reduce, the lm_head vocab-parallel with a gather of the logits) with `--layers`
decoder layers at `--model` dims, the whole 128256-token vocabulary and llama3 RoPE; random
weights (TPLlama.random_init: normal(0, 0.02), the same on every rank). Every backend runs on
the same model, cache and prompts; its backend is switched between samples and the variants are
interleaved by fluxtp.bench.harness. One row per (phase, batch, prompt_len):

- prefill: TPLlama.prefill of `batch` prompts of `prompt_len` tokens into an empty KV cache:
  embedding, every layer (causal attention over the prompt), the final norm and the lm_head of
  each prompt's last token with its logits gather. The time to the first token's logits; eager
  (at these token counts launch costs do not matter). One prefill per sample.
- decode: one decode step of `batch` sequences at context length `prompt_len`: the cache holds
  the prompts' keys and values, the step writes the new token's at position prompt_len and
  attends over prompt_len + 1 positions. It includes what one generated token costs a serving
  user: embedding, every layer with its two all-reduces, the final norm, the vocab-parallel
  lm_head, the logits gather and the greedy argmax. On GPUs a call is the replay of the step
  captured in a CUDA graph (one graph per backend, captured after warm-up; the position does not
  advance between replays, so each does the same work); on CPU the step runs eagerly.

Variants: nccl (the baseline), torch, fused (those usable here, or --backends), and `no_comm`:
the model on the bench's no_comm backend (fluxtp/bench/no_comm.py), which replaces every
collective by a local stand-in of the same shapes (the row-parallel layers skip the sum over
ranks, the logits gather repeats this rank's block), so every GEMM, attention, norm and copy
keeps its size and nothing crosses GPUs. Its time is the step with communication perfectly
hidden, as in the train scenario: T_exposed_comm = T_nccl - T_no_comm, ideal_speedup = T_nccl / T_no_comm,
E_overlap[x] = 1 - (T_x - T_no_comm) / T_exposed_comm (the share of the exposed time x hides).

`ms` is the harness's number (median per rank, slowest rank); tokens_per_s counts the whole
batch's tokens (prefill: batch * prompt_len per call; decode: batch per step).

Before timing, each backend's prefill logits and decode-step logits (eager, and on GPUs the graph
replay's) are compared with nccl's: max-norm relative error within train.VERIFY_TOLERANCE (bf16
rounding carried through the layers; a wrong head, KV group or vocabulary block is off by O(1)),
else the benchmark stops. The share of greedy tokens (argmax) equal to nccl's is reported in
the notes; in bfloat16 a near-tie between two random-weight logits may flip one now and then.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass

import torch

from fluxtp._dist import GroupInfo, max_over_ranks
from fluxtp.bench import NO_COMM, BenchError
from fluxtp.bench.harness import Protocol, Timings, Variant, measure_rounds
from fluxtp.bench.progress import describe as describe_bar
from fluxtp.bench.progress import progress_bar
from fluxtp.bench.ops import BASELINE, DEFAULT_DTYPE, DTYPES, parse_backends, relative_error, select_backends
from fluxtp.bench.train import MODELS as LAYER_DIMS
from fluxtp.bench.train import VERIFY_TOLERANCE, LayerDims, step_metrics, step_table

PHASES = ("prefill", "decode")
VOCAB = {"llama3-8b": 128256, "llama3-70b": 128256, "tiny": 1024}
# LLaMA 3's RoPE (rope_theta and the llama3 frequency scaling of 3.1+).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# On GPUs: a llama3-70b layer holds 0.43 G parameters per rank at TP=2 (0.86 GB in bfloat16), the
# replicated embedding and the lm_head half 2.1 + 1.05 GB; the largest default prefill (64 x 2048
# tokens) needs about 15 GB of activations. Each default row is seconds: --layers can go far up.
DEFAULTS = {
    "cuda": {"model": "llama3-70b", "layers": 2, "batch": (1, 8, 64), "prompt_len": (128, 2048)},
    "cpu": {"model": "tiny", "layers": 2, "batch": (1, 4), "prompt_len": (16, 64)},
}
# A prefill is milliseconds to a second: one per sample. A decode replay is tens of
# microseconds to a few milliseconds: several per sample.
PROTOCOLS = {
    "cuda": {
        "prefill": Protocol(rounds=10, warmup_rounds=2, calls_per_sample=1),
        "decode": Protocol(rounds=20, warmup_rounds=3, calls_per_sample=10),
    },
    "cpu": {
        "prefill": Protocol(rounds=5, warmup_rounds=1, calls_per_sample=1),
        "decode": Protocol(rounds=5, warmup_rounds=1, calls_per_sample=3),
    },
}
SEED = 20261122


@dataclass(frozen=True)
class ServeConfig:
    model: str
    dims: LayerDims
    vocab: int
    layers: int
    batches: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    phases: tuple[str, ...]
    dtype: torch.dtype
    backends: tuple[str, ...] | None  # None: every candidate usable here; else the baseline first
    protocols: dict  # phase -> Protocol


# ---------------------------------------------------------------- options


def _sizes(text: str) -> tuple[int, ...]:
    items = [s.strip() for s in str(text).split(",")]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        raise ValueError(f"{text!r} is not a comma list of positive integers (e.g. 1,8,64)")
    return tuple(int(s) for s in items)


def _batch_type(text: str):
    """--batch: one size (an int, what train takes) or a comma list (a tuple, for serve)."""
    try:
        sizes = _sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return sizes[0] if len(sizes) == 1 else sizes


def add_arguments(group) -> None:
    """serve's options. `fluxtp bench` puts every scenario's options into one parser, and the train
    scenario (registered before this one) already defines --model, --layers and --batch: serve
    shares them (the same layer sizes and count), and widens --batch to take a comma list."""
    existing = group._option_string_actions  # the parser's table, shared by its argument groups
    group.description = (
        "also --model, --layers (the layer sizes of --model; vocabulary "
        + ", ".join(f"{v} for {m}" for m, v in VOCAB.items())
        + ") and --batch (a list)"
    )
    if "--model" not in existing:
        group.add_argument("--model", choices=tuple(LAYER_DIMS), help="layer sizes (default: llama3-70b on GPUs)")
    if "--layers" not in existing:
        group.add_argument("--layers", type=int, help="decoder layers (default: 2)")
    serve_batch = "serve: batch sizes, a row each (default: 1,8,64 on GPUs, 1,4 on CPU)"
    if "--batch" in existing:
        batch = existing["--batch"]
        batch.type, batch.metavar = _batch_type, "B[,B...]"
        batch.help = f"train: {batch.help}; {serve_batch}"
    else:
        group.add_argument("--batch", type=_batch_type, metavar="B[,B...]", help=serve_batch)
    group.add_argument(
        "--prompt-len",
        metavar="S,...",
        help="prompt lengths, a row each: prefill of S tokens per sequence, decode at context length S "
        "(default on GPUs: 128,2048; on CPU: 16,64)",
    )
    group.add_argument(
        "--phase", choices=("prefill", "decode", "both"), default="both", help="what to time (default: both)"
    )


def make_config(args: argparse.Namespace, world: int, device_type: str) -> ServeConfig:
    defaults = DEFAULTS[device_type]
    model = args.model or defaults["model"]
    dims = LAYER_DIMS[model]
    layers = defaults["layers"] if args.layers is None else args.layers
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    batch = args.batch if args.batch is not None else defaults["batch"]
    batches = (batch,) if isinstance(batch, int) else tuple(batch)
    try:
        prompt_lens = _sizes(args.prompt_len) if args.prompt_len else defaults["prompt_len"]
    except ValueError as e:
        raise ValueError(f"--prompt-len: {e}") from None
    for what, n in (("attention heads", dims.heads), ("KV heads", dims.kv_heads), ("FFN features", dims.ffn)):
        if n % world:
            raise ValueError(f"--model {model}: its {n} {what} do not divide over the world size {world}")
    phases = PHASES if args.phase in (None, "both") else (args.phase,)
    dtype_name = args.dtype or DEFAULT_DTYPE[device_type]
    protocols = dict(PROTOCOLS[device_type])
    if args.rounds is not None:
        protocols = {k: Protocol(args.rounds, p.warmup_rounds, p.calls_per_sample) for k, p in protocols.items()}
    return ServeConfig(
        model,
        dims,
        VOCAB[model],
        layers,
        batches,
        prompt_lens,
        phases,
        DTYPES[dtype_name],
        parse_backends(args.backends),
        protocols,
    )


# ---------------------------------------------------------------- the model


def llama_config(config: ServeConfig):
    """A transformers LlamaConfig of the benchmark's model (its layer count is config.layers)."""
    from transformers import LlamaConfig

    d = config.dims
    return LlamaConfig(
        hidden_size=d.hidden,
        intermediate_size=d.ffn,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        num_hidden_layers=config.layers,
        vocab_size=config.vocab,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False,
    )


def _select_backends(config: ServeConfig, info: GroupInfo, device) -> tuple[list[str], dict[str, str]]:
    """Backends to time (baseline first) and why the others were left out: a backend must run
    both row-parallel layers (o_proj: k = heads*head_dim/W, down_proj: k = ffn/W; N = hidden)."""
    d, world = config.dims, info.world_size
    head_dim = d.hidden // d.heads
    stand_ins = [
        (
            "matmul_all_reduce",
            torch.empty(8, k, dtype=config.dtype, device=device),
            torch.empty(d.hidden, k, dtype=config.dtype, device=device),
        )
        for k in (d.heads * head_dim // world, d.ffn // world)
    ]
    return select_backends(config.backends, stand_ins, info, f"the layers with {config.dtype} on {device}")


# ---------------------------------------------------------------- verification


class Agreement:
    """Greedy tokens of each backend equal to nccl's, counted over every check of the run."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}

    def add(self, name: str, logits: torch.Tensor, ref: torch.Tensor) -> None:
        same = int((logits.argmax(-1) == ref.argmax(-1)).sum())
        count = self.counts.setdefault(name, [0, 0])
        count[0] += same
        count[1] += ref.shape[0]

    def note(self) -> str | None:
        compared = {n: c for n, c in self.counts.items() if n != BASELINE}
        if not compared:
            return None
        parts = [f"{n} {100 * same / total:.1f}% ({same}/{total})" for n, (same, total) in compared.items()]
        return (
            "every backend's logits agree with nccl's before timing (prefill and decode step); greedy tokens "
            "equal to nccl's: " + ", ".join(parts)
        )


def _check(
    name: str, logits: torch.Tensor, ref: torch.Tensor, info: GroupInfo, where: str, what: str, tolerance
) -> None:
    """BenchError on every rank when `logits` is off nccl's `ref` by more than the tolerance."""
    error = relative_error(logits, ref) if logits.shape == ref.shape else math.inf
    (error,) = max_over_ranks([error], info, ref.device)
    if not error <= tolerance:
        how = "NaN, Inf or a wrong shape" if math.isinf(error) else f"max-norm relative error {error:.3g}"
        raise BenchError(
            f"verification failed: backend {name!r} on {where}, {what}: {how} of the logits against the nccl "
            f"reference (worst rank), allowed {tolerance:.3g}; nothing was timed"
        )


# ---------------------------------------------------------------- run


def _prefill(model, backend: str, prompts: torch.Tensor) -> torch.Tensor:
    model.backend = backend
    return model.prefill(prompts)


def _decode_eager(model, backend: str, tokens: torch.Tensor) -> torch.Tensor:
    model.backend = backend
    return model.decode_step(tokens, advance=False).argmax(-1)


def _time_prefill(model, config, names, prompts, info, device, agreement, where, on_round) -> Timings:
    tolerance = VERIFY_TOLERANCE[config.dtype]
    first = {name: _prefill(model, name, prompts) for name in names}
    for name in names:
        _check(name, first[name], first[BASELINE], info, where, "prefill", tolerance)
        agreement.add(name, first[name], first[BASELINE])
    variants = [Variant(v, (functools.partial(_prefill, model, v, prompts),)) for v in (*names, NO_COMM)]
    return measure_rounds(variants, config.protocols["prefill"], info, device, on_round)


def _time_decode(model, config, names, prompts, info, device, agreement, where, on_round) -> Timings:
    """Decode steps at position prompt_len over the cache of an nccl prefill of the prompts
    (every check and sample reads the same cache; a step rewrites only its own slot)."""
    from fluxtp.inference import DecodeGraph

    tolerance = VERIFY_TOLERANCE[config.dtype]
    tokens = _prefill(model, BASELINE, prompts).argmax(-1)
    step = {}
    for name in names:
        model.backend = name
        step[name] = model.decode_step(tokens, advance=False)
    for name in names:
        _check(name, step[name], step[BASELINE], info, where, "decode step", tolerance)
        agreement.add(name, step[name], step[BASELINE])
    if device.type != "cuda":
        variants = [Variant(v, (functools.partial(_decode_eager, model, v, tokens),)) for v in (*names, NO_COMM)]
        return measure_rounds(variants, config.protocols["decode"], info, device, on_round)
    graphs = {}
    for variant in (*names, NO_COMM):  # the same order on every rank: the captures' warm-ups are collective
        model.backend = variant
        graph = DecodeGraph(model, batch=tokens.shape[0], advance=False)
        graph.tokens.copy_(tokens)
        graph.replay()
        if variant != NO_COMM:
            _check(
                variant, graph.logits, step[BASELINE], info, where, "decode step replayed from a CUDA graph", tolerance
            )
        graphs[variant] = graph
    model.backend = BASELINE
    if any(g.stale() for g in graphs.values()):  # the eager checks sized every workspace: never expected
        raise BenchError(f"a symmetric workspace grew while the decode graphs were captured ({where})")
    variants = [Variant(v, (g.graph.replay,)) for v, g in graphs.items()]
    return measure_rounds(variants, config.protocols["decode"], info, device, on_round)


def _run_case(model, config: ServeConfig, names, batch: int, prompt_len: int, info, device, agreement, on_round):
    """The rows of one (batch, prompt_len): for each phase, verify, then time."""
    where = f"{config.model} x{config.layers} layers, batch {batch}, prompt_len {prompt_len}"
    model.allocate_cache(batch, prompt_len + 1)
    # The same prompts on every rank (activations are replicated): one seed for all.
    generator = torch.Generator(device=device).manual_seed(SEED + 7919 * batch + prompt_len)
    prompts = torch.randint(0, config.vocab, (batch, prompt_len), generator=generator, device=device)
    rows = []
    for phase, timer in (("prefill", _time_prefill), ("decode", _time_decode)):
        if phase in config.phases:
            timings = timer(model, config, names, prompts, info, device, agreement, where, on_round)
            rows.append(_row(phase, config, batch, prompt_len, names, timings))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the decode graphs' pools, prefill activations
    return rows


def run(config: ServeConfig, info: GroupInfo, device: torch.device, show_progress: bool):
    """Verify, then time prefill and decode per backend for every (batch, prompt_len); collective
    over the ranks of `info`. Returns (rows, notes)."""
    from fluxtp.inference import TPLlama

    names, skipped = _select_backends(config, info, device)
    with torch.no_grad():
        model = TPLlama.random_init(
            llama_config(config), info.group, dtype=config.dtype, device=device, backend=BASELINE, seed=SEED
        )
        cases = [(b, s) for b in config.batches for s in config.prompt_lens]
        rounds = sum(config.protocols[p].rounds for p in config.phases)
        bar = progress_bar(len(cases) * rounds, "round", show_progress)
        agreement, rows = Agreement(), []
        try:
            for batch, prompt_len in cases:
                describe_bar(bar, f"batch {batch} prompt_len {prompt_len}")
                rows += _run_case(
                    model, config, names, batch, prompt_len, info, device, agreement, lambda: bar.update(1)
                )
                model.cache = None  # the next case's cache may be larger
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            bar.close()
    notes = [note for note in (agreement.note(),) if note]
    notes += [f"backend {name!r} not timed: {reason}" for name, reason in skipped.items()]
    return rows, notes


def _row(phase: str, config: ServeConfig, batch: int, prompt_len: int, names, timings: Timings) -> dict:
    tokens = batch * prompt_len if phase == "prefill" else batch
    return {
        "phase": phase,
        "model": config.model,
        "layers": config.layers,
        "batch": batch,
        "prompt_len": prompt_len,
        "dtype": str(config.dtype).removeprefix("torch."),
        **step_metrics(timings, names, tokens, ms_digits=5),
    }


# ---------------------------------------------------------------- report


def format_table(rows: list[dict]) -> str:
    """One table per phase: ms of every variant, tokens/s and speedup of each backend, the
    exposed communication and how much of it each backend hides."""
    parts = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        phase_rows = [r for r in rows if r["phase"] == phase]
        what = {
            "prefill": "prefill latency: batch x prompt_len tokens from an empty cache to the last tokens' logits",
            "decode": "decode latency per token: one step of the batch at context prompt_len, lm_head and argmax "
            "included",
        }[phase]
        title = f"{what} ({phase_rows[0]['dtype']}; {NO_COMM}: nccl with every collective removed)"
        parts.append(step_table(phase_rows, ["model", "layers", "batch", "prompt_len"], title))
    return "\n\n".join(parts)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Per phase: time per call of every variant (top) and each backend's speedup against nccl
    beside the ideal (bottom), over the (batch, prompt_len) cases."""
    from fluxtp.bench.plot import _pyplot, save_figure

    plt = _pyplot()
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    fig, axes = plt.subplots(2, len(phases), figsize=(6 * len(phases), 7), squeeze=False)
    for col, phase in enumerate(phases):
        phase_rows = sorted((r for r in rows if r["phase"] == phase), key=lambda r: (r["prompt_len"], r["batch"]))
        labels = [f"b{r['batch']}\ns{r['prompt_len']}" for r in phase_rows]
        x = list(range(len(phase_rows)))
        top, bottom = axes[0][col], axes[1][col]
        for variant in dict.fromkeys(k for r in phase_rows for k in r["ms"]):
            top.plot(x, [r["ms"].get(variant) for r in phase_rows], marker="o", label=variant)
        for name in dict.fromkeys(k for r in phase_rows for k in r["speedup_vs_nccl"]):
            bottom.plot(x, [r["speedup_vs_nccl"].get(name) for r in phase_rows], marker="o", label=name)
        top.set_yscale("log")
        top.set_ylabel("ms per call (slowest rank)")
        top.set_title(f"{phase} ({phase_rows[0]['model']} x{phase_rows[0]['layers']} layers)", fontsize=10)
        bottom.plot(x, [r["ideal_speedup"] for r in phase_rows], linestyle=":", marker="x", color="grey", label="ideal")
        bottom.axhline(1.0, color="grey", linewidth=0.8)
        bottom.set_ylabel("speedup against nccl")
        for ax in (top, bottom):
            ax.set_xticks(x, labels, fontsize=8)
            ax.set_xlabel("batch b, prompt_len s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path, title)
