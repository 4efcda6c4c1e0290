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

import sys
from pathlib import Path

from tabulate import tabulate

from fluxtp import fp8
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.bench import train
from fluxtp.bench.harness import Variant, measure_rounds

sys.path.insert(0, str(Path(__file__).parent))
from _train_steps import step_parser, trainer, write_results  # noqa: E402


def main() -> None:
    args = step_parser(__doc__.splitlines()[0]).parse_args()
    device, info = init_torchrun_cuda()
    fp8_model, bf16_model = trainer(args, info, device, train.TRAIN_FP8), trainer(args, info, device, None)
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
            write_results("fp8_quantization_step", rows, args.out, info, device)
    destroy_process_group()


if __name__ == "__main__":
    main()
