"""Benchmarks of the clustering library: tree building, routing, restarts, stability, the int8
embedder."""
