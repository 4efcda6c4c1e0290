"""The README's headline picture: the fused ops' speedup by tokens, per TP degree, from results JSONs.

    python benchmarks/plot_headline.py [--out benchmarks/results/headline-h200.png]

Reads the current `fluxtp bench` results of the two sequence-parallel ops on H200 at LLaMA-70B
MLP dims (HEADLINE below: which file holds which op at which TP degree) and draws, per op, the
fused backend's speedup over NCCL-then-cuBLAS (T_nccl / T_fused, with the middle half of the
per-round speedups as a band) and over PyTorch's async-TP (T_torch / T_fused, the ratio of the
two medians of the same run) against M, the layer's global tokens. Nothing is measured here:
every point is a number of those files, and the figure names them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# (op, TP degree) -> (results file, N, K): LLaMA-70B's MLP up (all-gather) and down (reduce-scatter).
HEADLINE = {
    ("all_gather_matmul", 2): ("ops-h200-x2-2026-11-28-all_gather_matmul-70b.json", 28672, 8192),
    ("all_gather_matmul", 4): ("ops-h200-x4-2026-11-28-all_gather_matmul-70b.json", 28672, 8192),
    ("matmul_reduce_scatter", 2): ("ops-h200-x2-2026-11-28-matmul_reduce_scatter-70b.json", 8192, 28672),
    ("matmul_reduce_scatter", 4): ("ops-h200-x4-2026-11-28-matmul_reduce_scatter-70b.json", 8192, 28672),
}
TITLES = {
    "all_gather_matmul": "AllGather + GEMM (N 28672, K 8192)",
    "matmul_reduce_scatter": "GEMM + ReduceScatter (N 8192, K 28672)",
}


def speedups(path: Path, op: str, n: int, k: int) -> list[dict]:
    """Per M (ascending): fused over nccl with its middle half (None where the file has none),
    and fused over torch, of one file."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != "fluxtp.bench/1" or data.get("scenario") != "ops":
        raise ValueError(f"{path}: not a fluxtp.bench/1 ops result")
    points = []
    for row in data["rows"]:
        if row["op"] != op or row["N"] != n or row["K"] != k or row.get("cuda_graphs"):
            continue
        ms = row["ms"]
        points.append(
            {
                "M": row["M"],
                "vs_nccl": row["speedup_vs_nccl"]["fused"],
                # older runs recorded no per-round spread
                "vs_nccl_iqr": tuple(row["speedup_vs_nccl_iqr"]["fused"]) if "speedup_vs_nccl_iqr" in row else None,
                "vs_torch": ms["torch"] / ms["fused"],
            }
        )
    if not points:
        raise ValueError(f"{path}: no eager {op} rows at N {n}, K {k}")
    return sorted(points, key=lambda p: p["M"])


def plot(out: Path, results: Path = RESULTS) -> list[str]:
    """Draw the headline figure into `out`; returns the results files it read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = {2: "tab:blue", 4: "tab:orange"}
    used = []
    for ax, op in zip(axes, TITLES):
        for (op_, world), (name, n, k) in HEADLINE.items():
            if op_ != op:
                continue
            used.append(name)
            pts = speedups(results / name, op, n, k)
            m = [p["M"] for p in pts]
            ax.plot(m, [p["vs_nccl"] for p in pts], "o-", color=colors[world], label=f"TP={world} vs NCCL then cuBLAS")
            if all(p["vs_nccl_iqr"] for p in pts):
                low, high = zip(*(p["vs_nccl_iqr"] for p in pts))
                ax.fill_between(m, low, high, color=colors[world], alpha=0.2)
            ax.plot(m, [p["vs_torch"] for p in pts], "s--", color=colors[world], label=f"TP={world} vs torch async-TP")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1024, 2048, 4096, 8192, 16384], labels=["1024", "2048", "4096", "8192", "16384"])
        ax.set_xlabel("tokens M (global)")
        ax.set_title(TITLES[op], fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup of fused (x)")
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("fluxtp fused ops on H200 (NVLink), bf16, LLaMA-70B MLP, eager: speedup of the fused backend", fontsize=10)
    footer = "data (benchmarks/results/): " + ", ".join(used[:2]) + ",\n" + ", ".join(used[2:])
    footer += "\nband: the middle half of the per-round speedups over NCCL, where the run recorded it"
    fig.text(0.5, 0.005, footer, ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return used


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "headline-h200.png")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of the results JSONs")
    args = parser.parse_args(argv)
    for name in plot(args.out, args.results):
        print(f"read {name}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
