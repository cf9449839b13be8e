"""Grouped bar charts for the perf scripts' PNGs (matplotlib when importable, else a note on
stderr and no file), and the one way they all write a figure (save_png)."""

import io
import sys
from pathlib import Path


def save_png(fig, path, dpi: int = 120) -> None:
    """Write fig as a PNG of at most 256 colours where Pillow is importable (matplotlib needs
    it): plots have a few colours, and the palette file is ~3x smaller than matplotlib's RGBA
    one. The working tree travels to the GPU machine beside the ~57 MB device stack within
    64 MiB, so committed plots must stay small."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    try:
        from PIL import Image
    except ImportError:
        Path(path).write_bytes(buffer.getvalue())
        return
    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)


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
    save_png(fig, path)
    return True
