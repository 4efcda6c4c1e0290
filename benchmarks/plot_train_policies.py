"""The training step's speedup by tokens with each kind of call sent fused: a figure from
`benchmarks/train_policies.py` results.

    python benchmarks/plot_train_policies.py FILE.json [FILE.json ...] --out policies.png

One panel per (bf16 or FP8, TP degree) among the files; in it, per policy, the step's speedup over
NCCL's (T_nccl / T_policy, the middle half of the per-round speedups as a band) against the step's
tokens. Each point is a ratio of one run (its variants interleaved); points of one line may come
from different runs of the same step, and the figure names the files. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The policies drawn, in this order, with their labels; a file's other variants are left out.
POLICIES = {
    "fused": "every call fused",
    "reduce_scatters_fused": "only the reduce-scatters fused",
    "all_gathers_fused": "only the all-gathers fused",
    "no_comm": "no communication (the ceiling)",
}


def panels(paths: list[Path]) -> dict[tuple[str, int], dict[str, list[tuple[int, float, tuple | None]]]]:
    """(dtype, TP degree) -> policy -> [(tokens, speedup over NCCL, its middle half or None)],
    sorted by tokens, from the files' rows."""
    out: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != "fluxtp.bench/1" or data.get("scenario") != "train_policies":
            raise ValueError(f"{path}: not a fluxtp.bench/1 train_policies result")
        for row in data["rows"]:
            panel = out.setdefault(("FP8" if row["fp8"] else "bf16", data["world"]), {})
            for policy in POLICIES:
                if policy not in row["speedup_vs_nccl"]:
                    continue
                iqr = row.get("speedup_vs_nccl_iqr", {}).get(policy)
                panel.setdefault(policy, []).append((row["seq"], row["speedup_vs_nccl"][policy], tuple(iqr) if iqr else None))
    for panel in out.values():
        for points in panel.values():
            points.sort()
    if not out:
        raise ValueError("no rows in the files given")
    return out


def plot(paths: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(paths)
    keys = sorted(drawn, key=lambda key: (key[0] != "bf16", -key[1]))
    columns = min(2, len(keys))
    rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.8 * rows + 0.8), sharey=True, squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        for policy, points in drawn[key].items():
            tokens = [p[0] for p in points]
            line = "--" if policy == "no_comm" else "o-"
            (handle,) = ax.plot(tokens, [p[1] for p in points], line, label=POLICIES[policy])
            if all(p[2] for p in points):
                ax.fill_between(tokens, [p[2][0] for p in points], [p[2][1] for p in points], color=handle.get_color(), alpha=0.15)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for points in drawn[key].values() for p in points})
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.set_xlabel("tokens a step")
        ax.set_title(f"{key[0]}, TP={key[1]}", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("step speedup over NCCL's (x)")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle("the training step (fluxtp bench train's layers) with each kind of call sent fused", fontsize=10)
    names = [Path(p).name for p in paths]
    footer = "data (benchmarks/results/): " + "\n".join(", ".join(names[i : i + 2]) for i in range(0, len(names), 2))
    fig.text(0.5, 0.005, footer + "\nband: the middle half of the per-round speedups", ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, (0.03 + 0.018 * (len(names) // 2 + 1)) / rows * 2, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="train_policies.py results JSONs")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    plot(args.files, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
