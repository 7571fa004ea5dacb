"""memtree: pretraining small language models with hierarchical memories.

This package is the bottom layer every stage may import: configuration
(`memtree.config`), atomic file I/O (`memtree.io`) and the `memtree` command
dispatcher (`memtree.cli`). The stages themselves live in the top-level
packages `pipeline`, `clustering`, `memstore`, `training`, `kernels`, `eval`.
"""

__version__ = "0.1.0"
