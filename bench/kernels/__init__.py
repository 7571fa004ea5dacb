"""Benchmarks of the memory kernels: the Triton kernels against gathered baselines, every read
path, host against device time, launch-configuration sweeps (ffn, tuning: their shared parts)."""
