"""memtree: pretraining small language models with hierarchical memories.

memtree is the one import name the project installs. Its stages are `memtree.pipeline`,
`memtree.clustering`, `memtree.memstore`, `memtree.training`, `memtree.kernels` and `memtree.eval`;
in the repository their folders sit at the top level beside this one, and pyproject.toml's
`package-dir` maps them under `memtree` (a wheel puts them in `memtree/`, an editable install
maps them). This package itself is the bottom layer every stage may import: configuration
(`memtree.config`), atomic file I/O (`memtree.io`) and the `memtree` command dispatcher
(`memtree.cli`); importing it imports no stage.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

STAGES = ("pipeline", "clustering", "memstore", "training", "kernels", "eval")


class _SourceTreeStages(importlib.abc.MetaPathFinder):
    """Finds `memtree.<stage>` in the stage folders beside this package, when this package was
    imported from a source checkout (an editable install, or `PYTHONPATH=<checkout>` with no
    install, as bench/device/device_check.py runs on a machine with no package index).

    It goes first on `sys.meta_path`: the stages that belong to this memtree/ are the folders
    beside it, also where an editable install of another checkout would map them elsewhere. It
    answers only those six names; a wheel has its stages inside memtree/ and installs no finder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        head, _, stage = fullname.partition(".")
        if head != __name__ or stage not in STAGES:
            return None
        folder = self.root / stage
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _find_stages_in_a_source_tree() -> None:
    here = Path(__file__).resolve().parent
    if (here / "pipeline").is_dir() or not (here.parent / "pipeline" / "__init__.py").is_file():
        return  # an installed wheel (stages inside memtree/), or no source tree around
    if not any(isinstance(f, _SourceTreeStages) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceTreeStages(here.parent))


_find_stages_in_a_source_tree()
