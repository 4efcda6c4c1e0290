"""The FP8 training step with the quantization kernel against the eager quantization, beside bf16.

    torchrun --nproc-per-node N benchmarks/fp8_quantization_step.py [--model llama3-70b] [--layers 2]
        [--seq 4096,8192] [--rounds 20] [--out quantization.json]

Two models of `fluxtp bench train`'s step (fluxtp.bench.train.Trainer): one with the layers'
GEMMs in FP8 (`--fp8 row-wise`), one in bf16. Variants, interleaved by the bench's harness:
the FP8 step through nccl with fluxtp.fp8's quantization forced onto its eager path (about ten
float32 passes a quantization, as before the kernel) and with the kernel; the FP8 step through
`auto`; the bf16 step through nccl and `auto`. Rank 0 prints each variant's median step and
writes the JSON (fluxtp.bench/1 envelope, scenario "fp8_quantization_step").
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from tabulate import tabulate

from fluxtp import fp8
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.bench import train
from fluxtp.bench.harness import Variant, measure_rounds
from fluxtp.bench.results import envelope, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b", choices=tuple(train.MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", default="4096,8192")
    parser.add_argument("--rounds", type=int, default=None, help="default: the train scenario's")
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()

    def trainer(fp8_scaling):
        namespace = argparse.Namespace(model=args.model, layers=args.layers, seq=args.seq, batch=1, dtype=None,
                                       backends=None, rounds=args.rounds, fp8=fp8_scaling)  # fmt: skip
        return train.Trainer(train.make_config(namespace, info.world_size, "cuda"), info, device)

    fp8_model, bf16_model = trainer(train.TRAIN_FP8), trainer(None)
    kernel_quantizes = fp8._kernel_quantizes

    def step(model, backend, kernel: bool):
        def run():
            fp8._kernel_quantizes = kernel_quantizes if kernel else (lambda *args, **kwargs: False)
            model.step(backend)

        return run

    variants = {
        "fp8_eager_quantization_nccl": step(fp8_model, "nccl", False),
        "fp8_nccl": step(fp8_model, "nccl", True),
        "fp8_auto": step(fp8_model, "auto", True),
        "bf16_nccl": step(bf16_model, "nccl", True),
        "bf16_auto": step(bf16_model, "auto", True),
    }
    rows = []
    for seq in fp8_model.config.seqs:
        fp8_model.set_input(seq)
        bf16_model.set_input(seq)
        timings = measure_rounds([Variant(k, (v,)) for k, v in variants.items()], fp8_model.config.protocol, info,
                                 device)  # fmt: skip
        rows.append({"model": args.model, "layers": args.layers, "seq": seq,
                     "ms": {k: round(v, 3) for k, v in timings.ms.items()}})  # fmt: skip
    fp8._kernel_quantizes = kernel_quantizes
    if info.rank == 0:
        print(tabulate([[r["seq"], *r["ms"].values()] for r in rows], headers=["seq", *variants], floatfmt=".2f"))
        if args.out:
            data = envelope(
                "fp8_quantization_step", rows, device=torch.cuda.get_device_name(device),
                gpus=torch.cuda.device_count(), world=info.world_size,
                command=f"torchrun --nproc-per-node {info.world_size} benchmarks/fp8_quantization_step.py "
                + shlex.join(sys.argv[1:]),
            )  # fmt: skip
            print("wrote", write_json(data, args.out))
    destroy_process_group()


if __name__ == "__main__":
    main()
