"""Benchmarks of the research systems beside the core: CAMELoT, the context bank, product-key
memory."""
