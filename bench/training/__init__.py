"""Benchmarks of training and generation: memory training steps, losses across devices, the
sharded bank, `memtree generate`."""
