"""PNG plots of a serving benchmark: latency CDFs and output throughput over time.

matplotlib is imported here, with the Agg backend, only when plots are drawn; nothing needs a display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from serve_metrics import LATENCY_NAMES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(samples_ms: dict[str, list[float]], path: Path, title: str) -> Path:
    """One panel per latency kind (TTFT, TPOT, ITL, E2E): the fraction of samples at or below x."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, LATENCY_NAMES.items()):
        values = np.sort(np.asarray(samples_ms.get(key, []), dtype=np.float64))
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
            for q, style in ((50, ":"), (90, "--"), (99, "-.")):
                ax.axvline(np.percentile(values, q), color="grey", linestyle=style, linewidth=0.8, label=f"p{q}")
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name} ({values.size} samples)", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(bin_edges_s: np.ndarray, tokens_per_s: np.ndarray, overall_tok_s: float, path: Path,
                    title: str) -> Path:
    """Output tokens per second in each time bin of the run, and the run's overall rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar(bin_edges_s[:-1], tokens_per_s, width=np.diff(bin_edges_s), align="edge", edgecolor="white")
    ax.axhline(overall_tok_s, color="grey", linestyle="--", linewidth=0.8,
               label=f"whole run: {overall_tok_s:.1f} tok/s")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
