"""clustering: text embedding, balanced hierarchical k-means, and greedy routing.

This package owns the mapping *text → cluster path* used at every point of
memtree's life: offline (the pipeline embeds windows and builds the tree),
during training (each sequence carries the path its windows were routed to),
and at query time (a question's text is embedded and routed the same way).

- `clustering.embed`: loads all-MiniLM-L6-v2 offline (torch, or the int8 OpenVINO export of
  `clustering.embed_export`) and embeds long windows.
- `clustering.kmeans`: balanced mini-batch k-means, the nodes of a level fitted together.
- `clustering.tree`: the tree format, building level by level, loading.
- `clustering.bottomup`: a tree built from its leaves up (`tree.method: bottomup`).
- `clustering.route`: batched greedy root-to-leaf traversal.
"""

from memtree.clustering.route import route, route_texts
from memtree.clustering.tree import Tree, load_tree

__all__ = ["Tree", "load_tree", "route", "route_texts"]
