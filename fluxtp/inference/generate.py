"""Greedy generation; on GPUs the decode step is captured once in a CUDA graph and replayed.

A DecodeGraph is one TPLlama.decode_step (embedding, every layer with its two all-reduces, the
vocab-parallel head and its gather, argmax) for a fixed batch, recorded with static buffers: the
input token ids, the logits and the next token ids live at fixed addresses; the position comes
from the KV cache's device-side length. A replay is one kernel-launch-free decode step.

Capture rules (why the code looks like this):
- Warm up first, outside capture, with the same backend and batch: NCCL communicators are
  created, and the fused/torch backends allocate and rendezvous their symmetric workspaces, on
  first use; neither may happen inside capture.
- A graph holds the addresses of those workspaces. A later, larger call (a bigger prefill) may
  grow a workspace and free the old one, so a graph records the workspace sizes it was captured
  with and is re-captured when they changed (the same decision on every rank: workspaces grow
  collectively, at the same call).
- Capture in "thread_local" error mode: torch.distributed's watchdog thread queries CUDA events
  of earlier collectives while we capture, which the default global mode would reject.
"""

from __future__ import annotations

import torch

WARMUP_STEPS = 2


def workspace_sizes() -> tuple:
    """(key, bytes) of every symmetric workspace fluxtp's backends hold in this process."""
    from fluxtp import symm

    return tuple(sorted((key, buf.nbytes) for key, buf in getattr(symm, "_buffers", {}).items()))


class DecodeGraph:
    """TPLlama.decode_step of `batch` sequences captured in a torch.cuda.CUDAGraph.

    Write the input ids into `tokens` [batch], call `replay()`, read `logits` [batch, vocab] and
    `next_tokens` [batch] (their greedy argmax). With advance=True each replay also moves the
    cache length on by one; advance=False decodes at the same position every time (benchmarks).
    The backend is the model's at capture time.
    """

    def __init__(self, model, batch: int, *, advance: bool = True, warmup: int = WARMUP_STEPS):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, this one is on {model.device}")
        model._require_cache(batch, 1)
        self.model, self.batch, self.advance, self.backend = model, batch, advance, model.backend
        self.cache = model.cache
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        # Warm-up steps write keys at position `length` without advancing: the slot the first
        # real step overwrites before anything reads it.
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model.decode_step(self.tokens, advance=False)
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.workspaces = workspace_sizes()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.logits = model.decode_step(self.tokens, advance=advance)
            self.next_tokens = self.logits.argmax(-1)

    def stale(self) -> bool:
        """True when the graph may point at freed memory: the model's cache or a workspace changed."""
        return self.model.cache is not self.cache or workspace_sizes() != self.workspaces

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.next_tokens


def decode_graph(model, batch: int, *, advance: bool = True) -> DecodeGraph:
    """The model's captured decode step for (batch, backend, advance), captured now if it has none
    or its graph is stale. Collective: call on every rank alike."""
    key = (batch, model.backend, advance)
    graph = model.decode_graphs.get(key)
    if graph is None or graph.stale():
        model.decode_graphs.pop(key, None)  # free the old graph's memory before capturing anew
        graph = DecodeGraph(model, batch, advance=advance)
        model.decode_graphs[key] = graph
    return graph


@torch.no_grad()
def generate(
    model,
    prompt_tokens: torch.Tensor,
    max_new_tokens: int,
    *,
    cuda_graph: bool = True,
    return_logits: bool = False,
):
    """Greedy decoding of prompts [B, S] (one length, no padding) for max_new_tokens tokens.

    Uses the model's KV cache when it fits (B <= max_batch, S + max_new_tokens - 1 <= max_len),
    else allocates one of exactly that size (decode attends over the whole cache, so a much
    larger cache costs time). On CUDA with cuda_graph=True every decode step after the first
    token is a replay of one captured graph (kept for the next call of the same batch size);
    on CPU the steps run eagerly. No stop token: always max_new_tokens tokens.

    Returns the new token ids [B, max_new_tokens], the same on every rank, and with
    return_logits=True also each step's logits [B, max_new_tokens, vocab].
    """
    if prompt_tokens.dim() != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be [batch, seq] with seq >= 1, got shape {tuple(prompt_tokens.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    batch, seq = prompt_tokens.shape
    needed = seq + max_new_tokens - 1  # the last new token is never fed back
    cache = model.cache
    if cache is None or batch > cache.max_batch or needed > cache.max_len:
        model.allocate_cache(batch, needed)
    prompt_tokens = prompt_tokens.to(model.device)

    out = torch.empty(batch, max_new_tokens, dtype=torch.long, device=model.device)
    all_logits = None
    logits = model.prefill(prompt_tokens)
    if return_logits:
        all_logits = logits.new_empty(batch, max_new_tokens, logits.shape[-1])
        all_logits[:, 0] = logits
    out[:, 0] = logits.argmax(-1)
    if max_new_tokens > 1 and cuda_graph and model.device.type == "cuda":
        graph = decode_graph(model, batch)
        graph.tokens.copy_(out[:, 0])
        for i in range(1, max_new_tokens):
            graph.replay()
            out[:, i] = graph.next_tokens
            if return_logits:
                all_logits[:, i] = graph.logits
            graph.tokens.copy_(graph.next_tokens)
    else:
        for i in range(1, max_new_tokens):
            logits = model.decode_step(out[:, i - 1])
            out[:, i] = logits.argmax(-1)
            if return_logits:
                all_logits[:, i] = logits
    return (out, all_logits) if return_logits else out
