"""Benchmarks of the clustering pipeline: its stages against their baselines, its scale, and
issue #37's targets; the stage modules (embed, tree, assign, e2e) and what they share (common)."""
