"""Tensor-parallel inference for LLaMA-style models (the vLLM layout; fluxtp/inference/model.py).

    model = TPLlama.from_pretrained("path/to/checkpoint", group, backend="auto")  # or from_hf, random_init
    tokens = model.generate(prompts, max_new_tokens=64)    # greedy; the decode step in a CUDA graph on GPUs

Files: model.py (the sharded weights, prefill and one decode step), kv_cache.py (the static KV
cache), generate.py (greedy generation and the captured decode step).
"""

from fluxtp.inference.generate import DecodeGraph, decode_graph, generate
from fluxtp.inference.kv_cache import StaticKVCache
from fluxtp.inference.model import TPLlama

__all__ = ["DecodeGraph", "StaticKVCache", "TPLlama", "decode_graph", "generate"]
