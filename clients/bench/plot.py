"""``bench serve --plot``: histograms of TTFT, TPOT, ITL and end-to-end latency, to a PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, work without a display

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
import numpy as np  # noqa: E402

_PANELS = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)


def draw(samples_s: dict[str, list[float]], config: dict, path: Path) -> None:
    """One histogram per latency, in milliseconds, with the p50 and p99 marked."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for axis, (name, title) in zip(axes.flat, _PANELS, strict=True):
        values = np.asarray(samples_s[name]) * 1000.0
        axis.set_title(f"{title} ({len(values)} samples)")
        axis.set_xlabel("ms")
        axis.set_ylabel("count")
        if len(values) == 0:
            axis.text(0.5, 0.5, "no samples", ha="center", va="center", transform=axis.transAxes)
            continue
        axis.hist(values, bins=min(50, max(10, len(values) // 5)), color="tab:blue", alpha=0.8)
        for percentile, style in ((50, "--"), (99, ":")):
            mark = np.percentile(values, percentile)
            axis.axvline(mark, color="black", linestyle=style, label=f"p{percentile} {mark:.1f}")
        axis.legend()
    figure.suptitle(
        f"{config['backend']} {config['model']}: concurrency {config['concurrency']}, "
        f"{config['num_prompts']} prompts, output {config['output_len']} tokens"
    )
    figure.savefig(path, dpi=100)
    plt.close(figure)
