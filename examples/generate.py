"""Greedy generation with a tensor-parallel LLaMA-style model (fluxtp.inference.TPLlama).

    torchrun --nproc-per-node 2 examples/generate.py                       # a small random Llama
    torchrun --nproc-per-node 2 examples/generate.py --checkpoint DIR      # a local HF checkpoint

On a GPU host each rank drives one GPU (NCCL, bfloat16) and the decode step is replayed from a
CUDA graph; on a CPU host the ranks are gloo processes (float32) decoding eagerly. Every rank
prints nothing but rank 0, which prints the new token ids and the time per generated token.

Decoding is greedy and does not stop at an end-of-sequence token: every sequence gets exactly
--new-tokens tokens (TPLlama.generate has no stop token), so cut each one after the model's
eos_token_id yourself where it matters.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from fluxtp._dist import destroy_process_group
from fluxtp.inference import TPLlama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a local Hugging Face checkpoint directory (default: random weights)")
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "fused", "nccl", "torch"), help="fluxtp backend (default: auto)"
    )
    parser.add_argument("--batch", type=int, default=2, help="sequences, one random prompt each (default: 2)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default: 16)")
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=32,
        help="tokens generated per sequence, always this many: no stop at end-of-sequence (default: 32)",
    )
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32

    if args.checkpoint:
        model = TPLlama.from_pretrained(args.checkpoint, dtype=dtype, device=device, backend=args.backend)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=4,
            vocab_size=4096,
        )
        model = TPLlama.random_init(config, dtype=dtype, device=device, backend=args.backend, seed=0)

    # The same prompts on every rank: the activations are replicated.
    vocab = model.dims.vocab
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    model.generate(prompts, args.new_tokens)  # warm-up: kernels compiled, the decode step captured
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = model.generate(prompts, args.new_tokens)
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(tokens.tolist())
        print(
            f"{dist.get_world_size()} ranks, {dtype}, batch {args.batch}: prefill of {args.prompt_len} tokens and "
            f"{args.new_tokens} new tokens in {elapsed * 1e3:.1f} ms ({elapsed * 1e3 / args.new_tokens:.2f} ms per token)"
        )
    destroy_process_group()  # frees the captured decode graphs first (a live one hung teardown)


if __name__ == "__main__":
    main()
