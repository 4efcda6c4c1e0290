"""Pictures of benchmark rows (matplotlib is optional: `pip install "fluxtp[plot]"`)."""

from __future__ import annotations

MATPLOTLIB_MISSING = 'plotting needs matplotlib, which is not installed: pip install "fluxtp[plot]" (or matplotlib)'


def matplotlib_missing() -> str | None:
    """None when matplotlib can be imported, else the message to show."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MATPLOTLIB_MISSING
    return None


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError(MATPLOTLIB_MISSING) from e
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, title: str, fontsize: int = 11) -> None:
    """The common ending of every benchmark picture: the title, a tight layout, a 120-dpi file
    at `path`, the figure closed (pyplot keeps open figures alive)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ops(rows: list[dict], path: str, title: str) -> None:
    """One panel per op: E_overlap against M for each backend compared with NCCL, or, when only
    the baseline ran (the CPU demo), time per call against M for every variant."""
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        op_rows = sorted((r for r in rows if r["op"] == op), key=lambda r: r["M"])
        layers = list(dict.fromkeys((r["N"], r["K"]) for r in op_rows))
        compared = [
            b
            for b in dict.fromkeys(k for r in op_rows for k in r["E_overlap"])
            if b != "nccl" and any(r["E_overlap"].get(b) is not None for r in op_rows)
        ]
        metric, keys = (
            ("E_overlap", compared) if compared else ("ms", list(dict.fromkeys(k for r in op_rows for k in r["ms"])))
        )
        for n, k in layers:
            for key in keys:
                points = [(r["M"], r[metric].get(key)) for r in op_rows if (r["N"], r["K"]) == (n, k)]
                points = [(m, v) for m, v in points if v is not None]
                if not points:
                    continue
                label = key if len(layers) == 1 else f"{key} N={n} K={k}"
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ms = sorted({r["M"] for r in op_rows})
        ax.set_xticks(ms, [str(m) for m in ms])  # the measured M values, not powers of two
        ax.minorticks_off()
        ax.set_xlabel("M (tokens, global)")
        if metric == "E_overlap":
            ax.axhline(0.0, color="grey", linewidth=0.8)  # 0: no better than NCCL then GEMM
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")  # 1: communication fully hidden
            ax.set_ylabel("E_overlap (1 = hidden, 0 = NCCL then GEMM)")
        else:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.set_ylabel("ms per call (slowest rank)")
        layer = f"N={layers[0][0]} K={layers[0][1]}" if len(layers) == 1 else "several layers"
        ax.set_title(f"{op}\n{layer}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)


def plot_gemm(rows: list[dict], path: str, title: str) -> None:
    """`fluxtp bench gemm`'s rows: one panel per op, fused/cuBLAS time against M, a line per TP
    degree (and layer and dtype where the rows hold several)."""
    plt = _pyplot()
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        op_rows = sorted((r for r in rows if r["op"] == op), key=lambda r: r["M"])
        lines: dict[tuple, list] = {}
        for r in op_rows:
            lines.setdefault((r["world"], r["N"], r["K"], r["dtype"]), []).append((r["M"], r["fused_vs_cublas"]))
        several_layers = len({key[1:] for key in lines}) > 1
        for (world, n, k, dtype), points in lines.items():
            layer = f" N={n} K={k} {dtype}" if several_layers else ""
            ax.plot(*zip(*points), marker="o", label=f"TP={world}{layer}")
        ax.set_xscale("log", base=2)
        ms = sorted({r["M"] for r in op_rows})
        ax.set_xticks(ms, [str(m) for m in ms])  # the measured M values, not powers of two
        ax.minorticks_off()
        ax.axhline(1.0, color="grey", linewidth=0.8)  # 1: cuBLAS's time
        ax.set_xlabel("M (tokens, global)")
        ax.set_ylabel("fused / cuBLAS time (below 1: faster)")
        ax.set_title(op, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)
