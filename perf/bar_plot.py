"""Grouped bar charts for the perf scripts' PNGs (matplotlib when importable, else a note on
stderr and no file)."""

import sys


def grouped_bars(path, groups: list, series: dict, ylabel: str, width: float = 8.0) -> bool:
    """One group of bars per entry of `groups`, one bar per series (name -> values aligned with
    groups; None draws nothing). Returns whether the file was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"no plot ({type(exc).__name__})", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(width, 4))
    step = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * step for j in range(len(groups))], [v or 0 for v in values], step, label=name)
    ax.set_xticks([j + 0.4 - step / 2 for j in range(len(groups))], groups, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
