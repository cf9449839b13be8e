"""PNG plots of a suite run: TFLOP/s against S, one figure per (direction, dtype, D, causal),
one line per implementation.

    python perf/plot_suite.py DIR      # reads DIR/suite.csv, writes DIR/*.png
"""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bar_plot import save_png  # noqa: E402  (perf/ is on the path)


def plot(csv_path, out_dir) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The sweep at constant tokens (older files have no "point" column: all sweep).
    rows = [r for r in csv.DictReader(open(csv_path)) if r.get("point", "sweep") == "sweep"]
    groups = {}
    for r in rows:
        if r["tflops"]:
            key = (r["direction"], r["dtype"], r["head_dim"], r["causal"])
            groups.setdefault(key, {}).setdefault(r["impl"], []).append((int(r["seqlen"]), float(r["tflops"])))
    written = []
    for (direction, dtype, head_dim, causal), by_impl in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl, points in by_impl.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    linewidth=2.5 if impl == "cute_flash" else 1.2, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (B = 32768 / S)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{direction} {dtype} D={head_dim} causal={causal} — {rows[0]['gpu']} {rows[0]['date']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = Path(out_dir) / f"{direction}_{dtype}_d{head_dim}_{'causal' if causal == 'True' else 'full'}.png"
        fig.tight_layout()
        save_png(fig, path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    print(plot(directory / "suite.csv", directory))
