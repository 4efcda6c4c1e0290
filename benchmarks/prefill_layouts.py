"""TPLlama's prefill in its two layouts on the local GPUs, per backend, interleaved: where the
switch to sequence parallelism belongs (fluxtp.inference.model.SEQUENCE_PARALLEL_MIN_TOKENS).

    torchrun --nproc-per-node 2 benchmarks/prefill_layouts.py [--tokens 256,512,1024,2048] [--out results.json]

For each prompt length (one prompt: its rows), llama3-70b layers with random weights (as `fluxtp
bench serve` builds them) run the prefill on each backend (nccl, fused, auto) in the all-reduce
layout and sequence parallel (sequence_parallel_min_tokens forced either way), eager, timed with
fluxtp.bench.harness (interleaved rounds, medians, max over ranks). Each variant's logits are
checked against nccl's in the all-reduce layout first. Writes the fluxtp.bench/1 envelope
(scenario "prefill_layouts").
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys

import torch

from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.bench.harness import Protocol, Variant, measure
from fluxtp.bench.ops import relative_error
from fluxtp.bench.results import envelope, write_json
from fluxtp.bench.serve import SEED, VOCAB, llama_config, make_config
from fluxtp.bench.train import VERIFY_TOLERANCE
from fluxtp.inference import TPLlama

BACKENDS = ("nccl", "fused", "auto")
LAYOUTS = {"all_reduce": 1 << 62, "sequence_parallel": 0}  # sequence_parallel_min_tokens forcing each


def _prefill(model, backend: str, min_tokens: int, prompts: torch.Tensor) -> torch.Tensor:
    model.backend, model.sequence_parallel_min_tokens = backend, min_tokens
    return model.prefill(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,512,1024,2048", help="prompt lengths (one prompt each)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()
    serve = make_config(argparse.Namespace(model="llama3-70b", layers=args.layers, batch=1, prompt_len=args.tokens,
                                           phase="prefill", dtype=None, rounds=None, backends=None),
                        info.world_size, "cuda")  # fmt: skip
    tolerance = VERIFY_TOLERANCE[serve.dtype]
    rows = []
    with torch.no_grad():
        model = TPLlama.random_init(llama_config(serve), info.group, dtype=serve.dtype, device=device, seed=SEED)
        for tokens in serve.prompt_lens:
            model.allocate_cache(1, tokens)
            generator = torch.Generator(device=device).manual_seed(SEED + tokens)  # the same prompt on every rank
            prompts = torch.randint(0, VOCAB[serve.model], (1, tokens), generator=generator, device=device)
            calls = {f"{b}_{layout}": functools.partial(_prefill, model, b, min_tokens, prompts)
                     for b in BACKENDS for layout, min_tokens in LAYOUTS.items()}  # fmt: skip
            ref = calls["nccl_all_reduce"]()
            for name, call in calls.items():
                error = relative_error(call(), ref)
                assert error <= tolerance, f"{tokens} tokens, {name}: logits off nccl's by {error:.3g} (allowed {tolerance})"
            variants = [Variant(name, (call,)) for name, call in calls.items()]
            ms = measure(variants, Protocol(rounds=args.rounds, warmup_rounds=2, calls_per_sample=1), info, device)
            row = {"model": serve.model, "layers": args.layers, "tokens": tokens, "dtype": str(serve.dtype).removeprefix("torch."),
                   "ms": {n: round(v, 4) for n, v in ms.items()},
                   "speedup_vs_nccl_all_reduce": {n: round(ms["nccl_all_reduce"] / v, 3) for n, v in ms.items()}}  # fmt: skip
            rows.append(row)
            if info.rank == 0:
                print(tokens, "tokens", row["speedup_vs_nccl_all_reduce"], flush=True)
            model.cache = None
            torch.cuda.empty_cache()
    if info.rank == 0 and args.out:
        command = f"torchrun --nproc-per-node {info.world_size} benchmarks/prefill_layouts.py " + shlex.join(sys.argv[1:])
        data = envelope("prefill_layouts", rows, device=torch.cuda.get_device_name(device),
                        gpus=torch.cuda.device_count(), world=info.world_size, command=command)  # fmt: skip
        print("wrote", write_json(data, args.out))
    destroy_process_group()


if __name__ == "__main__":
    main()
