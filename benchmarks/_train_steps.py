"""What the scripts timing `fluxtp bench train`'s step under torchrun share: their common options,
the step's model (fluxtp.bench.train.Trainer) and the results file rank 0 writes."""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from fluxtp._dist import GroupInfo
from fluxtp.bench import train
from fluxtp.bench.results import envelope, write_json


def step_parser(description: str, seq: str = "4096,8192") -> argparse.ArgumentParser:
    """--model, --layers, --seq, --rounds and --out; a script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="llama3-70b", choices=tuple(train.MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", default=seq, help=f"sequence lengths, a comma list (default: {seq})")
    parser.add_argument("--rounds", type=int, default=None, help="default: the train scenario's")
    parser.add_argument("--out", help="write the results JSON here")
    return parser


def trainer(args: argparse.Namespace, info: GroupInfo, device, fp8: str | None) -> train.Trainer:
    """The train scenario's model and step for args' --model, --layers, --seq (and --rounds where
    the script has it), its GEMMs in FP8 with fp8 (train.TRAIN_FP8)."""
    namespace = argparse.Namespace(model=args.model, layers=args.layers, seq=str(args.seq), batch=1, dtype=None,
                                   backends=None, rounds=getattr(args, "rounds", None), fp8=fp8)  # fmt: skip
    return train.Trainer(train.make_config(namespace, info.world_size, "cuda"), info, device)


def write_results(scenario: str, rows: list[dict], path: str, info: GroupInfo, device) -> None:
    """Rank 0's results file (fluxtp.bench/1 envelope), the command as torchrun ran this script."""
    command = f"torchrun --nproc-per-node {info.world_size} {sys.argv[0]} " + shlex.join(sys.argv[1:])
    data = envelope(scenario, rows, device=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
                    world=info.world_size, command=command)  # fmt: skip
    print("wrote", write_json(data, path))
