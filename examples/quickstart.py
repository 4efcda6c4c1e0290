"""fluxtp quickstart: a tensor-parallel MLP block with the three ops, checked against one device.

    torchrun --nproc-per-node 2 examples/quickstart.py

On a GPU host each rank drives one GPU (NCCL, bfloat16); on a CPU host the ranks are gloo
processes (float32). backend="auto" (the default) takes the fused kernels where they can run.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fluxtp


def main() -> None:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32

    tokens, hidden, ffn = 128 * world, 512, 1024
    # Every rank draws the same full tensors (same seed), then keeps its shard of each.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    w_up = torch.randn(ffn, hidden, generator=gen) / hidden**0.5  # nn.Linear layout [out, in]
    w_down = torch.randn(hidden, ffn, generator=gen) / ffn**0.5
    my_tokens = slice(rank * tokens // world, (rank + 1) * tokens // world)
    my_features = slice(rank * ffn // world, (rank + 1) * ffn // world)
    x_shard = x[my_tokens].to(device, dtype)  # sequence parallel: this rank's tokens
    w_up_shard = w_up[my_features].to(device, dtype)  # column-parallel: this rank's output features
    w_down_shard = w_down[:, my_features].contiguous().to(device, dtype)  # row-parallel: its input features

    # Training / prefill with sequence parallelism: all-gather + GEMM, then GEMM + reduce-scatter.
    h = F.gelu(fluxtp.all_gather_matmul(x_shard, w_up_shard))  # [tokens, ffn / world]
    y_shard = fluxtp.matmul_reduce_scatter(h, w_down_shard)  # [tokens / world, hidden]
    # Inference without sequence parallelism: GEMM + all-reduce, every rank gets all tokens.
    y_full = fluxtp.matmul_all_reduce(h, w_down_shard)  # [tokens, hidden]

    expected = F.gelu(x @ w_up.T) @ w_down.T  # the same block on one device, float32
    # bfloat16 keeps 8 bits of mantissa: about 1e-2 relative error for this block; float32 ~1e-6.
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    errors = torch.tensor(
        [
            ((y_shard.float().cpu() - expected[my_tokens]).norm() / expected[my_tokens].norm()).item(),
            ((y_full.float().cpu() - expected).norm() / expected.norm()).item(),
        ],
        device=device,
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"world {world} on {device.type}, {dtype}: y_shard {tuple(y_shard.shape)}, y_full {tuple(y_full.shape)}")
        print(f"max relative error against one device: reduce-scatter {errors[0]:.2e}, all-reduce {errors[1]:.2e}")
        assert errors.max().item() <= tolerance, f"error above {tolerance}"
        print("quickstart ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
