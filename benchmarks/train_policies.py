"""Which calls of a training step should run fused: the step under per-call policies.

    torchrun --nproc-per-node N benchmarks/train_policies.py [--fp8] [--model llama3-70b]
        [--layers 2] [--seq 4096,8192] [--rounds 20] [--out policies.json]

The step of `fluxtp bench train` (fluxtp.bench.train.Trainer), with --fp8 that of `--fp8 row-wise`
(fluxtp.nn's FP8 recipe, whose forward accumulates fast and whose gradient GEMMs precisely). A
policy sends each all-gather or reduce-scatter GEMM to the fused backend or to nccl by its op (and,
in FP8, its accumulation), registered as a backend of its own (fluxtp.backends.register) whose plan
is the fused or the reference one; the variants (nccl, fused, the policies and no_comm, the step
without communication) are interleaved by the bench's harness. Rank 0 prints each variant's median
step and its speedup over nccl and writes the JSON (fluxtp.bench/1 envelope, scenario
"train_policies"). What `auto` does follows from it (fluxtp/backends/fused/__init__.py, docs/fp8.md).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from tabulate import tabulate

from fluxtp import backends
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.backends import fused, reference
from fluxtp.bench import train
from fluxtp.bench.harness import Variant, measure_rounds, speedup, speedup_iqr

sys.path.insert(0, str(Path(__file__).parent))
from _train_steps import step_parser, trainer, write_results  # noqa: E402

ALL_GATHERS = ("all_gather_matmul", "all_gather_scaled_matmul")
REDUCE_SCATTERS = ("matmul_reduce_scatter", "scaled_matmul_reduce_scatter")
# name -> whether a call of (op, use_fast_accum, x, weight, group) goes fused; fast accumulation is
# the FP8 forward's, None for a call that is not scaled.
POLICIES = {
    "all_gathers_fused": lambda op, fast, *call: op in ALL_GATHERS,
    "reduce_scatters_fused": lambda op, fast, *call: op in REDUCE_SCATTERS,
    # the reduce-scatters fused, the layers' all-gathers (which keep the gathered rows) by the
    # thresholds `auto` applies to calls that keep nothing.
    "all_gathers_by_thresholds": lambda op, fast, *call: op in REDUCE_SCATTERS or fused.preferred(op, *call),
}
FP8_POLICIES = {
    "forward_fused": lambda op, fast, *call: fast,
    "backward_fused": lambda op, fast, *call: not fast,
    **{name: POLICIES[name] for name in ("all_gathers_fused", "reduce_scatters_fused")},
    "forward_all_gathers_fused": lambda op, fast, *call: op in ALL_GATHERS and fast,
    "forward_reduce_scatters_fused": lambda op, fast, *call: op in REDUCE_SCATTERS and fast,
}


def register_policy(name: str, goes_fused) -> str:
    """A backend running each call through the fused plan where goes_fused(op, use_fast_accum, x,
    weight, group) says so, else through the reference (NCCL then cuBLAS or torch._scaled_mm)."""
    module = types.ModuleType(name)
    module.unsupported_reason = lambda op, x, weight, info, **details: None

    def plan(op, x, weight, bias, info, *options):  # scaled: out_dtype, use_fast_accum[, return_gathered]
        fast = options[1] if op in backends.SCALED_OPS else None
        name = "fused" if goes_fused(op, fast, x, weight, info) else "nccl"
        return backends.prepare(op, name, x, weight, bias, info, *options)

    module.plan = plan
    for op in (*ALL_GATHERS, *REDUCE_SCATTERS):  # the registry asks that the ops exist
        setattr(module, op, getattr(reference, op))
    backends.register(name, module)
    return name


def main() -> None:
    parser = step_parser(__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="the FP8 step (--fp8 row-wise) and its policies")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()
    policies = FP8_POLICIES if args.fp8 else POLICIES
    names = ["nccl", "fused", *(register_policy(name, rule) for name, rule in policies.items())]
    model = trainer(args, info, device, train.TRAIN_FP8 if args.fp8 else None)
    rows = []
    for seq in model.config.seqs:
        model.set_input(seq)
        train.verify(model, names, info, f"{args.model} x{args.layers} layers, seq {seq}")
        variants = [Variant(v, ((lambda v=v: model.step(v)),)) for v in (*names, train.NO_COMM)]
        timings = measure_rounds(variants, model.config.protocol, info, device)
        ms = timings.ms
        rows.append({"model": args.model, "layers": args.layers, "seq": seq, "fp8": model.config.fp8,
                     "ms": {k: round(v, 3) for k, v in ms.items()},
                     "speedup_vs_nccl": {k: round(speedup(ms["nccl"], v), 4) for k, v in ms.items()},
                     "speedup_vs_nccl_iqr": speedup_iqr(timings, "nccl", list(ms))})  # fmt: skip
    if info.rank == 0:
        variants = list(rows[0]["ms"])
        print(tabulate([[r["seq"], *(f"{r['ms'][v]:.2f} ({r['speedup_vs_nccl'][v]:.3f})" for v in variants)]
                        for r in rows], headers=["seq", *variants]))  # fmt: skip
        if args.out:
            write_results("train_policies", rows, args.out, info, device)
    destroy_process_group()


if __name__ == "__main__":
    main()
