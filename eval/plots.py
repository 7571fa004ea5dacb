"""Plot helpers shared by eval's reports: a matplotlib figure without a GUI backend, saved
atomically.

matplotlib is imported only when a figure is made, so evaluations that write no PNG never load it.
"""

from __future__ import annotations

from pathlib import Path

from memtree.io import atomic_path


def new_figure(width: float = 6.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110)


def save_png(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
